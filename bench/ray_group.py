"""Benchmark what driving the critic through a RayCriticGroup costs: the FSDP engine at world size 2
as torchrun ranks and as 2 Ray actors, the same model, batch and settings, measured in one run.

  python -m critic_adapters.bench.ray_group [--repeats 5] [--sequences 16] [--rounds 2] [--out FILE.json]
  bazel run //bench:ray_group -- ...

The model and batch are bench/critic_update.py's (hidden 512, 8 layers, 32k vocab; 16 sequences,
46% padding). Each process (torchrun rank or Ray actor) gets one CPU and one thread. torchrun: each
rank passes its share of the mini-batch straight to the engine. Ray: the driver passes the whole
batch, put once in the object store, and every actor takes its share, so the group's time includes
the object store and the round trip to the driver. Both time `repeats` updates after one warm-up;
the two are run alternately `rounds` times and each is the median over all its updates. Printed
last: `ray group vs torchrun: <ratio>` (update tokens/s through the group over torchrun's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file: this checkout as the package critic_adapters
    import as_a_file  # noqa: F401  (bench/as_a_file.py)

import torch  # noqa: E402

WORLD = 2


def engine_config(model_dir: str, budget: int):
    from critic_adapters.bench.critic_update import CLIP
    from critic_adapters.common.engine.config import BatchingConfig, EngineConfig, LossConfig, ModelConfig, OptimConfig

    return EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-5),
                        loss=LossConfig(clip_range=CLIP), batching=BatchingConfig(packing=True, micro_batch_tokens=budget))


def _timed(step, repeats: int) -> list[float]:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def torchrun_worker(model_dir: str, batch_file: str, repeats: int, out: str) -> None:
    """One torchrun rank: its share of the batch, `repeats` timed updates; rank 0 writes the times."""
    from critic_adapters.common.parallel.distributed import init_distributed, shutdown
    from critic_adapters.common.engine import RolloutBatch
    from critic_adapters.common.engine.registry import build_engine

    data = torch.load(batch_file)
    dist = init_distributed()
    batch = RolloutBatch(**data["batch"])
    rows = torch.arange(batch.input_ids.shape[0])[dist.rank::dist.world_size]
    share = RolloutBatch(*(getattr(batch, name)[rows] for name in data["batch"]))
    engine = build_engine("fsdp", engine_config(model_dir, data["budget"]), dist)
    times = _timed(lambda: engine.update(share), repeats)
    engine.close()
    if dist.is_main:
        with open(out, "w") as f:
            json.dump(times, f)
    shutdown()


def run_torchrun(model_dir: str, batch_file: str, repeats: int, workdir: str) -> list[float]:
    import subprocess

    out = os.path.join(workdir, "torchrun_times.json")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
               "-m", "critic_adapters.bench.ray_group", "--worker", model_dir, batch_file, str(repeats), out]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", LOGLEVEL="ERROR")
    subprocess.run(command, env=env, check=True)
    with open(out) as f:
        return json.load(f)


def run_ray(group, batch, repeats: int) -> list[float]:
    return _timed(lambda: group.update(batch), repeats)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed updates per measurement (after a warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="torchrun / Ray measurements, alternately")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        model_dir, batch_file, repeats, out = args.worker
        torchrun_worker(model_dir, batch_file, int(repeats), out)
        return 0
    if "BUILD_WORKING_DIRECTORY" in os.environ:
        os.chdir(os.environ["BUILD_WORKING_DIRECTORY"])

    from transformers import AutoModelForCausalLM, Qwen2Config

    from critic_adapters.bench.critic_update import MODEL, ROWS_PER_MICRO_BATCH, make_batch
    from critic_adapters.common.valuehead._quiet import quiet_transformers
    from critic_adapters.integrations.ray import RayCriticGroup
    from critic_adapters.integrations.ray.cluster import ensure_ray, shutdown_ray

    with tempfile.TemporaryDirectory() as workdir:
        torch.manual_seed(0)
        model_dir = os.path.join(workdir, "model")
        with quiet_transformers():  # no "Writing model shards" progress bar
            AutoModelForCausalLM.from_config(Qwen2Config(**MODEL)).save_pretrained(model_dir)
        batch = make_batch(args.sequences)
        budget = ROWS_PER_MICRO_BATCH * batch.input_ids.shape[1]
        batch_file = os.path.join(workdir, "batch.pt")
        fields = ("input_ids", "attention_mask", "response_mask", "old_values", "returns")
        torch.save({"batch": {name: getattr(batch, name) for name in fields}, "budget": budget}, batch_file)
        valid = int(batch.attention_mask.sum())
        print(f"batch: {args.sequences} sequences, {valid} valid tokens; world size {WORLD} (1 CPU, 1 thread "
              f"each); {args.rounds} rounds of {args.repeats} updates", flush=True)
        ensure_ray(num_cpus=WORLD)
        group = RayCriticGroup("fsdp", engine_config(model_dir, budget), num_workers=WORLD,
                               resources_per_worker={"CPU": 1})
        times = {"torchrun": [], "ray-group": []}
        try:
            for round_ in range(args.rounds):
                times["torchrun"] += run_torchrun(model_dir, batch_file, args.repeats, workdir)
                times["ray-group"] += run_ray(group, batch, args.repeats)
                print(f"round {round_ + 1}/{args.rounds}: torchrun {statistics.median(times['torchrun']):.2f}s, "
                      f"ray group {statistics.median(times['ray-group']):.2f}s (medians so far)", flush=True)
        finally:
            group.close()
            shutdown_ray()
    median = {name: statistics.median(t) for name, t in times.items()}
    rate = {name: valid / t for name, t in median.items()}
    print(f"\n{'variant':<12}{'median s':>10}{'valid tok/s':>13}")
    for name in times:
        print(f"{name:<12}{median[name]:>10.3f}{rate[name]:>13.0f}")
    result = {"ray_group_vs_torchrun": rate["ray-group"] / rate["torchrun"], "median_step_s": median,
              "valid_tokens_per_s": rate, "times_s": times, "valid_tokens": valid}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(f"ray group vs torchrun: {result['ray_group_vs_torchrun']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
