"""What each rank holds while an engine is built from an HF checkpoint and while it exports one, per
backend and layout, in units of the fp32 model (common/parallel/host_memory.py: the kernel's resident
high-water mark, per rank).

  python -m critic_adapters.bench.rank_memory [--layers 20] [--ranks 2,4] [--out FILE.json]
  python bench/rank_memory.py ...              (the same, run as a file)

The critic is a random Qwen2 TokenCls written by transformers (hidden 512, 2048-token vocabulary,
`--layers` layers: 20 is about 210 MiB in fp32). For each layout of 2 and 4 ranks, every rank
reports, over the model's bytes:
  load peak   the build's peak above what the rank held before it
  kept        what stays after the build (fsdp/VeOmni: the parameter shard; megatron: the
              partition plus DDP's fp32 gradient buffer)
  transient   load peak minus kept
  export      the export's peak above what the rank held before it (files of at most 48 MiB)
  save peak   a checkpoint save's peak above what the rank held before it (after one optimizer
              step), over the rank's own optimizer state (tensor_bytes' count): megatron's
              distributed optimizer writes what each rank owns (backends/megatron/optimizer_state.py)
  held by torch  the bytes of the rank's parameters, gradients and optimizer state after the build
              (bench/tensor_bytes.py state_bytes: tensor sizes, the same on any machine, where the
              resident figures above move with the allocator and the machine); on CUDA also the
              build's and the export's torch.cuda.max_memory_allocated above what was allocated
              before each (device load peak, device export peak)
and the engine's values are checked against plain transformers. Before the measured build each
rank builds one tiny critic of the same family (the backend's imports and process-wide buffers
are not the model's). Printed last: `rank memory: <backend> <layout> load <max> transient
<max> export <max> held by torch <max> save <max>` lines, the largest over ranks.

  python -m critic_adapters.bench.rank_memory --worker BACKEND LAYOUT MODEL_DIR WORKDIR
is one layout's torchrun worker (tests/test_rank_memory.py runs it): each rank writes
WORKDIR/rank<r>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

if __package__ in (None, ""):  # run as a file: this checkout as the package critic_adapters
    import as_a_file  # noqa: F401  (bench/as_a_file.py)

import torch  # noqa: E402

LAYOUTS = {2: [("fsdp", "data=2"), ("veomni", "data=2"), ("megatron", "data=2"), ("megatron", "tensor=2"),
               ("megatron", "pipeline=2")],
           4: [("fsdp", "data=4"), ("veomni", "data=4"), ("megatron", "tensor=2,pipeline=2"),
               ("megatron", "tensor=2"), ("megatron", "pipeline=4")]}


EXPORT_SHARD = 48 * 2**20  # a few files, as a real export has: the index and file cut are measured too


def write_critic_model(path: str, **sizes) -> int:
    """A Qwen2 TokenCls critic (fp32) written by transformers; returns its bytes. Many layers, as
    real critics have 24-80: FSDP's working memory in a forward is a few layers' worth, and with a
    small vocabulary a pipeline stage's share is about half."""
    from transformers import AutoModelForTokenClassification, Qwen2Config

    from critic_adapters.common.valuehead._quiet import quiet_transformers

    config = Qwen2Config(**{**dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=24, num_attention_heads=8,
                                   num_key_value_heads=2, vocab_size=2048, max_position_embeddings=512, num_labels=1,
                                   tie_word_embeddings=False), **sizes})
    torch.manual_seed(0)
    with quiet_transformers():
        model = AutoModelForTokenClassification.from_config(config)
        model.save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def write_warmup_model(path: str, model_dir: str) -> None:
    """A tiny critic of the model's family (its config kept in common/testdata, at least 4 layers;
    Qwen2 for the others)."""
    from transformers import AutoModelForTokenClassification

    from critic_adapters.common.testdata import FAMILIES, tiny_config
    from critic_adapters.common.valuehead._quiet import quiet_transformers

    with open(os.path.join(model_dir, "config.json")) as f:
        family = json.load(f).get("model_type")
    if family not in FAMILIES:
        write_critic_model(path, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)
        return
    config = tiny_config(family)
    if config.to_dict().get("num_hidden_layers", 4) < 4:  # a layer for each stage of pipeline=4
        fields = {**config.to_dict(), "num_hidden_layers": 4}
        fields.pop("layer_types", None)  # one per layer: the config's default for 4
        config = type(config)(**fields)
    config.num_labels = 1
    torch.manual_seed(0)
    with quiet_transformers():
        AutoModelForTokenClassification.from_config(config).save_pretrained(path)


