"""The package as pip sees it: the wheel holds the product and its run-time data, not the tests; it
declares its dependencies and extras; the dev venv's pins fall inside the declared ranges; a backend
whose library is missing is refused naming the install line; the console script dispatches."""

from __future__ import annotations

import dataclasses
import email.parser
import types
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
from packaging.requirements import Requirement

from critic_adapters.common.engine import registry
from critic_adapters.common.tests.helpers import run_pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
# The dev venv's environment: the pins are for Python 3.11 (tools/setup.sh).
PIN_ENVIRONMENT = {"python_version": "3.11", "python_full_version": "3.11.7", "extra": ""}


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11's tomllib")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _pins() -> dict[str, str]:
    """{normalised name: version} of every `name==version` line the dev venv installs."""
    pins = {}
    for name in ("base.txt", "ray.txt", "veomni.txt", "constraints.txt"):
        with open(os.path.join(REPO, "requirements", name)) as f:
            for line in f:
                line = line.split("#")[0].strip()
                if "==" in line:
                    requirement = Requirement(line)
                    pins[_normal(requirement.name)] = str(requirement.specifier).removeprefix("==")
    pins["torch"] = "2.13.0"  # tools/setup.sh's TORCH_SPEC default, installed first
    return pins


def _normal(name: str) -> str:
    return name.lower().replace("_", "-")


def _declared() -> list[tuple[str, Requirement]]:
    project = _pyproject()["project"]
    out = [("core", Requirement(text)) for text in project["dependencies"]]
    for extra, texts in project["optional-dependencies"].items():
        out += [(extra, Requirement(text)) for text in texts]
    return out


# Extras the dev venv does not install as declared: verl lives in an overlay with its own transformers
# (requirements/verl-overlay.txt), trl's newest side versions only in overlays.
_NOT_IN_THE_VENV = {"verl"}


def test_the_dev_venv_pins_fall_inside_the_declared_ranges():
    pins = _pins()
    outside = []
    for extra, requirement in _declared():
        if extra in _NOT_IN_THE_VENV or (requirement.marker and not requirement.marker.evaluate(PIN_ENVIRONMENT)):
            continue
        pinned = pins.get(_normal(requirement.name))
        if pinned is not None and not requirement.specifier.contains(pinned, prereleases=True):
            outside.append(f"[{extra}] {requirement} vs pinned {pinned}")
    assert not outside, f"requirements/ pins outside pyproject.toml's ranges: {outside}"
    # and the verl overlay's pins fall inside the verl extra and the core ranges
    with open(os.path.join(REPO, "requirements", "verl-overlay.txt")) as f:
        overlay = {_normal(Requirement(line).name): str(Requirement(line).specifier).removeprefix("==")
                   for line in (raw.split("#")[0].strip() for raw in f) if "==" in line}
    for extra, requirement in _declared():
        if extra in ("core", "verl") and _normal(requirement.name) in overlay:
            assert requirement.specifier.contains(overlay[_normal(requirement.name)]), (extra, str(requirement))


