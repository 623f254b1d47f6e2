"""Train a PPO critic with the VeOmni engine: python -m critic_adapters.backends.veomni.train [CONFIG.yaml ...] [key=value ...]

The one launcher (python -m critic_adapters.train --backend veomni; common/job/launcher.py) with its backend
fixed: the same flags, keys and defaults.
bazel run //backends/veomni:train -- --nproc 2 trainer.run_dir=/tmp/critic runs it from Bazel.
"""

from ...common.job.launcher import LauncherSpec, exit_process, launch


def main(argv: list[str] | None = None) -> int:
    return launch(LauncherSpec(module=__spec__.name, doc=__doc__, backend="veomni"), argv)


if __name__ == "__main__":
    exit_process(main())
