"""What each optimizer option costs and how well the critic learns with it: training-state bytes per
parameter and the optimizer step's time on a real-size critic, side by side in one run, and the
default job's held-out explained variance per option.

  python -m critic_adapters.bench.optimizers [--backend fsdp] [--ranks 2] [--out FILE.json]
  python -m critic_adapters.bench.optimizers --config common/testdata/configs/qwen2.json --skip-jobs   (tiny)

Part 1: the Qwen2.5-0.5B-shaped critic (bench/configs/qwen2_5_0_5b.json; `--config` takes another)
under torchrun (gloo, CPU, one thread per rank), one engine per option in turn on the same
processes: a warm-up update (the optimizer's state exists from then on), then `--repeats` times the
gradients of one row of `--tokens` tokens and, timed alone, the optimizer step; then one whole update of
a default-job mini-batch (`--update-tokens`), so the step shows as a fraction of it; for Muon, the
Newton-Schulz work of the slowest rank's share of the matrices against every matrix, timed in the same
run. Reported per option:
the bytes torch holds for the parameters, the gradients and the optimizer state (all ranks; the
state wherever it lives: with offload_state it is in host memory between steps and the device holds
none of it), per parameter of the critic, and the step's median time, with its ratio to fp32 AdamW's.
These byte counts are the same on any machine (tensor sizes, not the allocator's resident memory:
bench/tensor_bytes.py state_bytes, shared with the other benchmarks).

Part 2: the default training job (fsdp, 2 processes, embedded rollouts, 4 epochs) per option: its
final held-out explained variance.

Options: adamw (fp32 state, torch's fused AdamW), adamw_bf16 (bf16 moments), muon (torch's Muon on
the backbone's 2-D matrices, AdamW on the rest), muon_bf16, adamw_offload (offload_state).
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

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "configs", "qwen2_5_0_5b.json")
OPTIONS = {"adamw": {}, "adamw_bf16": {"state_dtype": "bfloat16"}, "muon": {"name": "muon"},
           "muon_bf16": {"name": "muon", "state_dtype": "bfloat16"}, "adamw_offload": {"offload_state": True}}


def held_bytes(engine) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (bench/tensor_bytes.py), and of
    the optimizer state on the device now."""
    from critic_adapters.bench.tensor_bytes import state_bytes

    return {**state_bytes(engine), "optimizer_resident": engine.resident_bytes()["optimizer"]}


def orthogonalise_times(engine, repeats: int) -> dict:
    """Muon's Newton-Schulz work at this world size: each rank's own share of the matrices
    (common.engine.optimizers.share_matrices) against every matrix, timed on this rank in the same run
    (random matrices of the critic's Muon shapes); the slowest rank's share, and the ratio."""
    import torch.distributed as torch_dist

    from critic_adapters.common.engine import optimizers
    from critic_adapters.common.parallel.distributed import all_reduce

    (group,) = [g for g in engine.optimizer.param_groups if g.get("kind") == "muon"]
    shapes = [tuple(p.shape) for p in group["params"]]
    ranks, me = torch_dist.get_world_size(), torch_dist.get_rank()
    owner = optimizers.share_matrices(shapes, ranks)
    g = torch.Generator().manual_seed(0)
    matrices = [torch.randn(shape, generator=g) for shape in shapes]

    def timed(indices) -> float:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for i in indices:
                optimizers._newton_schulz(matrices[i])
            best = min(best, time.perf_counter() - start)
        return best

    own, every = timed([i for i in range(len(shapes)) if owner[i] == me]), timed(range(len(shapes)))
    own, every = all_reduce([own, every], op="max", group=torch_dist.group.WORLD)
    return {"own_share_s": own, "every_matrix_s": every, "ratio": own / every, "matrices": len(shapes)}


def _default_row_length() -> int:
    """The default job's rollouts' mean length in tokens (its embedded data)."""
    from critic_adapters.common.learning.data import make_default_records

    return round(statistics.mean(len(r["input_ids"]) for r in make_default_records(256, seed=0)))


def update_rows(tokens_per_mini_batch: int) -> tuple[int, int]:
    """(rows, length) of a mini-batch of about `tokens_per_mini_batch` tokens, in rows of the default
    job's mean length."""
    length = _default_row_length()
    return max(1, round(tokens_per_mini_batch / length)), length


def default_job_mini_batch_tokens() -> int:
    """Tokens of one of the default job's mini-batches (its rollouts' mean length x mini_batch_size)."""
    import yaml

    from critic_adapters.common.job.launcher import DEFAULT_JOB

    with open(DEFAULT_JOB) as f:
        rows = yaml.safe_load(f)["data"]["mini_batch_size"]
    return rows * _default_row_length()


