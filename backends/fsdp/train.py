"""Train a PPO critic with the FSDP2 engine: python -m critic_adapters.backends.fsdp.train [CONFIG.yaml ...] [key=value ...]

  ./run.sh main                                                   # the embedded default job, 2 processes
  python -m critic_adapters.backends.fsdp.train --nproc 2 backends/fsdp/configs/default.yaml
  python -m critic_adapters.backends.fsdp.train cfg.yaml engine.optim.lr=3e-5 data.train_path=rollouts.parquet
  torchrun --nproc_per_node 8 -m critic_adapters.backends.fsdp.train cfg.yaml    # one node, 8 GPUs
  python -m critic_adapters.backends.fsdp.train cfg.yaml --resume                 # continue from the latest checkpoint
  python -m critic_adapters.backends.fsdp.train cfg.yaml --dry-run                # validate config + data, no training

Without torchrun, --nproc N > 1 relaunches itself under torchrun (gloo on CPU, nccl on GPU).
Keys: see common/config.py (every field has a docstring) or --print-config. The launcher itself is
common/launcher.py, shared by every backend; this file holds the FSDP backend's defaults.
"""

from __future__ import annotations

import sys

from ...common.launcher import LauncherSpec, launch


def main(argv: list[str] | None = None) -> int:
    spec = LauncherSpec(backend="fsdp", module=__spec__.name, doc=__doc__)
    return launch(spec, argv)


if __name__ == "__main__":
    sys.exit(main())
