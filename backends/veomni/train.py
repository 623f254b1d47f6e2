"""Train a PPO critic with the VeOmni engine: python -m critic_adapters.backends.veomni.train [CONFIG.yaml ...] [key=value ...]

  python -m critic_adapters.backends.veomni.train --nproc 2                      # the embedded default job
  python -m critic_adapters.backends.veomni.train --nproc 2 backends/veomni/configs/default.yaml
  python -m critic_adapters.backends.veomni.train cfg.yaml engine.optim.lr=3e-5 data.train_path=rollouts.parquet
  torchrun --nproc_per_node 8 -m critic_adapters.backends.veomni.train cfg.yaml    # one node, 8 GPUs
  python -m critic_adapters.backends.veomni.train cfg.yaml --resume                 # continue from the latest checkpoint
  python -m critic_adapters.backends.veomni.train cfg.yaml --dry-run                # validate config + data, no training
  bazel run //backends/veomni:train -- --nproc 2 trainer.run_dir=/tmp/critic

Without torchrun, --nproc N > 1 relaunches itself under torchrun (gloo on CPU, nccl on GPU).
Keys: see common/config.py (every field has a docstring) or --print-config. The launcher itself is
common/launcher.py, shared by every backend; this file holds the VeOmni backend's defaults.
"""

from __future__ import annotations

import sys

from ...common.launcher import LauncherSpec, launch


def main(argv: list[str] | None = None) -> int:
    spec = LauncherSpec(backend="veomni", module=__spec__.name, doc=__doc__)
    return launch(spec, argv)


if __name__ == "__main__":
    sys.exit(main())
