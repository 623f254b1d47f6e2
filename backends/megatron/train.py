"""Train a PPO critic with the megatron-core engine: python -m critic_adapters.backends.megatron.train [CONFIG.yaml ...] [key=value ...]

The one launcher (python -m critic_adapters.train --backend megatron; common/job/launcher.py) with its backend
fixed: the same flags, keys and defaults.
Its default job runs at TP 2 (2 processes); `--nproc 4 engine.parallel.tensor=2
engine.parallel.pipeline=2` or `engine.parallel.context=2` split it other ways.
"""

from ...common.job.launcher import LauncherSpec, exit_process, launch


def main(argv: list[str] | None = None) -> int:
    return launch(LauncherSpec(module=__spec__.name, doc=__doc__, backend="megatron"), argv)


if __name__ == "__main__":
    exit_process(main())