def test_a_pin_outside_a_range_is_found():
    """The check above can fail: a transformers pin past the declared upper bound is reported."""
    requirement = next(r for extra, r in _declared() if extra == "core" and r.name == "transformers")
    assert not requirement.specifier.contains("99.0.0")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel `pip wheel --no-deps .` builds from a copy of the source tree (the build writes
    build/ and *.egg-info beside the sources, so never in the checkout)."""
    import importlib.util

    for needed in ("pip", "setuptools"):  # the build runs offline, without isolation (found, not imported here)
        if importlib.util.find_spec(needed) is None:
            pytest.skip(f"this environment has no {needed} to build the wheel offline (tools/env-matrix builds it "
                        f"for its environments)")
    root = tmp_path_factory.mktemp("wheel")
    source = root / "src"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".venv", ".overlays", "bazel-*", "outputs", "runs", "__pycache__", ".git", ".gpu-wheels"))
    # setuptools comes with the venv's torch; no isolation: nothing is downloaded
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", str(source), "-w", str(root / "dist")],
                   check=True, capture_output=True, text=True, timeout=300)
    (path,) = (root / "dist").glob("critic_adapters-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_holds_the_product_and_its_data_and_no_tests(wheel):
    names = set(wheel.namelist())
    for needed in ("critic_adapters/__init__.py", "critic_adapters/train.py", "critic_adapters/console.py",
                   "critic_adapters/common/job/default_job.yaml", "critic_adapters/common/testdata/configs/qwen2.json",
                   "critic_adapters/bench/configs/qwen2_5_0_5b.json", "critic_adapters/backends/megatron/engine.py",
                   "critic_adapters/integrations/verl/engine.py", "critic_adapters/integrations/ray/group.py",
                   "critic_adapters/serve/app.py", "critic_adapters/serve/client.py"):
        assert needed in names, f"the wheel lacks {needed}"
    tests = sorted(n for n in names if "/tests/" in n or os.path.basename(n).startswith("test_"))
    assert not tests, f"the wheel ships test modules: {tests[:5]}"
    configs = {n for n in names if n.startswith("critic_adapters/common/testdata/configs/")}
    assert len(configs) == len(os.listdir(os.path.join(REPO, "common", "testdata", "configs")))


def test_the_wheel_declares_its_dependencies_extras_and_entry_points(wheel):
    (metadata,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    message = email.parser.Parser().parsestr(wheel.read(metadata).decode())
    requires = [Requirement(text) for text in message.get_all("Requires-Dist")]
    core = {_normal(r.name) for r in requires if not r.marker}
    assert {"torch", "transformers", "safetensors", "omegaconf", "pyarrow"} <= core, core
    extras = set(message.get_all("Provides-Extra"))
    assert {"fsdp", "megatron", "veomni", "ray", "verl", "lora", "trl", "vision", "serve", "test"} <= extras, extras
    megatron = [r for r in requires if r.name == "megatron-core"]
    assert {str(r.specifier) for r in megatron if r.marker.evaluate({"extra": "megatron", "python_version": "3.11"})} \
        == {"<0.17,>=0.16.1"}
    assert message["Requires-Python"] == "<3.14,>=3.10"
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(entry_points).decode()
    assert "critic-adapters = critic_adapters.console:main" in text
    assert "[verl.plugins]" in text and "critic_adapters = critic_adapters.integrations.verl" in text


def test_a_backend_whose_library_is_missing_is_refused_with_its_install_line(monkeypatch):
    spec = dataclasses.replace(registry.backend_spec("veomni"), requires=("veomni==0.1.11", "no-such-library>=1"))
    monkeypatch.setitem(registry.BACKENDS, "veomni-missing", spec)
    registry.check_engine_config("veomni-missing", registry.EngineConfig())  # settings alone: accepted
    with pytest.raises(ImportError, match="veomni-missing backend cannot run here"):
        registry.build_engine("veomni-missing", registry.EngineConfig(), dist=types.SimpleNamespace(
            device=torch.device("cpu")))
    with pytest.raises(ImportError) as err:  # what build_engine, the plan and the launcher call
        registry.check_installed("veomni-missing")
    message = str(err.value)
    import importlib.metadata

    try:
        found = f"veomni {importlib.metadata.version('veomni')} is installed; it needs veomni==0.1.11"
    except importlib.metadata.PackageNotFoundError:
        found = "veomni is not installed"
    assert found in message, message
    assert "no-such-library is not installed" in message, message
    assert "pip install --no-deps 'veomni==0.1.12'" in message, message
    registry.check_installed("fsdp")  # torch's own: never refused
    for name in ("megatron", "veomni"):  # installed here (the dev venv), or refused with the extra's line
        try:
            registry.check_installed(name)
        except ImportError as refused:
            assert registry.backend_spec(name).install in str(refused), refused


def test_the_console_script_dispatches_to_the_module_clis(tmp_path, capsys):
    from critic_adapters.console import main

    assert main(["--help"]) == 0 and "critic-adapters train" in capsys.readouterr().out
    assert main(["trian"]) == 2 and "unknown command 'trian'" in capsys.readouterr().err
    assert main(["demo", str(tmp_path / "tiny"), "--family", "llama"]) == 0
    assert "LlamaForTokenClassification" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "tiny")]) == 0
    assert "family        llama -> LlamaForTokenClassification" in capsys.readouterr().out


if __name__ == "__main__":
    run_pytest(__file__)


def test_the_launcher_refuses_a_backend_whose_library_is_missing_and_writes_nothing(monkeypatch, tmp_path):
    from critic_adapters.common.tests.torchrun import run_launcher_in_process

    spec = dataclasses.replace(registry.backend_spec("fsdp"), requires=("no-such-library>=1",),
                               install="pip install no-such-library")
    monkeypatch.setitem(registry.BACKENDS, "fsdp-missing", spec)
    run_dir = tmp_path / "run"
    for extra in ((), ("--dry-run",)):
        result = run_launcher_in_process("critic_adapters.train", "--backend", "fsdp-missing", "--nproc", "2",
                                         f"trainer.run_dir={run_dir}", *extra)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "the fsdp-missing backend cannot run here: no-such-library is not installed. Install: pip install " \
               "no-such-library" in result.stderr, result.stderr
        assert not run_dir.exists()