def worker(backend: str, model_dir: str, workdir: str, tokens: int, repeats: int, update_tokens: int = 0) -> None:
    import dataclasses

    import torch.distributed as torch_dist

    from critic_adapters.bench.offload import rollout
    from critic_adapters.common.engine.config import BatchingConfig, EngineConfig, ModelConfig, OptimConfig
    from critic_adapters.common.engine.registry import build_engine, model_critic_config
    from critic_adapters.common.parallel.distributed import all_reduce, init_distributed, shutdown

    dist = init_distributed()
    world = torch_dist.group.WORLD
    base = EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-5),
                        batching=BatchingConfig(micro_batch_tokens=tokens), gradient_checkpointing=True)
    vocab = model_critic_config(base.model).vocab_size
    results = {}
    for name, settings in OPTIONS.items():
        config = dataclasses.replace(base, optim=dataclasses.replace(base.optim, **settings))
        engine = build_engine(backend, config, dist)
        batch = rollout(1, tokens, vocab, 0)
        engine.update(batch)  # warm-up: the state exists from here on
        seconds = []
        for seed in range(repeats):
            engine.accumulate_gradients(rollout(1, tokens, vocab, seed + 1))
            held = held_bytes(engine)  # gradients present, before the step frees them
            torch_dist.barrier()
            start = time.perf_counter()
            engine.step_optimizer()
            (elapsed,) = all_reduce([time.perf_counter() - start], op="max", group=world)
            seconds.append(elapsed)
        totals = all_reduce([float(v) for v in held.values()], group=world)
        results[name] = {"step_s": statistics.median(seconds), **dict(zip(held, totals)),
                         "parameter_count": engine.parameter_counts()[1]}
        if update_tokens:  # what the step costs where it matters: a whole update of a default-job mini-batch
            rows, length = update_rows(update_tokens)
            torch_dist.barrier()
            start = time.perf_counter()
            engine.update(rollout(rows, length, vocab, 99))
            (elapsed,) = all_reduce([time.perf_counter() - start], op="max", group=world)
            results[name].update(update_s=elapsed, update_tokens=rows * length)
        if config.optim.name == "muon":
            results[name]["orthogonalise"] = orthogonalise_times(engine, repeats)
        kernel = getattr(getattr(engine, "optimizer", None), "adamw_kernel", None)
        if config.optim.state_dtype == "bfloat16" and kernel is not None:  # which bf16 step was timed
            results[name]["bf16_step"] = str(kernel)
        engine.close()
    if dist.is_main:
        with open(os.path.join(workdir, "results.json"), "w") as f:
            json.dump(results, f)
    shutdown()


def run_engines(backend: str, ranks: int, model_dir: str, workdir: str, tokens: int, repeats: int,
                update_tokens: int = 0) -> dict:
    from critic_adapters.bench.scale import subprocess_run

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "-m", "critic_adapters.bench.optimizers", "--worker", backend, model_dir, workdir, str(tokens),
               str(repeats), str(update_tokens)]
    result = subprocess_run(command, dict(os.environ))
    if result.returncode:
        raise SystemExit(f"{backend} at {ranks} rank(s) failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.load(open(os.path.join(workdir, "results.json")))


def table(results: dict) -> list[str]:
    plain = results["adamw"]["step_s"]
    lines = ["| option | parameters (B/param) | gradients (B/param) | optimizer state (B/param) | state on the device "
             "between steps (B/param) | optimizer step s | vs adamw | step / whole update |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        n = r["parameter_count"]
        fraction = f"{r['step_s'] / r['update_s']:.2f}" if r.get("update_s") else "—"
        lines.append(f"| {name} | {r['parameters'] / n:.2f} | {r['gradients'] / n:.2f} | {r['optimizer'] / n:.2f} | "
                     f"{r['optimizer_resident_between'] / n:.2f} | {r['step_s']:.3f} | {r['step_s'] / plain:.2f}x | "
                     f"{fraction} |")
    for name, r in results.items():
        if "bf16_step" in r:
            lines.append(f"{name}: adamw's bf16 step: {r['bf16_step']}")
        if "orthogonalise" in r:
            o = r["orthogonalise"]
            lines.append(f"{name}: Newton-Schulz of {o['matrices']} matrices, the slowest rank's share "
                         f"{o['own_share_s']:.3f} s against every matrix {o['every_matrix_s']:.3f} s: {o['ratio']:.2f}x")
    return lines


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5], int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="fsdp")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--config", default=CONFIG, help="the critic's config.json (default: Qwen2.5-0.5B-shaped)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens of each update's one row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--update-tokens", type=int, default=None,
                        help="tokens of the whole update each option's step is compared with (default: one of the "
                             "default job's mini-batches; 0: none)")
    parser.add_argument("--skip-jobs", action="store_true", help="part 1 only (no default jobs)")
    parser.add_argument("--out", help="write the results as JSON here too")
    args = parser.parse_args(argv)

    from critic_adapters.bench.scale import write_model
    from critic_adapters.bench.value_learning import run_job

    out = {"backend": args.backend, "ranks": args.ranks, "config": os.path.basename(args.config)}
    with tempfile.TemporaryDirectory(prefix="critic_optimizers_") as tmp:
        model_dir = os.path.join(tmp, "model")
        write_model(args.config, model_dir)
        update_tokens = default_job_mini_batch_tokens() if args.update_tokens is None else args.update_tokens
        results = run_engines(args.backend, args.ranks, model_dir, tmp, args.tokens, args.repeats, update_tokens)
        for r in results.values():
            r["optimizer_resident_between"] = r.pop("optimizer_resident")
        out["engines"] = results
        print("\n".join(table(results)), flush=True)
        if not args.skip_jobs:
            out["jobs"] = {}
            for name, settings in OPTIONS.items():
                if name == "adamw_offload":
                    continue  # bit-identical to adamw (the conformance suite checks it)
                overrides = [f"engine.optim.{key}={value}" for key, value in settings.items()]
                result = run_job("fsdp", 2, os.path.join(tmp, f"job-{name}"), overrides)
                out["jobs"][name] = result
                print(f"default job, {name}: held-out EV {result['explained_variance']:.4f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
