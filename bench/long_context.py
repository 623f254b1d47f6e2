"""Long rollouts with the sequence split over ranks: per-rank memory and speed of one critic update
on a single long sequence, unsplit (one rank) against split over two ranks — Ulysses
(engine.parallel.ulysses=2) on fsdp and veomni, context parallelism (engine.parallel.context=2) on
megatron.

The critic is tiny in width and real in length: a random qwen2 of hidden 256, 4 layers, 8 heads
(4 KV heads), vocab 1000, fp32, gradient checkpointing on, one packed sequence of 8k and of 16k
tokens per update. Each configuration runs in its own torchrun: a warm-up update on a short
sequence, then the timed update on the long one. Reported per rank:
  peak memory added  the process's peak resident memory during the update (VmHWM, reset before it
                     through /proc/self/clear_refs) minus its resident memory just before; glibc is
                     told to map every allocation above 128 KiB (MALLOC_MMAP_THRESHOLD_) so freed
                     tensors leave the resident set and the peak is the update's own; it moves
                     with the allocator and the machine (0.52 to 0.79 for the same split)
  saved for backward the most bytes the update's forward had saved for its backward at once, each
                     storage once, parameters left out (bench/tensor_bytes.py SavedForBackward):
                     the same on any machine
  device peak added  on CUDA, torch.cuda.max_memory_allocated during the update minus what was
                     allocated before it (none on CPU)
  tokens/s           sequence tokens / the update's wall time (the slowest rank's)
and, in the JSON, the rank's parameter, gradient and optimizer-state bytes (largest rank and all).
The unsplit run gets both CPU threads, each of the two split ranks one, so both use the same cores.
Printed per pair, the split's ratio to the unsplit of both memory figures, and last, at 16k (a ratio
< 1 means less memory per rank, > 1 faster):
  sequence-parallel memory per rank vs 1: fsdp <a>, ...; saved for backward: fsdp <d>, ...; speed vs 1: <x>, ...

  python -m critic_adapters.bench.long_context [--lengths 8192 16384] [--backends fsdp veomni megatron]
                                               [--out FILE.json]
  bazel run //bench:long_context -- ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file: this checkout as the package critic_adapters
    import as_a_file  # noqa: F401  (bench/as_a_file.py)

import torch  # noqa: E402

SPLIT_DIMS = ("ulysses", "context")  # the ways a backend splits one sequence (engine.parallel.<dim>)


def split_keys() -> dict[str, str]:
    """Every registered backend that splits sequences -> its split dimension, from the specs."""
    from critic_adapters.common.engine.registry import BACKENDS

    return {name: next(dim for dim in SPLIT_DIMS if dim in spec.parallel_dims)
            for name, spec in BACKENDS.items() if set(SPLIT_DIMS) & spec.parallel_dims}


MODEL = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=1000, max_position_embeddings=32768)
WARMUP_TOKENS = 512


def save_model(directory: str) -> str:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from critic_adapters.common.valuehead._quiet import quiet_transformers

    torch.manual_seed(0)
    config = Qwen2Config(**MODEL, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0)
    with quiet_transformers():  # no "Writing model shards" progress bar
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


# -- the worker: one configuration, under torchrun -------------------------------------------------
def _resident_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _peak_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set (Linux >= 4.0)


def _batch(length: int, seed: int):
    from critic_adapters.common.engine import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, MODEL["vocab_size"], (1, length), generator=g)
    mask = torch.ones_like(ids)
    response = torch.zeros_like(ids)
    response[:, length // 8:] = 1
    return RolloutBatch(ids, mask, response, torch.zeros(1, length), torch.randn(1, length, generator=g) * response)


def worker(backend: str, model_dir: str, length: int, degree: int, out_file: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    from critic_adapters.common.engine.config import (BatchingConfig, EngineConfig, LossConfig, ModelConfig, OptimConfig,
                                               ParallelConfig)
    from critic_adapters.common.parallel.distributed import all_reduce, init_distributed, shutdown
    from critic_adapters.common.engine import build_engine
    from critic_adapters.bench.tensor_bytes import DevicePeak, SavedForBackward, over_ranks, state_bytes

    dist = init_distributed()
    config = EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-4, grad_clip=1.0),
                          loss=LossConfig(clip_range=None), gradient_checkpointing=True,
                          batching=BatchingConfig(micro_batch_tokens=max(length, WARMUP_TOKENS)),
                          parallel=ParallelConfig(**{split_keys()[backend]: degree}))
    engine = build_engine(backend, config, dist)
    engine.update(_batch(WARMUP_TOKENS, seed=1))  # first-call costs (kernels, collectives) out of the timing
    batch = _batch(length, seed=2)
    torch.distributed.barrier()
    before = _resident_kib()
    _reset_peak()
    with SavedForBackward(engine.model) as saved, DevicePeak() as device:
        start = time.perf_counter()
        metrics = engine.update(batch)
        seconds = time.perf_counter() - start
    added_mib = (_peak_kib() - before) / 1024
    group = engine.parallel.world_group
    seconds, worst_mib = all_reduce([seconds, added_mib], op="max", group=group)  # the slowest, the largest rank
    held = over_ranks({"saved_for_backward_peak": saved.peak, "device_peak_added": device.added,
                       **state_bytes(engine)}, group)
    if dist.is_main:
        with open(out_file, "w") as f:
            json.dump({"backend": backend, "length": length, "degree": degree, "seconds": seconds,
                       "tokens_per_second": length / seconds, "peak_added_mib_per_rank": worst_mib,
                       "saved_mib_per_rank": held["max_per_rank"]["saved_for_backward_peak"] / 2**20, **held,
                       "value_loss": metrics["value_loss"], "grad_norm": metrics["grad_norm"]}, f)
    engine.close()
    shutdown()


# -- the driver ----------------------------------------------------------------------------------
def run_one(backend: str, model_dir: str, length: int, degree: int, workdir: str) -> dict:
    out = os.path.join(workdir, f"{backend}_{length}_{degree}.json")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(root), *sys.path]),
               OMP_NUM_THREADS=str(max(1, 2 // degree)), MALLOC_MMAP_THRESHOLD_="131072", PYTHONWARNINGS="ignore")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={degree}",
               "-m", "critic_adapters.bench.long_context", "--worker", backend, model_dir, str(length), str(degree), out]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{backend} at {length} tokens, degree {degree} failed:\n{result.stderr[-4000:]}")
    with open(out) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    split_key = split_keys()
    parser.add_argument("--backends", nargs="+", default=list(split_key), choices=list(split_key))
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        backend, model_dir, length, degree, out_file = args.worker
        return worker(backend, model_dir, int(length), int(degree), out_file)

    rows = []
    with tempfile.TemporaryDirectory(prefix="critic_long_context_") as workdir:
        model_dir = save_model(os.path.join(workdir, "model"))
        for backend in args.backends:
            for length in args.lengths:
                pair = [run_one(backend, model_dir, length, degree, workdir) for degree in (1, 2)]
                one, two = pair
                for row in pair:
                    device = row["max_per_rank"]["device_peak_added"]
                    print(f"{backend:9s} {length:6d} tokens, {split_key[backend]} {row['degree']}: "
                          f"peak +{row['peak_added_mib_per_rank']:8.1f} MiB per rank, "
                          f"saved for backward {row['saved_mib_per_rank']:8.1f} MiB per rank, "
                          + (f"device peak +{device / 2**20:8.1f} MiB, " if device is not None else "")
                          + f"{row['tokens_per_second']:8.1f} tokens/s, loss {row['value_loss']:.6f}", flush=True)
                rows.append({"backend": backend, "length": length, "unsplit": one, "split": two,
                             "memory_ratio": two["peak_added_mib_per_rank"] / one["peak_added_mib_per_rank"],
                             "saved_ratio": two["saved_mib_per_rank"] / one["saved_mib_per_rank"],
                             "speed_ratio": two["tokens_per_second"] / one["tokens_per_second"]})
                print(f"{backend:9s} {length:6d} tokens: memory ratio {rows[-1]['memory_ratio']:.2f} (resident), "
                      f"{rows[-1]['saved_ratio']:.2f} (saved for backward)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": MODEL, "rows": rows}, f, indent=2)
    longest = max(args.lengths)
    at = {row["backend"]: row for row in rows if row["length"] == longest}
    names = [b for b in args.backends if b in at]
    memory = ", ".join(f"{b} {at[b]['memory_ratio']:.2f}" for b in names)
    saved = ", ".join(f"{b} {at[b]['saved_ratio']:.2f}" for b in names)
    speed = ", ".join(f"{at[b]['speed_ratio']:.2f}" for b in names)
    print(f"sequence-parallel memory per rank vs 1: {memory}; saved for backward: {saved}; speed vs 1: {speed}")


if __name__ == "__main__":
    main()
