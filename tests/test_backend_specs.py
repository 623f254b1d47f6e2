"""The shipped backends' specs point at a launcher that exists and a default config for that backend."""

import importlib.util

from critic_adapters.common.registry import backend_spec
from critic_adapters.common.tests.helpers import run_pytest


def test_every_shipped_backend_names_its_launcher_and_default_config():
    for name in ("fsdp", "megatron", "veomni"):
        spec = backend_spec(name)
        assert spec.launcher_module == f"critic_adapters.backends.{name}.train"
        assert importlib.util.find_spec(spec.launcher_module) is not None
        with open(spec.default_config_path) as f:
            assert f"backend: {name}" in f.read()


if __name__ == "__main__":
    run_pytest(__file__)