def ratios(record: dict, model_bytes: int) -> dict:
    return {"load_peak": (record["build_peak"] - record["base"]) / model_bytes,
            "kept": (record["after_build"] - record["base"]) / model_bytes,
            "transient": (record["build_peak"] - record["after_build"]) / model_bytes,
            "export_peak": (record["export_peak"] - record["export_base"]) / model_bytes,
            # the checkpoint save's peak above what the rank held before it, over the rank's own
            # optimizer state (bench/tensor_bytes.py's count after a step)
            "save_peak": (record["save_peak"] - record["save_base"]) / record["optimizer_bytes"]}


def torch_ratios(record: dict, model_bytes: int) -> dict:
    """What torch holds of the critic after the build (bench/tensor_bytes.py state_bytes: the
    parameters, gradients and optimizer state, from tensor sizes) and, on CUDA, the build's and the
    export's max_memory_allocated above what was allocated before (None off CUDA), over the model's
    bytes: figures that do not move with the allocator or the machine."""
    held = record["held_after_build"]
    device = {key: None if record[f"device_{key}_added"] is None else record[f"device_{key}_added"] / model_bytes
              for key in ("build_peak", "export_peak")}
    return {"held": sum(held.values()) / model_bytes, **{f"held_{k}": v / model_bytes for k, v in held.items()},
            **{f"device_{k}": v for k, v in device.items()}}


def plain_values(path: str) -> torch.Tensor:
    from transformers import AutoModelForTokenClassification

    ids, mask = probe_batch()
    with torch.no_grad():
        plain = AutoModelForTokenClassification.from_pretrained(path).eval()
        return plain(input_ids=ids, attention_mask=mask).logits.squeeze(-1)


def probe_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 2000, (2, 24), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 18:] = 0
    return ids, mask


def layout_sizes(layout: str) -> dict[str, int]:
    """ParallelConfig sizes of a LAYOUT argument (`data=` is what the others leave)."""
    return {key: int(value) for key, value in (item.split("=") for item in layout.split(",")) if key != "data"}


def measured_build(backend: str, config, dist, workdir: str):
    """(the engine, the MemoryWindow of its build, its DevicePeak) on every rank. One build of a tiny
    critic of the same family comes first: the imports and process-wide buffers the backend sets up
    once are not what a rank holds of this model."""
    import torch.distributed as torch_dist

    from critic_adapters.bench.tensor_bytes import DevicePeak
    from critic_adapters.common.engine.config import ModelConfig
    from critic_adapters.common.engine.registry import build_engine
    from critic_adapters.common.parallel.host_memory import MemoryWindow

    warmup = os.path.join(workdir, "warmup")
    if dist.is_main:
        write_warmup_model(warmup, config.model.path)
    torch_dist.barrier()
    tiny = build_engine(backend, dataclasses.replace(config, model=ModelConfig(path=warmup)), dist)
    one_update(tiny, *(t % 64 for t in probe_batch()))  # ids any tiny vocabulary has
    tiny.save_checkpoint(os.path.join(workdir, "warmup-checkpoint"))  # the save's imports and DCP's set-up
    tiny.close()
    torch_dist.barrier()
    with MemoryWindow() as build, DevicePeak() as device:
        engine = build_engine(backend, config, dist)
        torch_dist.barrier()
    return engine, build, device


