"""Train a PPO critic with the megatron-core engine: python -m critic_adapters.backends.megatron.train [CONFIG.yaml ...] [key=value ...]

  python -m critic_adapters.backends.megatron.train --nproc 2          # the default job: TP 2 on 2 CPU processes
  python -m critic_adapters.backends.megatron.train --nproc 4 cfg.yaml engine.parallel.tensor=2 engine.parallel.pipeline=2
  torchrun --nproc_per_node 8 -m critic_adapters.backends.megatron.train cfg.yaml engine.parallel.tensor=4
  python -m critic_adapters.backends.megatron.train cfg.yaml --resume  # continue from the latest checkpoint
  python -m critic_adapters.backends.megatron.train cfg.yaml --dry-run # validate config + data, no training

Data parallel is the world size divided by tensor x pipeline. Keys: common/config.py or
--print-config; the launcher is common/launcher.py, shared by every backend.
"""

from __future__ import annotations

import os
import sys

from ...common.config import EngineConfig
from ...common.launcher import LauncherSpec, launch

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.yaml")


def check_config(engine: EngineConfig) -> None:
    """Degrees this backend has; the family and the head/layer divisibility are checked by the engine
    before megatron creates any group (backends/megatron/config.py)."""
    engine.parallel.check_supported("megatron", implemented=("tensor", "pipeline", "sequence_parallel"))


def main(argv: list[str] | None = None) -> int:
    spec = LauncherSpec(backend="megatron", module=__spec__.name, default_config=DEFAULT_CONFIG, doc=__doc__,
                        check_config=check_config)
    return launch(spec, argv)


if __name__ == "__main__":
    sys.exit(main())
