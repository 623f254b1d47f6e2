"""critic-adapters COMMAND ...: the package's command line, installed with the package.

  critic-adapters train [--backend NAME] [--nproc N] [CONFIG.yaml ...] [key=value ...]
                                         train a critic (python -m critic_adapters.train; --help for the keys)
  critic-adapters serve --token-file F [--nproc N] [CONFIG.yaml ...] [key=value ...]
                                         the critic over HTTP (python -m critic_adapters.serve, docs/SERVE.md)
  critic-adapters inspect CKPT           what a checkpoint is and how it would load
  critic-adapters convert SRC DST        any critic format -> HF TokenClassification
  critic-adapters values CKPT ...        values of some tokens, or of a rollouts file
  critic-adapters demo OUT_DIR           write the embedded tiny model and print its values

Each command is the module CLI it names, with the same arguments (COMMAND --help).
"""

from __future__ import annotations

import sys

_CHECKPOINT_COMMANDS = ("inspect", "convert", "values", "demo")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from .common.job.launcher import exit_process
        from .train import main as train

        exit_process(train(rest))
    if command == "serve":
        from .serve.launch import main as serve

        return serve(rest)
    if command in _CHECKPOINT_COMMANDS:
        from .common.valuehead.cli import main as checkpoint_cli

        return checkpoint_cli(argv)
    print(f"critic-adapters: unknown command {command!r}; the commands are train, serve, "
          f"{', '.join(_CHECKPOINT_COMMANDS)} (critic-adapters --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
