"""The tree works when a stack vendors it under another package path, beside its own `common`.

Larger RL stacks copy this code into their own tree (here `mystack/_vendor/critic_adapters/`), and
many have a top-level module named `common`; absolute imports, registry strings or a relaunch by a
literal module name would then load the stack's `common`, or our un-vendored copy. A stand-in
`critic_adapters` that refuses to import catches the latter.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "vendored_update_worker.py")
VENDORED = "mystack._vendor.critic_adapters"


def _vendor(root) -> None:
    """mystack/_vendor/critic_adapters/ = our package root's __init__.py, common/ and backends/."""
    target = root / "mystack" / "_vendor" / "critic_adapters"
    target.mkdir(parents=True)
    for package in (root / "mystack", root / "mystack" / "_vendor"):
        (package / "__init__.py").write_text("")
    shutil.copy(os.path.join(REPO, "__init__.py"), target / "__init__.py")
    for part in ("common", "backends"):
        shutil.copytree(os.path.join(REPO, part), target / part,
                        ignore=shutil.ignore_patterns("__pycache__", "tests", "BUILD.bazel"))


def _decoys(root, *, block_ours: bool):
    """A stack's own top-level `common`; optionally a `critic_adapters` that refuses to be imported."""
    decoys = root / ("decoys-blocking" if block_ours else "decoys")
    (decoys / "common").mkdir(parents=True, exist_ok=True)
    (decoys / "common" / "__init__.py").write_text("DECOY = True  # the stack's own module named common\n")
    if block_ours:
        (decoys / "critic_adapters").mkdir(exist_ok=True)
        (decoys / "critic_adapters" / "__init__.py").write_text(
            "raise ImportError('the vendored copy imported the un-vendored critic_adapters')\n")
    return decoys


def _env(*paths):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return dict(env, PYTHONPATH=os.pathsep.join(map(str, paths)), OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1")


def _update(package, model_dir, out, env):
    out.mkdir()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             WORKER, package, model_dir, str(out)], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    return json.load(open(out / "result.json"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack")
    _vendor(root)
    model_dir = save_tiny_causal_lm("qwen2", str(root / "model"))
    return root, model_dir


def test_a_vendored_copy_trains_like_ours_beside_a_foreign_common(stack):
    root, model_dir = stack
    ours = _update("critic_adapters", model_dir, root / "ours", _env(_decoys(root, block_ours=False)))
    vendored = _update(VENDORED, model_dir, root / "vendored", _env(_decoys(root, block_ours=True), root))
    assert vendored["engine_module"] == f"{VENDORED}.backends.fsdp.engine"
    assert vendored["common_is_the_stacks"] and ours["common_is_the_stacks"]
    assert vendored["leaked"] == []
    assert vendored["format"] == ours["format"] == "causal-lm"
    assert vendored["value_loss"] == pytest.approx(ours["value_loss"], abs=1e-7)
    assert vendored["grad_norm"] == pytest.approx(ours["grad_norm"], rel=1e-6)
    assert (root / "vendored" / "export" / "model.safetensors").is_file()


def test_the_vendored_launcher_relaunches_itself_by_its_own_name(stack):
    root, _ = stack
    run_dir = root / "run"
    result = subprocess.run(
        [sys.executable, "-m", f"{VENDORED}.backends.fsdp.train", "--nproc", "2", f"trainer.run_dir={run_dir}",
         "data.num_rollouts=64", "data.mini_batch_size=16", "trainer.epochs=1", "trainer.plot=false",
         "trainer.tensorboard=false", "trainer.progress=false"],
        env=_env(_decoys(root, block_ours=True), root), capture_output=True, text=True, timeout=600, cwd=root)
    assert result.returncode == 0, result.stderr[-5000:]
    assert result.stdout.strip().splitlines()[-1].startswith("final explained_variance=")
    assert (run_dir / "hf_export" / "config.json").is_file()


if __name__ == "__main__":
    run_pytest(__file__)
