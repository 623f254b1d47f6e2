"""Train a PPO critic on any backend: python -m critic_adapters.train [--backend NAME] [CONFIG.yaml ...] [key=value ...]

  ./run.sh main                                                    # the embedded default job, fsdp, 2 processes
  python -m critic_adapters.train --backend fsdp --nproc 2                 # the same
  python -m critic_adapters.train --backend megatron                       # its default job: TP 2, so 2 processes
  python -m critic_adapters.train --backend veomni --nproc 2 engine.parallel.ulysses=2
  python -m critic_adapters.train cfg.yaml engine.optim.lr=3e-5 data.train_path=rollouts.parquet
  torchrun --nproc_per_node 8 -m critic_adapters.train --backend fsdp cfg.yaml    # one node, 8 GPUs
  python -m critic_adapters.train cfg.yaml --resume                 # continue from the latest checkpoint
  python -m critic_adapters.train cfg.yaml --dry-run                # validate config + data, no training

The backend comes from --backend, else the config's `backend`, else fsdp;
`python -m critic_adapters.backends.<name>.train` is this launcher with the backend fixed. Without
torchrun, --nproc N > 1 relaunches itself under torchrun (gloo on CPU, nccl on GPU); without
--nproc it starts the processes engine.parallel needs (tensor x pipeline x context x ulysses).
Keys: common/engine/config.py (every field has a docstring) or --print-config. The launcher is
common/job/launcher.py.
"""

from __future__ import annotations

from .common.job.launcher import LauncherSpec, exit_process, launch


def main(argv: list[str] | None = None) -> int:
    return launch(LauncherSpec(module=__spec__.name, doc=__doc__), argv)


if __name__ == "__main__":
    exit_process(main())
