"""Train a PPO critic with the VeOmni engine: python -m critic_adapters.backends.veomni.train [CONFIG.yaml ...] [key=value ...]

  python -m critic_adapters.backends.veomni.train --nproc 2                      # the embedded default job
  python -m critic_adapters.backends.veomni.train cfg.yaml engine.optim.lr=3e-5 data.train_path=rollouts.parquet
  torchrun --nproc_per_node 8 -m critic_adapters.backends.veomni.train cfg.yaml    # one node, 8 GPUs
  python -m critic_adapters.backends.veomni.train cfg.yaml --resume                 # continue from the latest checkpoint
  python -m critic_adapters.backends.veomni.train cfg.yaml --dry-run                # validate config + data, no training
  bazel run //backends/veomni:train -- --nproc 2 trainer.run_dir=/tmp/critic

The one launcher (python -m critic_adapters.train, common/launcher.py) with backend veomni: the same
flags, keys and defaults. Without torchrun, --nproc N > 1 relaunches itself under torchrun (gloo on
CPU, nccl on GPU); without --nproc it starts the processes engine.parallel needs. Keys:
common/config.py (every field has a docstring) or --print-config.
"""

from __future__ import annotations

import sys

from ...common.launcher import LauncherSpec, launch


def main(argv: list[str] | None = None) -> int:
    return launch(LauncherSpec(module=__spec__.name, doc=__doc__, backend="veomni"), argv)


if __name__ == "__main__":
    sys.exit(main())
