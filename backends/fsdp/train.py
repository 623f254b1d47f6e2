"""Train a PPO critic with the FSDP2 engine: python -m critic_adapters.backends.fsdp.train [CONFIG.yaml ...] [key=value ...]

The one launcher (python -m critic_adapters.train --backend fsdp; common/job/launcher.py) with its backend
fixed: the same flags, keys and defaults.
"""

from ...common.job.launcher import LauncherSpec, exit_process, launch


def main(argv: list[str] | None = None) -> int:
    return launch(LauncherSpec(module=__spec__.name, doc=__doc__, backend="fsdp"), argv)


if __name__ == "__main__":
    exit_process(main())
