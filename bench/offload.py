"""Offload between phases: seconds per GiB to move a critic's state off its device and back, per
backend, side by side in one process on the same weights.

  python -m critic_adapters.bench.offload [--repeats 5] [--backends fsdp,veomni,megatron] [--out FILE.json]
  python bench/offload.py ...                  (the same, run as a file)
  bazel run //bench:offload -- ...

Each backend's engine (world of one; on CUDA when a GPU is present) is built on the same random
Qwen2-layout critic (hidden 512, 8 layers, vocab 32k: 40.5M parameters, 16.4M of them the embedding;
the causal LM saved is 56.9M with its untied lm_head, which the critic drops) and takes one update,
so that gradients and Adam's state exist. Then, `--repeats` times: engine.offload() (parameters,
gradients, optimizer state), engine.onload(). Reported per backend: the bytes moved (what
engine.resident_bytes() counted before), the median seconds of each direction and their sum per
GiB, what stays on the device after the offload (the engine's resident bytes; on CUDA also
torch.cuda.memory_allocated() after / before, and before and after the last offload this process's
allocated and reserved bytes (torch.cuda.memory_allocated, memory_reserved) and the device's free and
total bytes (torch.cuda.mem_get_info): what another process, the actor's or the rollout engine's,
can allocate; None on CPU), and whether the values after the last onload equal those before the
first offload (bit for bit). Printed last:
  offload+onload s/GiB: fsdp <a>, veomni <b>, megatron <c> (<device>)
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

MODEL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=1536, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False,
             rms_norm_eps=1e-6, pad_token_id=0)
GIB = 1 << 30


def save_model(directory: str, model: dict) -> str:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from critic_adapters.common.valuehead._quiet import quiet_transformers

    torch.manual_seed(0)
    with quiet_transformers():
        AutoModelForCausalLM.from_config(Qwen2Config(**model)).save_pretrained(directory)
    return directory


def rollout(rows: int, length: int, vocab: int, seed: int = 1):
    """Random rows of `length` tokens, the second half of each a response with random returns."""
    from critic_adapters.common.engine import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    response = torch.zeros(rows, length, dtype=torch.long)
    response[:, length // 2:] = 1
    returns = torch.randn(rows, length, generator=g) * response
    return RolloutBatch(ids, mask, response, torch.zeros(rows, length), returns)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device_memory() -> dict | None:
    """CUDA: this process's allocated and reserved (cached) bytes and the device's free and total
    bytes, which every process sees; None on CPU."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "free": free, "total": total}


def measure(backend: str, model_dir: str, repeats: int, dist) -> dict:
    from critic_adapters.common.engine.config import BatchingConfig, EngineConfig, ModelConfig
    from critic_adapters.common.engine.registry import build_engine

    engine = build_engine(backend, EngineConfig(model=ModelConfig(path=model_dir),
                                                batching=BatchingConfig(micro_batch_tokens=512)), dist)
    try:
        batch = rollout(4, 128, MODEL["vocab_size"])
        engine.update(batch)  # gradients and Adam's state exist from here on
        before = engine.compute_values(batch.input_ids, batch.attention_mask)
        resident = engine.resident_bytes()
        moved = sum(resident.values())
        offload_s, onload_s, left = [], [], None
        for _ in range(repeats):
            _sync()
            memory = _device_memory()
            start = time.perf_counter()
            engine.offload()
            _sync()
            offload_s.append(time.perf_counter() - start)
            after = _device_memory()
            left = {"device_allocated_after_over_before":
                        after["allocated"] / memory["allocated"] if memory and memory["allocated"] else None,
                    "device_memory_before_offload": memory, "device_memory_after_offload": after,
                    "resident_bytes_after": sum(engine.resident_bytes().values())}
            start = time.perf_counter()
            engine.onload()
            _sync()
            onload_s.append(time.perf_counter() - start)
        same = torch.equal(engine.compute_values(batch.input_ids, batch.attention_mask), before)
    finally:
        engine.close()
    off, on = statistics.median(offload_s), statistics.median(onload_s)
    return {"backend": backend, "bytes": moved, "parts": resident, "offload_s": off, "onload_s": on,
            "offload_onload_s_per_gib": (off + on) / (moved / GIB), **left, "values_equal_after": same}


def _memory_change(before: dict | None, after: dict | None) -> str:
    """", CUDA reserved a -> b GiB, free c -> d of e GiB" (the last offload), or "" on CPU."""
    if before is None:
        return ""
    return (f", CUDA reserved {before['reserved'] / GIB:.3f} -> {after['reserved'] / GIB:.3f} GiB, free "
            f"{before['free'] / GIB:.2f} -> {after['free'] / GIB:.2f} of {after['total'] / GIB:.2f} GiB")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backends", default="fsdp,veomni,megatron")
    parser.add_argument("--hidden", type=int, default=MODEL["hidden_size"], help="critic width (a test uses a tiny one)")
    parser.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"])
    parser.add_argument("--out", help="write the results as JSON here too")
    args = parser.parse_args(argv)

    import warnings

    warnings.filterwarnings("ignore")
    from critic_adapters.common.parallel.distributed import init_distributed, shutdown

    model = dict(MODEL, hidden_size=args.hidden, num_hidden_layers=args.layers,
                 intermediate_size=3 * args.hidden)
    dist = init_distributed()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(os.path.join(tmp, "model"), model)
        for backend in args.backends.split(","):
            row = measure(backend, model_dir, args.repeats, dist)
            rows.append(row)
            left = row["device_allocated_after_over_before"]
            print(f"{backend:9s} {row['bytes'] / GIB:6.3f} GiB  offload {row['offload_s']:.3f} s  onload "
                  f"{row['onload_s']:.3f} s  ({row['offload_onload_s_per_gib']:.2f} s/GiB)  left on device: "
                  f"{row['resident_bytes_after']} B" + (f", {left:.1%} of CUDA allocated" if left is not None else "")
                  + _memory_change(row["device_memory_before_offload"], row["device_memory_after_offload"])
                  + f"  values equal after: {row['values_equal_after']}", flush=True)
    shutdown()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "model": model, "repeats": args.repeats, "rows": rows}, f, indent=1)
    print("offload+onload s/GiB: " + ", ".join(f"{r['backend']} {r['offload_onload_s_per_gib']:.2f}" for r in rows)
          + f" ({device})")
    return 0 if all(r["values_equal_after"] and r["resident_bytes_after"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