def one_update(engine, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """One optimizer step on these rows: the optimizer state exists, as at any save of a run."""
    engine.forward_backward(ids, mask, lambda values: values.square().mean())
    engine.step_optimizer()


def worker(backend: str, layout: str, model_dir: str, workdir: str) -> None:
    import torch.distributed as torch_dist

    from critic_adapters.bench.tensor_bytes import DevicePeak, state_bytes
    from critic_adapters.common.engine.config import EngineConfig, ModelConfig, ParallelConfig
    from critic_adapters.common.parallel.distributed import init_distributed, shutdown
    from critic_adapters.common.parallel.host_memory import MemoryWindow

    dist = init_distributed()
    config = EngineConfig(model=ModelConfig(path=model_dir), parallel=ParallelConfig(**layout_sizes(layout)))
    engine, build, build_device = measured_build(backend, config, dist, workdir)
    held = state_bytes(engine)  # what torch holds of the critic after the build
    ids, mask = probe_batch()
    values = engine.compute_values(ids, mask)
    torch_dist.barrier()
    with MemoryWindow() as export, DevicePeak() as export_device:
        engine.export_hf(os.path.join(workdir, "export"), max_shard_size=EXPORT_SHARD)
        torch_dist.barrier()
    one_update(engine, ids, mask)
    held_after_update = state_bytes(engine)
    torch_dist.barrier()
    with MemoryWindow() as save:
        engine.save_checkpoint(os.path.join(workdir, "checkpoint"))
        torch_dist.barrier()
    record = {"base": build.base, "build_peak": build.peak, "after_build": build.after,
              "export_base": export.base, "export_peak": export.peak, "report": str(engine.load_report),
              "held_after_build": held, "device_build_peak_added": build_device.added,
              "device_export_peak_added": export_device.added, "save_base": save.base, "save_peak": save.peak,
              "optimizer_bytes": held_after_update["optimizer"]}
    if dist.is_main:
        record["values"] = values.tolist()
    with open(os.path.join(workdir, f"rank{dist.rank}.json"), "w") as f:
        json.dump(record, f)
    engine.close()
    shutdown()


def run_layout(backend: str, layout: str, ranks: int, model_dir: str, workdir: str) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "-m", "critic_adapters.bench.rank_memory", "--worker", backend, layout, model_dir, workdir]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{backend} {layout} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return [json.load(open(os.path.join(workdir, f"rank{rank}.json"))) for rank in range(ranks)]


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--out", help="write the results as JSON here too")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "critic")
        model_bytes = write_critic_model(model_dir, num_hidden_layers=args.layers)
        expected = plain_values(model_dir)
        mask = probe_batch()[1].bool()
        print(f"critic: {model_bytes / 2**20:.0f} MiB fp32; ratios are of that")
        cuda = torch.cuda.is_available()
        print("| backend | layout | ranks | load peak | kept | transient | export peak | held by torch "
              "| save peak (x own optimizer state) |" + (" device load peak | device export peak |" if cuda else ""))
        print("|---|---|---|---|---|---|---|---|---|" + ("---|---|" if cuda else ""))
        for ranks in map(int, args.ranks.split(",")):
            for backend, layout in LAYOUTS[ranks]:
                workdir = os.path.join(tmp, f"{backend}-{layout}-{ranks}")
                os.makedirs(workdir)
                records = run_layout(backend, layout, ranks, model_dir, workdir)
                error = float((torch.tensor(records[0]["values"]) - expected).abs()[mask].max())
                per_rank = [{**ratios(r, model_bytes), **torch_ratios(r, model_bytes)} for r in records]
                rows.append({"backend": backend, "layout": layout, "ranks": ranks, "per_rank": per_rank,
                             "values_max_error": error})
                keys = ("load_peak", "kept", "transient", "export_peak", "held", "save_peak")
                cells = [" / ".join(f"{r[key]:.2f}" for r in per_rank)
                         for key in keys + (("device_build_peak", "device_export_peak") if cuda else ())]
                print(f"| {backend} | {layout} | {ranks} | " + " | ".join(cells) + " |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model_bytes": model_bytes, "layers": args.layers, "rows": rows}, f, indent=1)
    for row in rows:
        print(f"rank memory: {row['backend']} {row['layout']} ({row['ranks']} ranks) load "
              f"{max(r['load_peak'] for r in row['per_rank']):.2f} transient "
              f"{max(r['transient'] for r in row['per_rank']):.2f} export "
              f"{max(r['export_peak'] for r in row['per_rank']):.2f} held by torch "
              f"{max(r['held'] for r in row['per_rank']):.2f} save {max(r['save_peak'] for r in row['per_rank']):.2f}"
              f" values error {row['values_max_error']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
