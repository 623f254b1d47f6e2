"""Train a PPO critic with the megatron-core engine: python -m critic_adapters.backends.megatron.train [CONFIG.yaml ...] [key=value ...]

  python -m critic_adapters.backends.megatron.train                    # the default job: TP 2, so 2 CPU processes
  python -m critic_adapters.backends.megatron.train --nproc 4 cfg.yaml engine.parallel.tensor=2 engine.parallel.pipeline=2
  python -m critic_adapters.backends.megatron.train --nproc 2 engine.parallel.tensor=1 engine.parallel.context=2
  torchrun --nproc_per_node 8 -m critic_adapters.backends.megatron.train cfg.yaml engine.parallel.tensor=4
  python -m critic_adapters.backends.megatron.train cfg.yaml --resume  # continue from the latest checkpoint
  python -m critic_adapters.backends.megatron.train cfg.yaml --dry-run # validate config + data, no training

The one launcher (python -m critic_adapters.train, common/launcher.py) with backend megatron: the same
flags, keys and defaults. Without torchrun, --nproc N > 1 relaunches itself under torchrun (gloo on
CPU, nccl on GPU); without --nproc it starts the processes engine.parallel needs. Keys:
common/config.py (every field has a docstring) or --print-config.
"""

from __future__ import annotations

import sys

from ...common.launcher import LauncherSpec, launch


def main(argv: list[str] | None = None) -> int:
    return launch(LauncherSpec(module=__spec__.name, doc=__doc__, backend="megatron"), argv)


if __name__ == "__main__":
    sys.exit(main())
