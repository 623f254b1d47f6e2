"""What a big critic costs per rank, on paper: the job plan's `memory per rank:` figures (common/engine/memory.py,
from the config alone, nothing allocated) for Qwen2.5-shaped 7B, 14B, 32B and 72B critics at the layouts users
run (FSDP on 8 and 16 ranks; megatron TP 4 x DP 2 on 8, TP 8 x PP 2 on 16), with and without the optimizer state
offloaded, and whether a rank fits an 80 GB device.

  python -m critic_adapters.bench.memory_plan [--ranks 8,16] [--tokens 8192] [--device-memory 80GB] [--out FILE.json]
  bazel run //bench:memory_plan -- ...

The shapes are Qwen2.5's published ones (hidden, layers, heads, KV heads, intermediate, vocabulary); the
critic is built on the meta device, as the plan builds it. Every layout is fp32 master weights with bf16
mixed precision (the GPU default), AdamW in fp32 (or bf16 moments), a micro-batch of `--tokens` tokens,
activations with gradient checkpointing. Parameters, gradients and optimizer state are what
resident_bytes() reports on the largest rank (exact: tests compare them at 1, 2 and 4 ranks, HSDP, megatron
DP / TP / PP / CP 2); activations are the saved-for-backward count of the meta forward (within 6% of
bench/tensor_bytes.py's count of a real step, measured on the tiny critics; megatron's with its local spec's
extras and its tensor and pipeline shares). megatron runs with its distributed optimizer (fp32 main weights
and moments sharded over data parallel) and sequence parallelism; it has no bf16 moments. Printed: one line
per (model, layout, option); a layout the model's heads refuse is said so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

if __package__ in (None, ""):  # run as a file: this checkout as the package critic_adapters
    import as_a_file  # noqa: F401  (bench/as_a_file.py)

QWEN2_5 = {  # hidden, layers, heads, KV heads, intermediate, vocabulary (the models' config.json)
    "7B": (3584, 28, 28, 4, 18944, 152064),
    "14B": (5120, 48, 40, 8, 13824, 152064),
    "32B": (5120, 64, 40, 8, 27648, 152064),
    "72B": (8192, 80, 64, 8, 29568, 152064),
}


def critic_config(size: str):
    from transformers import Qwen2Config

    from critic_adapters.common.valuehead.config import critic_config as as_critic

    hidden, layers, heads, kv, ffn, vocab = QWEN2_5[size]
    return as_critic(Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                 num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab,
                                 max_position_embeddings=32768, tie_word_embeddings=False))


# (backend, ranks, tensor, pipeline): FSDP's at --ranks, megatron's two
MEGATRON_LAYOUTS = (("megatron", 8, 4, 1), ("megatron", 16, 8, 2))
OPTIONS = (("AdamW", False, "float32"), ("AdamW, bf16 moments", False, "bfloat16"),
           ("AdamW, state offloaded", True, "float32"))


def plan(size: str, ranks: int, tokens: int, *, offload: bool, state_dtype: str = "float32", backend: str = "fsdp",
         tensor: int = 1, pipeline: int = 1):
    """The plan's RankMemory, or the ValueError the backend refuses the layout with."""
    from critic_adapters.common.engine.config import (BatchingConfig, EngineConfig, OptimConfig, ParallelConfig,
                                                      TrainConfig)
    from critic_adapters.common.engine.memory import rank_memory
    from critic_adapters.common.engine.registry import ModelRead, check_layout

    engine = EngineConfig(mixed_precision="bf16", gradient_checkpointing=True,
                          optim=OptimConfig(offload_state=offload, state_dtype=state_dtype),
                          parallel=ParallelConfig(tensor=tensor, pipeline=pipeline, sequence_parallel=tensor > 1),
                          batching=BatchingConfig(micro_batch_tokens=tokens))
    config = critic_config(size)
    try:
        check_layout(backend, engine, ranks, ModelRead(config, None))
    except ValueError as refused:
        return refused
    return rank_memory(TrainConfig(backend=backend, engine=engine), config, ranks)


def main(argv: list[str] | None = None) -> int:
    from critic_adapters.common.engine.memory import memory_line, parse_size, size as human

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="8,16", help="FSDP ranks (default 8,16)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch (default 8192)")
    parser.add_argument("--device-memory", default="80GB", help="one device's memory (default 80GB)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    device = parse_size(args.device_memory)
    rows = []
    layouts = [("fsdp", int(r), 1, 1) for r in args.ranks.split(",")] + list(MEGATRON_LAYOUTS)
    for size in QWEN2_5:
        for backend, ranks, tensor, pipeline in layouts:
            layout = f"fsdp x{ranks}" if backend == "fsdp" else f"megatron TP{tensor} PP{pipeline} x{ranks}"
            for name, offload, state in OPTIONS:
                if backend == "megatron" and state != "float32":
                    continue  # megatron-core's bf16 moments need TransformerEngine (BackendSpec.unsupported)
                memory = plan(size, ranks, args.tokens, offload=offload, state_dtype=state, backend=backend,
                              tensor=tensor, pipeline=pipeline)
                row = {"model": size, "backend": backend, "ranks": ranks, "tensor": tensor, "pipeline": pipeline,
                       "option": name}
                if isinstance(memory, ValueError):
                    rows.append({**row, "refused": str(memory)})
                    print(f"{size:>4} {layout:<24} {name:<24} refused: {memory}", flush=True)
                    continue
                rows.append({**row, **dataclasses.asdict(memory), "total": memory.total,
                             "fits": memory.total <= device})
                print(f"{size:>4} {layout:<24} {name:<24} {memory_line(memory, backend, device)}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"tokens": args.tokens, "device_memory": device, "device": human(device), "rows": rows}, f,
                      indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
