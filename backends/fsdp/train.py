"""Train a PPO critic with the FSDP2 engine: python -m backends.fsdp.train [CONFIG.yaml ...] [key=value ...]

  ./run.sh main                                                   # the embedded default job, 2 processes
  python -m backends.fsdp.train --nproc 2 backends/fsdp/configs/default.yaml
  python -m backends.fsdp.train cfg.yaml engine.optim.lr=3e-5 data.train_path=rollouts.parquet
  torchrun --nproc_per_node 8 -m backends.fsdp.train cfg.yaml    # one node, 8 GPUs
  python -m backends.fsdp.train cfg.yaml --resume                 # continue from the latest checkpoint
  python -m backends.fsdp.train cfg.yaml --dry-run                # validate config + data, no training

Without torchrun, --nproc N > 1 relaunches itself under torchrun (gloo on CPU, nccl on GPU).
Keys: see common/config.py (every field has a docstring) or --print-config.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.yaml")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m backends.fsdp.train", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("items", nargs="*", help="YAML config files and key=value overrides")
    parser.add_argument("--nproc", type=int, default=1, help="processes to launch when not under torchrun")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in run_dir")
    parser.add_argument("--dry-run", action="store_true", help="check config, model and rollouts; do not train")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return parser.parse_args(argv)


def _relaunch_under_torchrun(nproc: int, argv: list[str]) -> int:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "backends.fsdp.train", *argv]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc))))
    return subprocess.call(command, env=env)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "BUILD_WORKING_DIRECTORY" in os.environ:  # `bazel run`: relative paths mean the user's directory
        os.chdir(os.environ["BUILD_WORKING_DIRECTORY"])
    args = _parse(argv)
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ and not (args.print_config or args.dry_run):
        passthrough = [a for a in argv if not a.startswith("--nproc")]
        if "--nproc" in argv:
            i = argv.index("--nproc")
            passthrough = argv[:i] + argv[i + 2:]
        return _relaunch_under_torchrun(args.nproc, passthrough)

    from common.config import load_train_config, to_yaml

    yamls = [item for item in args.items if "=" not in item]
    overrides = [item for item in args.items if "=" in item]
    if args.resume:
        overrides.append("trainer.resume=true")
    try:
        config = load_train_config(yamls or [DEFAULT_CONFIG], overrides)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(config))
        return 0

    from common.distributed import init_distributed, shutdown
    from common.trainer import dry_run, run_training

    dist = init_distributed()
    try:
        if args.dry_run:
            dry_run(config, dist)
        else:
            run_training(config, dist)
    except ValueError as err:
        if dist.is_main:
            print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
