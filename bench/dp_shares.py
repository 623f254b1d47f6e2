"""Data-parallel shares of a mini-batch with mixed lengths: rows r::n against token-balanced shares
(common.parallel.batching.data_parallel_shares), side by side in one 2-rank run.

  python -m critic_adapters.bench.dp_shares [--repeats 5] [--rows 40] [--short 64] [--out FILE.json]
  bazel run //bench:dp_shares -- ...

A mini-batch where 10% of the rollouts are 8x longer than the rest, every long one at a position
that r::n gives to rank 0 (the worst case of a strided split; a shuffle makes it likely in part).
A random Qwen2-layout critic (hidden 256, 4 layers) on the fsdp engine, 2 gloo ranks, 1 thread each.
Each repeat runs one update with each way of sharing, alternating, from the same weights (a
checkpoint reloaded before each). Reported: the largest share's tokens, and the step's wall time
(the slowest rank's; median over repeats). Printed last:
  dp shares: largest share <a> -> <b> tokens, step <x> s -> <y> s (<ratio>x)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file: this checkout as the package critic_adapters
    import as_a_file  # noqa: F401  (bench/as_a_file.py)

import torch  # noqa: E402

MODEL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096, tie_word_embeddings=False,
             rms_norm_eps=1e-6, pad_token_id=0)


def skewed_batch(rows: int, short: int):
    """`rows` rollouts, every tenth 8x longer (all at even positions: rank 0's under r::2)."""
    from critic_adapters.common.engine import RolloutBatch

    lengths = [8 * short if i % 10 == 0 else short for i in range(rows)]
    width = max(lengths)
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(3, MODEL["vocab_size"], (rows, width), generator=g) * mask
    response = mask.clone()
    response[:, : short // 2] = 0
    returns = torch.randn(rows, width, generator=g) * response
    return RolloutBatch(ids, mask, response, torch.zeros(rows, width), returns)


def worker(model_dir: str, out_file: str, repeats: int, rows: int, short: int) -> None:
    """One rank of the run (under torchrun)."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from critic_adapters.common.engine.config import BatchingConfig, EngineConfig, ModelConfig
    from critic_adapters.common.engine.registry import build_engine
    from critic_adapters.common.parallel.batching import data_parallel_shares
    from critic_adapters.common.parallel.distributed import all_reduce, barrier, init_distributed, shutdown

    dist = init_distributed()
    engine = build_engine("fsdp", EngineConfig(model=ModelConfig(path=model_dir),
                                               batching=BatchingConfig(micro_batch_tokens=8 * short)), dist)
    batch = skewed_batch(rows, short)
    ways = {"strided": [torch.arange(r, rows, engine.dp_size) for r in range(engine.dp_size)],
            "balanced": data_parallel_shares(batch.attention_mask, engine.dp_size)}
    checkpoint = os.path.join(os.path.dirname(out_file), "start")
    engine.save_checkpoint(checkpoint)
    times = {name: [] for name in ways}
    for _ in range(repeats):
        for name, shares in ways.items():
            engine.load_checkpoint(checkpoint)
            mine = shares[engine.dp_rank]
            share = batch.map(lambda tensor: tensor[mine])
            barrier(engine.parallel.world_group)
            start = time.perf_counter()
            engine.update(share)
            (slowest,) = all_reduce([time.perf_counter() - start], op="max", group=engine.parallel.world_group)
            times[name].append(slowest)
    if dist.is_main:
        result = {name: {"largest_share_tokens": max(int(batch.attention_mask[s].sum()) for s in shares),
                         "share_tokens": [int(batch.attention_mask[s].sum()) for s in shares],
                         "step_s": statistics.median(times[name]), "steps_s": times[name]}
                  for name, shares in ways.items()}
        with open(out_file, "w") as f:
            json.dump(result, f)
    engine.close()
    shutdown()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--short", type=int, default=64, help="tokens of a short rollout (the long ones: 8x)")
    parser.add_argument("--out", help="write the results as JSON here too")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL_DIR", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker, args.repeats, args.rows, args.short)
        return 0

    from transformers import AutoModelForCausalLM, Qwen2Config

    from critic_adapters.common.valuehead._quiet import quiet_transformers

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        with quiet_transformers():
            AutoModelForCausalLM.from_config(Qwen2Config(**MODEL)).save_pretrained(os.path.join(tmp, "model"))
        out = os.path.join(tmp, "result.json")
        import socket

        with socket.socket() as probe:  # a free port on loopback for the two ranks' rendezvous
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                   "--master-port", str(port),
                   "-m", "critic_adapters.bench.dp_shares", "--repeats", str(args.repeats), "--rows", str(args.rows),
                   "--short", str(args.short), "--worker", os.path.join(tmp, "model"), out]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
        with open(out) as f:
            result = json.load(f)
    for name, row in result.items():
        print(f"{name:9s} share tokens {row['share_tokens']}  step {row['step_s']:.3f} s (median of {args.repeats})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": MODEL, "rows": args.rows, "short": args.short, "result": result}, f, indent=1)
    strided, balanced = result["strided"], result["balanced"]
    print(f"dp shares: largest share {strided['largest_share_tokens']} -> {balanced['largest_share_tokens']} tokens, "
          f"step {strided['step_s']:.3f} s -> {balanced['step_s']:.3f} s "
          f"({strided['step_s'] / balanced['step_s']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
