"""The trl shim and the loader across trl 0.27, 1.12 (default venv), >= 1.13 and no trl.

Side trl versions live in PYTHONPATH overlays under .overlays/ (installed by tools/setup.sh),
never in the default venv. Each environment runs trl_env_check.py in its own interpreter.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from critic_adapters.common.tests import checkpoint_builders as build
from critic_adapters.common.tests.helpers import padded_batch, run_pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
OVERLAYS = os.environ.get("CRITIC_TRL_OVERLAYS", os.path.join(REPO, ".overlays"))

# name, overlay (None = the default venv), expected shim result, extra args
ENVIRONMENTS = [
    ("trl-0.27.0", "trl-0.27.0", "class", ["--trl-version", "0.27.0", "--expect-module", "trl.experimental.ppo"]),
    ("trl-1.12.0", None, "class", ["--trl-version", "1.12.0", "--expect-module", "trl.experimental.ppo"]),
    ("trl-1.13.0", "trl-1.13.0", "none", ["--trl-version", "1.13.0"]),
    ("no-trl", None, "none", ["--block", "trl"]),
]


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    """trl checkpoints written by trl 1.12's own save_pretrained, with trl's own values."""
    root = tmp_path_factory.mktemp("trl-fixtures")
    cases = {}
    for name, builder, kwargs in [("inline", build.trl_value_head, {}),
                                  ("sharded", build.trl_value_head, {"storage": "sharded"}),
                                  ("sidecar", build.trl_sidecar, {})]:
        path, reference = builder(str(root), **kwargs)
        os.rename(path, root / name)
        ids, mask = padded_batch(seed=1)
        with torch.no_grad():
            values = reference(ids, mask)
        values = torch.where(mask.bool(), values, torch.zeros_like(values))
        torch.save({"ids": ids, "mask": mask, "values": values}, root / f"{name}.pt")
        cases[name] = True
    (root / "cases.json").write_text(json.dumps(sorted(cases)))
    return str(root)


@pytest.mark.parametrize("name,overlay,expect,extra", ENVIRONMENTS, ids=[e[0] for e in ENVIRONMENTS])
def test_environment(fixtures, name, overlay, expect, extra):
    path = list(sys.path)
    if overlay is not None:
        overlay_dir = os.path.join(OVERLAYS, overlay)
        assert os.path.isdir(overlay_dir), (
            f"missing trl overlay {overlay_dir}; tools/setup.sh installs it (or set CRITIC_TRL_OVERLAYS)")
        path.insert(0, overlay_dir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p), TRL_EXPERIMENTAL_SILENCE="1")
    result = subprocess.run(
        [sys.executable, "-m", "critic_adapters.common.tests.trl_env_check", "--fixtures", fixtures, "--expect", expect, *extra],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, f"{name}:\n{result.stdout}\n{result.stderr[-3000:]}"
    assert "trl environment OK" in result.stdout


def test_shim_falls_back_to_top_level_trl(monkeypatch):
    """A trl with the class only at top level (trl < 0.26) is found through the fallback."""
    import types

    from critic_adapters.common.valuehead.trl_compat import trl_value_head_class

    fake_trl = types.ModuleType("trl")
    fake_trl.AutoModelForCausalLMWithValueHead = type("AutoModelForCausalLMWithValueHead", (), {})
    monkeypatch.setitem(sys.modules, "trl", fake_trl)
    monkeypatch.setitem(sys.modules, "trl.experimental", None)  # None in sys.modules -> ImportError
    monkeypatch.setitem(sys.modules, "trl.experimental.ppo", None)
    assert trl_value_head_class() is fake_trl.AutoModelForCausalLMWithValueHead
    del fake_trl.AutoModelForCausalLMWithValueHead
    assert trl_value_head_class() is None


if __name__ == "__main__":
    run_pytest(__file__)
