"""A vision critic's update with images, packed against padded, on fsdp and VeOmni: tokens per second
and their ratios, side by side in one run of two ranks per backend.

  python -m critic_adapters.bench.vision [--repeats 5] [--rows 16] [--backends fsdp veomni] [--out FILE.json]
  bazel run //bench:vision -- ...

A random Qwen2-VL-layout critic (hidden 256, 4 layers; a 2-block vision tower) on 2 gloo ranks, 1 thread
each. The mini-batch is agent-like: every row a screenshot-sized image (a grid of 8x8 to 16x16 patches:
16 to 64 placeholder tokens) between a prompt and a response of 32 to 384 tokens, so rows differ in
length as rollouts do. Per backend, one engine packs its micro-batches and one pads them (the same
critic, the same token budget); each repeat runs one update of each, alternating, after a warm-up.
Reported per backend and layout: the update's wall time (the slowest rank's; median over repeats) and
the non-padding tokens of the mini-batch per second; printed last:
  vision update tokens/s: fsdp packed <a> padded <b> (<a/b>x); veomni packed <c> padded <d> (<c/d>x); veomni/fsdp packed <c/a>x
The two backends run one after another in separate torchruns on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file: this checkout as the package critic_adapters
    import as_a_file  # noqa: F401  (bench/as_a_file.py)

import torch  # noqa: E402

TEXT = dict(vocab_size=1000, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]}, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
VISION = dict(depth=2, embed_dim=128, hidden_size=256, num_heads=4, patch_size=14, spatial_merge_size=2,
              temporal_patch_size=2)
TOKENS = dict(image_token_id=998, video_token_id=999, vision_start_token_id=997, vision_end_token_id=996)
BUDGET = 2048  # tokens per micro-batch (per rank)


def model_config():
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(text_config=TEXT, vision_config=VISION, **TOKENS)


def agent_batch(rows: int):
    """`rows` rollouts: prompt, one image (8x8 .. 16x16 patches), response of 32 .. 384 tokens."""
    from critic_adapters.common.engine import RolloutBatch
    from critic_adapters.common.testdata.vision import image_row, padded

    config = model_config()
    g = torch.Generator().manual_seed(0)
    ids, images, responses = [], [], []
    for _ in range(rows):
        side = 2 * int(torch.randint(4, 9, (1,), generator=g))
        response = int(torch.randint(32, 385, (1,), generator=g))
        row, mm = image_row(config, [(1, side, side)], before=24, after=response, generator=g)
        ids.append(row)
        images.append(mm)
        responses.append(response)
    input_ids, mask = padded(ids)
    response_mask = torch.zeros_like(mask)
    for index, (row, response) in enumerate(zip(ids, responses)):
        response_mask[index, row.numel() - response:row.numel()] = 1
    returns = torch.randn(input_ids.shape, generator=g) * response_mask
    return RolloutBatch(input_ids, mask, response_mask, torch.zeros(input_ids.shape), returns,
                        multi_modal_inputs=images)


def worker(backend: str, model_dir: str, out_file: str, repeats: int, rows: int) -> None:
    """One rank of a backend's run (under torchrun)."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from critic_adapters.common.engine.config import BatchingConfig, EngineConfig, ModelConfig
    from critic_adapters.common.engine.registry import build_engine
    from critic_adapters.common.parallel.batching import data_parallel_shares
    from critic_adapters.common.parallel.distributed import all_reduce, barrier, init_distributed, shutdown
    from critic_adapters.common.valuehead.multimodal import vision_patches

    dist = init_distributed()
    batch = agent_batch(rows)
    engines = {layout: build_engine(backend, EngineConfig(model=ModelConfig(path=model_dir), batching=BatchingConfig(
        micro_batch_tokens=BUDGET, packing=layout == "packed")), dist) for layout in ("packed", "padded")}
    any_engine = engines["packed"]
    shares = data_parallel_shares(batch.attention_mask, any_engine.dp_size,
                                  vision_patches(batch.multi_modal_inputs, rows))
    share = batch.select(shares[any_engine.dp_rank])
    times = {layout: [] for layout in engines}
    for repeat in range(repeats + 1):  # the first round warms up
        for layout, engine in engines.items():
            barrier(engine.parallel.world_group)
            start = time.perf_counter()
            engine.update(share)
            (slowest,) = all_reduce([time.perf_counter() - start], op="max", group=engine.parallel.world_group)
            if repeat:
                times[layout].append(slowest)
    if dist.is_main:
        tokens = int(batch.attention_mask.sum())
        result = {layout: {"step_s": statistics.median(t), "steps_s": t, "tokens": tokens,
                           "tokens_per_s": tokens / statistics.median(t)} for layout, t in times.items()}
        with open(out_file, "w") as f:
            json.dump(result, f)
    for engine in engines.values():
        engine.close()
    shutdown()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--backends", nargs="+", default=["fsdp", "veomni"], choices=["fsdp", "veomni"])
    parser.add_argument("--out", help="write the results as JSON here too")
    parser.add_argument("--worker", nargs=3, metavar=("BACKEND", "MODEL_DIR", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker, args.repeats, args.rows)
        return 0

    from transformers import AutoModelForImageTextToText

    from critic_adapters.common.valuehead._quiet import quiet_transformers

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        with quiet_transformers():
            AutoModelForImageTextToText.from_config(model_config()).save_pretrained(os.path.join(tmp, "model"))
        for backend in args.backends:
            out = os.path.join(tmp, f"{backend}.json")
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                       "127.0.0.1", "--master-port", str(_free_port()), "-m", "critic_adapters.bench.vision",
                       "--repeats", str(args.repeats), "--rows", str(args.rows),
                       "--worker", backend, os.path.join(tmp, "model"), out]
            print(f"{backend}: {args.repeats} repeats of a packed and a padded update ...", flush=True)
            subprocess.run(command, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL)
            with open(out) as f:
                results[backend] = json.load(f)
    parts = []
    for backend, by_layout in results.items():
        packed, padded = by_layout["packed"], by_layout["padded"]
        print(f"{backend:7s} packed {packed['step_s']:.3f} s, padded {padded['step_s']:.3f} s per update "
              f"({packed['tokens']} tokens)")
        parts.append(f"{backend} packed {packed['tokens_per_s']:.0f} padded {padded['tokens_per_s']:.0f} "
                     f"({packed['tokens_per_s'] / padded['tokens_per_s']:.2f}x)")
    if {"fsdp", "veomni"} <= set(results):
        parts.append(f"veomni/fsdp packed {results['veomni']['packed']['tokens_per_s'] / results['fsdp']['packed']['tokens_per_s']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"text": TEXT, "vision": VISION, "rows": args.rows, "budget": BUDGET, "result": results}, f,
                      indent=1)
    print("vision update tokens/s: " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
