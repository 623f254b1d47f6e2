"""Train a PPO critic through a Ray worker group: python -m critic_adapters.integrations.ray.train [CONFIG.yaml ...] [key=value ...]

  python -m critic_adapters.integrations.ray.train --nproc 2                     # the embedded default job
  python -m critic_adapters.integrations.ray.train cfg.yaml --address auto       # on an existing cluster
  python -m critic_adapters.integrations.ray.train cfg.yaml --nproc 2 --resume
  python -m critic_adapters.integrations.ray.train --backend megatron --dry-run

The one launcher (python -m critic_adapters.train, common/job/launcher.py: the same flags, keys and
defaults; --num-workers is --nproc) with the engine's ranks in a RayCriticGroup of Ray actors
instead of torchrun processes; the trainer is the same (common/job/trainer.py). Without --address it
starts a local Ray cluster (loopback only, no dashboard; integrations/ray/cluster.py). Without
--nproc it starts as many workers as engine.parallel needs. A dry run checks the config, model and
rollouts in this process and starts no cluster.
"""

from __future__ import annotations

import argparse
import sys

from ...common.job.launcher import LauncherSpec, launch


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-workers", dest="nproc", type=int, help="the same as --nproc: Ray actors, one engine "
                        "rank each")
    parser.add_argument("--address", default=None,
                        help="an existing Ray cluster to join (ray.init(address=...)); default: start a local one")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs each actor reserves (default 1)")
    parser.add_argument("--gpus-per-worker", type=float, default=None,
                        help="GPUs each actor reserves (default: 1 when this machine has CUDA, else 0)")
    parser.add_argument("--placement", default="PACK", help="placement group strategy: PACK (default) or SPREAD")


def run_on_ray_group(args: argparse.Namespace, config) -> int:
    """The trainer in this process, driving a RayCriticGroup of args.nproc workers."""
    import torch

    from ...common.parallel.distributed import DistContext
    from ...common.job.launcher import fail, say
    from ...common.job.trainer import run_training
    from .cluster import check_fits, ensure_ray, shutdown_ray
    from .group import RayCriticGroup

    num_workers = args.nproc  # the job's plan: --nproc, the run's own count on --resume, else what the layout needs
    gpus = args.gpus_per_worker if args.gpus_per_worker is not None else float(torch.cuda.is_available())
    resources = {"CPU": args.cpus_per_worker, **({"GPU": gpus} if gpus else {})}

    def group(engine_config):
        say(f"starting {num_workers} Ray worker(s), {resources} each ({args.placement})")
        return RayCriticGroup(config.backend, engine_config, num_workers, resources_per_worker=resources,
                              placement_strategy=args.placement)

    driver = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    try:
        ensure_ray(args.address)
        check_fits(num_workers, resources)  # before run_dir is written
        run_training(config, driver, engine_builder=group, world_size=num_workers,
                     device_type="cuda" if gpus else "cpu")  # the actors' device, not the driver's
    except BaseException as err:  # noqa: BLE001 - reported as the torchrun job reports it
        return fail(err, None)
    finally:
        shutdown_ray()
    return 0


def main(argv: list[str] | None = None) -> int:
    return launch(LauncherSpec(module=__spec__.name, doc=__doc__, add_arguments=add_ray_arguments,
                               run=run_on_ray_group), argv)


if __name__ == "__main__":
    sys.exit(main())
