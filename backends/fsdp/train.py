"""Train a PPO critic with the FSDP2 engine: python -m critic_adapters.backends.fsdp.train [CONFIG.yaml ...] [key=value ...]

  ./run.sh main                                                   # the embedded default job, 2 processes
  python -m critic_adapters.backends.fsdp.train --nproc 2                 # the same
  python -m critic_adapters.backends.fsdp.train cfg.yaml engine.optim.lr=3e-5 data.train_path=rollouts.parquet
  torchrun --nproc_per_node 8 -m critic_adapters.backends.fsdp.train cfg.yaml    # one node, 8 GPUs
  python -m critic_adapters.backends.fsdp.train cfg.yaml --resume                 # continue from the latest checkpoint
  python -m critic_adapters.backends.fsdp.train cfg.yaml --dry-run                # validate config + data, no training

The one launcher (python -m critic_adapters.train, common/launcher.py) with backend fsdp: the same
flags, keys and defaults. Without torchrun, --nproc N > 1 relaunches itself under torchrun (gloo on
CPU, nccl on GPU); without --nproc it starts the processes engine.parallel needs. Keys:
common/config.py (every field has a docstring) or --print-config.
"""

from __future__ import annotations

import sys

from ...common.launcher import LauncherSpec, launch


def main(argv: list[str] | None = None) -> int:
    return launch(LauncherSpec(module=__spec__.name, doc=__doc__, backend="fsdp"), argv)


if __name__ == "__main__":
    sys.exit(main())
