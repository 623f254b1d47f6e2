"""The shipped backends' specs point at a launcher alias that exists, and their default jobs are the
one embedded default job with the backend's own settings on top."""

import importlib.util

from critic_adapters.common.engine.config import load_train_config
from critic_adapters.common.job.launcher import DEFAULT_JOB
from critic_adapters.common.engine.registry import backend_spec
from critic_adapters.common.tests.helpers import run_pytest


def test_every_shipped_backend_names_its_launcher_and_default_job_settings():
    for name in ("fsdp", "megatron", "veomni"):
        spec = backend_spec(name)
        assert spec.launcher_module == f"critic_adapters.backends.{name}.train"
        assert importlib.util.find_spec(spec.launcher_module) is not None
        config = load_train_config([DEFAULT_JOB, ("defaults", spec.job_defaults)], [])
        assert config.engine.model.path == "embedded:qwen2" and config.data.train_path == "embedded:default"
        assert config.engine.parallel.tensor == (2 if name == "megatron" else 1)


if __name__ == "__main__":
    run_pytest(__file__)
