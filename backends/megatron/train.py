"""Train a PPO critic with the megatron-core engine: python -m critic_adapters.backends.megatron.train [CONFIG.yaml ...] [key=value ...]

  python -m critic_adapters.backends.megatron.train                    # the default job: TP 2, so 2 CPU processes
  python -m critic_adapters.backends.megatron.train --nproc 4 cfg.yaml engine.parallel.tensor=2 engine.parallel.pipeline=2
  python -m critic_adapters.backends.megatron.train --nproc 2 engine.parallel.tensor=1 engine.parallel.context=2
  torchrun --nproc_per_node 8 -m critic_adapters.backends.megatron.train cfg.yaml engine.parallel.tensor=4
  python -m critic_adapters.backends.megatron.train cfg.yaml --resume  # continue from the latest checkpoint
  python -m critic_adapters.backends.megatron.train cfg.yaml --dry-run # validate config + data, no training

Without --nproc it starts the processes engine.parallel needs (tensor x pipeline x context); data
parallel is the world size divided by tensor x pipeline x context. Keys: common/config.py or
--print-config; the launcher is common/launcher.py, shared by every backend.
"""

from __future__ import annotations

import sys

from ...common.launcher import LauncherSpec, launch


def main(argv: list[str] | None = None) -> int:
    spec = LauncherSpec(backend="megatron", module=__spec__.name, doc=__doc__)
    return launch(spec, argv)


if __name__ == "__main__":
    sys.exit(main())
