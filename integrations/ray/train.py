"""Train a PPO critic through a Ray worker group: python -m critic_adapters.integrations.ray.train [CONFIG.yaml ...] [key=value ...]

  python -m critic_adapters.integrations.ray.train --num-workers 2              # the embedded default job
  python -m critic_adapters.integrations.ray.train cfg.yaml --address auto      # on an existing cluster
  python -m critic_adapters.integrations.ray.train cfg.yaml --num-workers 2 --resume

The same job as a backend's train.py (data, epochs, checkpoints, metrics, plot, export: the one
trainer, common/trainer.py), with the engine's ranks in a RayCriticGroup of Ray actors instead of
torchrun processes; `backend` in the config picks the engine. Without --address it starts a local
Ray cluster (loopback only, no dashboard; integrations/ray/cluster.py). Without --num-workers it
starts as many workers as engine.parallel needs.
"""

from __future__ import annotations

import argparse
import sys


def _parse(argv: list[str]) -> argparse.Namespace:
    from ...common.launcher import LAYERS_HELP

    first, _, rest = __doc__.strip().partition("\n")
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=first,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=f"{rest.strip()}\n\n{LAYERS_HELP}")
    parser.add_argument("items", nargs="*", help="YAML config files and key=value overrides")
    parser.add_argument("--num-workers", type=int, default=None,
                        help="Ray actors, one engine rank each (default: what engine.parallel needs)")
    parser.add_argument("--address", default=None,
                        help="an existing Ray cluster to join (ray.init(address=...)); default: start a local one")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs each actor reserves (default 1)")
    parser.add_argument("--gpus-per-worker", type=float, default=None,
                        help="GPUs each actor reserves (default: 1 when this machine has CUDA, else 0)")
    parser.add_argument("--placement", default="PACK", help="placement group strategy: PACK (default) or SPREAD")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in run_dir")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    args = parser.parse_intermixed_args(argv)
    args.nproc, args.dry_run = args.num_workers, False  # what the shared config loader reads
    return args


def _backend(args) -> str:
    """The config's backend (it picks the engine and its default config layer)."""
    import os

    from ...common.config import load_train_config

    yamls = [item for item in args.items if "=" not in item]
    overrides = [item for item in args.items if "=" in item]
    config = load_train_config(yamls, overrides)
    saved = os.path.join(os.path.abspath(config.trainer.run_dir), "config.yaml")
    if args.resume and not yamls and os.path.isfile(saved):
        config = load_train_config([saved], overrides)
    return config.backend


def main(argv: list[str] | None = None) -> int:
    import torch

    from ...common.config import to_yaml
    from ...common.distributed import DistContext
    from ...common.launcher import LauncherSpec, _fail, _load_config, _say, _say_error
    from ...common.registry import backend_spec
    from ...common.trainer import run_training

    args = _parse(list(sys.argv[1:] if argv is None else argv))
    try:
        backend = _backend(args)
        backend_spec(backend)
        spec = LauncherSpec(backend=backend, module=__spec__.name, doc=__doc__)
        config = _load_config(args, spec, world_size=args.num_workers, say=_say)
    except (ValueError, OSError, FileNotFoundError) as err:
        _say_error(str(err))
        return 2
    if args.print_config:
        print(to_yaml(config))
        return 0
    num_workers = args.num_workers or config.engine.parallel.model_parallel_size
    gpus = args.gpus_per_worker if args.gpus_per_worker is not None else float(torch.cuda.is_available())
    resources = {"CPU": args.cpus_per_worker, **({"GPU": gpus} if gpus else {})}

    from .cluster import ensure_ray, shutdown_ray
    from .group import RayCriticGroup

    def group(engine_config):
        _say(f"starting {num_workers} Ray worker(s), {resources} each ({args.placement})")
        return RayCriticGroup(config.backend, engine_config, num_workers, resources_per_worker=resources,
                              placement_strategy=args.placement)

    driver = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    try:
        ensure_ray(args.address)
        run_training(config, driver, engine_builder=group, world_size=num_workers)
    except BaseException as err:  # noqa: BLE001 - reported as the torchrun job reports it
        return _fail(err, None)
    finally:
        shutdown_ray()
    return 0


if __name__ == "__main__":
    sys.exit(main())
