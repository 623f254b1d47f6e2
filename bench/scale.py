"""A critic at a real size on each backend: update tokens/s, MFU, memory per rank, load and export
peaks, and how the update's time grows with the row length and the tokens per step.

  python -m critic_adapters.bench.scale [--backends fsdp,veomni,megatron] [--ranks 1,2] [--out FILE.json]
  python bench/scale.py ...                     (the same, run as a file)
  python -m critic_adapters.bench.scale --config bench/configs/qwen3_moe_small.json --ranks 2 \
      --megatron-layout expert=2               (the mixture-of-experts row: megatron at expert parallel 2)

The critic is Qwen2.5-0.5B-shaped (bench/configs/qwen2_5_0_5b.json: hidden 896, 24 layers, 14 heads,
2 KV heads, intermediate 4864, vocabulary 151936; 494M parameters), random, written by
transformers at start (no download; `--config` takes another, e.g. a tiny one). Each backend runs at
each rank count under torchrun (gloo, CPU; one thread per rank at 2 ranks, both cores at 1), with
fp32 AdamW and gradient checkpointing (a 4k-token row's activations would not fit here otherwise).
Per run: the build's and the export's peak per rank (common/parallel/host_memory.py), one warm-up
update, then one measured update of `--tokens` tokens in rows of 512: tokens/s, MFU (the model
FLOPs of common/job/telemetry.py over the update's time x every rank's measured matmul peak; the
recomputation of checkpointing is not counted, as MFU never counts it) and the update's peak
resident memory per rank, per parameter (fp32 AdamW's state is 16 bytes per parameter, over the
ranks that shard it). Beside that resident figure, which moves with the allocator and the machine,
what torch itself holds (bench/tensor_bytes.py; the same on any machine): the rank's parameter,
gradient and optimizer-state bytes after the updates, per parameter of the whole critic (held by
torch), the most bytes the measured update's forward had saved for its backward (saved for
backward; parameters and checkpoint recomputation left out), and on CUDA the update's
torch.cuda.max_memory_allocated above what was allocated before it. The first backend at 1 rank
then times updates of 4096 tokens in rows of 512, 1k, 2k and 4k tokens, and of 1k, 2k and 4k tokens
in rows of 512. Printed last, per backend (its largest rank count):
  scale: <backend> mfu=<x> peak/param=<bytes> held/param=<bytes> saved_mib=<MiB>
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file: this checkout as the package critic_adapters
    import as_a_file  # noqa: F401  (bench/as_a_file.py)

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "configs", "qwen2_5_0_5b.json")
LENGTHS = (512, 1024, 2048, 4096)  # rows of each length, 4096 tokens per update
TOKENS = (1024, 2048, 4096)  # tokens per update, rows of 512


def write_model(config_file: str, directory: str) -> int:
    """A random TokenCls critic of the config, written by transformers; returns its parameter count."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    from critic_adapters.common.valuehead._quiet import quiet_transformers

    config = AutoConfig.from_pretrained(config_file)
    config.num_labels = 1  # a critic's head, whatever the config says
    torch.manual_seed(0)
    with quiet_transformers():
        model = AutoModelForTokenClassification.from_config(config)
        model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def worker(backend: str, layout: str, model_dir: str, workdir: str, plan_json: str) -> None:
    """One backend at one layout: the build, a warm-up update, the planned updates, the export."""
    import torch.distributed as torch_dist

    from critic_adapters.common.engine.config import (BatchingConfig, EngineConfig, ModelConfig, OptimConfig,
                                                      ParallelConfig)
    from critic_adapters.bench.offload import rollout
    from critic_adapters.bench.rank_memory import layout_sizes, measured_build
    from critic_adapters.bench.tensor_bytes import DevicePeak, SavedForBackward, over_ranks, state_bytes
    from critic_adapters.common.engine.registry import model_critic_config
    from critic_adapters.common.job.telemetry import ModelShape, device_peak
    from critic_adapters.common.parallel.batching import data_parallel_shares
    from critic_adapters.common.parallel.distributed import all_reduce, init_distributed, shutdown
    from critic_adapters.common.parallel.host_memory import MemoryWindow

    dist = init_distributed()
    plan = [tuple(step) for step in json.loads(plan_json)]
    config = EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-5),
                          batching=BatchingConfig(micro_batch_tokens=max(length for length, _ in plan)),
                          gradient_checkpointing=True, parallel=ParallelConfig(**layout_sizes(layout)))
    world = torch_dist.group.WORLD
    engine, build, build_device = measured_build(backend, config, dist, workdir)
    critic_config = model_critic_config(config.model)
    vocab = critic_config.vocab_size
    shape = ModelShape.of(engine, critic_config)
    (peak_flops,) = all_reduce([device_peak(dist.device)], group=world)

    def update(length: int, tokens: int, seed: int) -> dict:
        batch = rollout(max(tokens // length, 1), length, vocab, seed)
        share = data_parallel_shares(batch.attention_mask, engine.dp_size)[engine.dp_rank]
        mine = batch.map(lambda tensor: tensor[share])
        torch_dist.barrier()
        with MemoryWindow() as memory, SavedForBackward(engine.model) as saved, DevicePeak() as device:
            start = time.perf_counter()
            engine.update(mine)
            seconds = time.perf_counter() - start
        seconds, peak = all_reduce([seconds, float(memory.peak - build.base)], op="max", group=world)
        held = over_ranks({"saved_for_backward": saved.peak, "device_peak_added": device.added}, world)
        flops = shape.training_flops(batch.attention_mask.sum(1))
        return {"length": length, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                "mfu": flops / (seconds * peak_flops), "peak_bytes": peak, **held["max_per_rank"]}

    update(plan[0][0], plan[0][0], seed=99)  # warm-up: Adam's state exists from here on
    steps = [update(length, tokens, seed) for seed, (length, tokens) in enumerate(plan)]
    state = state_bytes(engine)  # after the updates: the Adam state exists
    held = over_ranks({**state, "total": sum(state.values())}, world)
    with MemoryWindow() as export:
        engine.export_hf(os.path.join(workdir, "export"))
        torch_dist.barrier()
    parameters = engine.parameter_counts()[1]
    record = {"steps": steps, "parameters": parameters, "peak_flops": peak_flops,
              "load_peak": build.peak - build.base, "kept": build.after - build.base,
              "export_peak": export.peak - export.base, "held": held,
              "device_build_peak_added": build_device.added}
    with open(os.path.join(workdir, f"rank{dist.rank}.json"), "w") as f:
        json.dump(record, f)
    engine.close()
    shutdown()


def run(backend: str, ranks: int, model_dir: str, workdir: str, plan: list, megatron_layout: str = "tensor=2"
        ) -> list[dict]:
    layout = megatron_layout if backend == "megatron" and ranks == 2 else f"data={ranks}"
    env = dict(os.environ)
    if ranks == 1:
        env.pop("OMP_NUM_THREADS", None)  # one rank: every core
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "-m", "critic_adapters.bench.scale", "--worker", backend, layout, model_dir, workdir, json.dumps(plan)]
    result = subprocess_run(command, env)
    if result.returncode:
        raise SystemExit(f"{backend} at {ranks} rank(s) failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return [json.load(open(os.path.join(workdir, f"rank{rank}.json"))) for rank in range(ranks)]


def subprocess_run(command: list[str], env: dict):
    import subprocess

    return subprocess.run(command, capture_output=True, text=True, env=env)


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="fsdp,veomni,megatron")
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--config", default=CONFIG, help="the critic's config.json (default: Qwen2.5-0.5B-shaped)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of the measured update of every run")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                        help="row lengths of the first backend's sweep at 1 rank (tokens per update: the largest)")
    parser.add_argument("--sweep-tokens", default=",".join(map(str, TOKENS)),
                        help="tokens per update of the first backend's sweep at 1 rank (rows of the smallest length)")
    parser.add_argument("--megatron-layout", default="tensor=2",
                        help="megatron's layout at 2 ranks (expert=2 for a mixture-of-experts critic)")
    parser.add_argument("--out", help="write the results as JSON here too")
    args = parser.parse_args(argv)
    backends = args.backends.split(",")
    rank_counts = [int(r) for r in args.ranks.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    sweep_tokens = [int(x) for x in args.sweep_tokens.split(",")]
    start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "critic")
        parameters = write_model(args.config, model_dir)
        print(f"critic: {parameters / 1e6:.0f}M parameters ({args.config}); fp32 AdamW state: 16 bytes/parameter",
              flush=True)
        if "megatron" in backends and 2 in rank_counts:
            print(f"megatron at 2 ranks: {args.megatron_layout}")
        cuda = torch.cuda.is_available()
        print("| backend | ranks | update tokens/s | MFU | update peak per rank (bytes/param) | load peak per rank "
              "(x fp32 model) | export peak per rank (x fp32 model) | held by torch per rank (bytes/param) | saved for "
              "backward per rank (MiB) |" + (" device update peak per rank (bytes/param) |" if cuda else ""))
        print("|---|---|---|---|---|---|---|---|---|" + ("---|" if cuda else ""))
        for backend in backends:
            for ranks in rank_counts:
                plan = [(lengths[0], args.tokens)]
                sweep = backend == backends[0] and ranks == 1
                if sweep:
                    plan += [(length, max(lengths)) for length in lengths]
                    plan += [(lengths[0], tokens) for tokens in sweep_tokens if (lengths[0], tokens) not in plan]
                workdir = os.path.join(tmp, f"{backend}-{ranks}")
                os.makedirs(workdir)
                records = run(backend, ranks, model_dir, workdir, plan, args.megatron_layout)
                model_bytes = 4 * records[0]["parameters"]
                main_step = records[0]["steps"][0]
                row = {"backend": backend, "ranks": ranks, "steps": records[0]["steps"],
                       "update_peak_bytes_per_param": main_step["peak_bytes"] / records[0]["parameters"],
                       "load_peak": [r["load_peak"] / model_bytes for r in records],
                       "export_peak": [r["export_peak"] / model_bytes for r in records],
                       "peak_flops": records[0]["peak_flops"],
                       "held_bytes_per_param": records[0]["held"]["max_per_rank"]["total"] / records[0]["parameters"],
                       "held_all_ranks": records[0]["held"]["all_ranks"]}
                results.append(row)
                print(f"| {backend} | {ranks} | {main_step['tokens_per_s']:.1f} | {main_step['mfu']:.3f} | "
                      f"{row['update_peak_bytes_per_param']:.1f} | "
                      f"{' / '.join(f'{x:.2f}' for x in row['load_peak'])} | "
                      f"{' / '.join(f'{x:.2f}' for x in row['export_peak'])} | {row['held_bytes_per_param']:.1f} | "
                      f"{main_step['saved_for_backward'] / 2**20:.1f} |"
                      + (f" {main_step['device_peak_added'] / records[0]['parameters']:.1f} |" if cuda else ""),
                      flush=True)
        # The sweep's table after the main table, not between its rows: the first backend's 1-rank run.
        for row in [r for r in results if r["backend"] == backends[0] and r["ranks"] == 1]:
            print(f"\n{row['backend']} at 1 rank, update time by row length and by tokens per update:")
            print("| row length | tokens | update s | tokens/s | MFU | saved for backward (MiB) |\n"
                  "|---|---|---|---|---|---|")
            for step in row["steps"][1:]:
                print(f"| {step['length']} | {step['tokens']} | {step['seconds']:.1f} | "
                      f"{step['tokens_per_s']:.1f} | {step['mfu']:.3f} | {step['saved_for_backward'] / 2**20:.1f} |")
        print(flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": args.config, "parameters": parameters, "rows": results,
                       "seconds": time.perf_counter() - start}, f, indent=1)
    print(f"bench time: {time.perf_counter() - start:.0f} s")
    for backend in backends:
        row = [r for r in results if r["backend"] == backend][-1]
        print(f"scale: {backend} mfu={row['steps'][0]['mfu']:.3f} peak/param={row['update_peak_bytes_per_param']:.1f} "
              f"held/param={row['held_bytes_per_param']:.1f} "
              f"saved_mib={row['steps'][0]['saved_for_backward'] / 2**20:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
