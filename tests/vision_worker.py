"""torchrun worker for test_vision_critics: vision-language critics on an FSDP2 backend, 1 or 2 ranks.

  python -m critic_adapters.tests.vision_worker BACKEND ROOT FAMILY...
For each family, ROOT/FAMILY/critic holds the critic (test_vision_critics writes it). Each
data-parallel rank takes its own image batch (vision_rollout(family, rank)). Rank r writes
ROOT/FAMILY/result{r}.pt: the values with packing and without (several micro-batches each), one
update's metrics and the values after it, forward_backward's values, and rows from an export.
On two ranks, the first family also runs the machinery (ROOT/FAMILY/machinery-BACKEND{r}.pt): gradient
checkpointing + freeze_vision + an offload cycle, a checkpoint and a resumed engine's next step,
ranks with and without images in one call, HSDP (replicate 2) against plain data parallel, LoRA, and Ulysses refused by name at build.
"""

import dataclasses
import os
import sys
import warnings

from critic_adapters.common.engine import RolloutBatch, shift_to_tokens
from critic_adapters.common.engine.config import (BatchingConfig, EngineConfig, LoRAConfig, ModelConfig, OptimConfig,
                                                   ParallelConfig)
from critic_adapters.common.engine.registry import build_engine
from critic_adapters.common.parallel.distributed import init_distributed, shutdown
from critic_adapters.common.testdata import tiny_config
from critic_adapters.common.testdata.vision import vision_batch

import torch

LR = 1e-3
# Row layouts: several images in a row, a text-only row, a left-padded row, grids of other shapes.
LAYOUT = [[(1, 4, 4)], [(1, 4, 6), (1, 2, 2)], [], [(1, 2, 4)]]


def engine_config(model_dir: str, *, packing: bool = True) -> EngineConfig:
    return EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=LR),
                        batching=BatchingConfig(micro_batch_tokens=40, packing=packing), collective_timeout_s=120.0)


def vision_rollout(family: str, rank: int) -> RolloutBatch:
    """Rank `rank`'s batch: LAYOUT's rows (row 1 left-padded), response = the last 4 tokens of each row,
    returns random on them, old values 0 (set from the critic by the worker)."""
    ids, mask, images = vision_batch(tiny_config(family), LAYOUT, seed=rank, left=(1,))
    response = torch.zeros_like(mask)
    for row in range(ids.shape[0]):
        valid = mask[row].nonzero().flatten()
        response[row, valid[-4:]] = 1
    returns = torch.randn(ids.shape, generator=torch.Generator().manual_seed(100 + rank)) * response
    return RolloutBatch(ids, mask, response, torch.zeros(ids.shape), returns, multi_modal_inputs=images)


def run(dist, backend: str, root: str, family: str) -> None:
    work = os.path.join(root, family)
    model_dir = os.path.join(work, "critic")
    batch = vision_rollout(family, dist.rank)
    images = batch.multi_modal_inputs
    result = {}
    padded = build_engine(backend, engine_config(model_dir, packing=False), dist)
    result["values_padded"] = padded.compute_values(batch.input_ids, batch.attention_mask, images)
    padded.close()
    engine = build_engine(backend, engine_config(model_dir), dist)
    result["pieces"], _ = engine.forward_backward(batch.input_ids, batch.attention_mask, None, images)
    result["values_packed"], step = _step(engine, batch)
    result["metrics"] = engine.update(step)
    result["values_after"] = engine.compute_values(batch.input_ids, batch.attention_mask, images)
    engine.export_hf(os.path.join(work, f"export-{backend}{dist.world_size}"))
    engine.close()
    torch.save(result, os.path.join(work, f"result{dist.rank}.pt"))


def _step(engine, batch: RolloutBatch) -> tuple:
    """(the critic's values on the batch, the batch with them as its old values)."""
    values = engine.compute_values(batch.input_ids, batch.attention_mask, batch.multi_modal_inputs)
    return values, RolloutBatch(batch.input_ids, batch.attention_mask, batch.response_mask,
                                shift_to_tokens(values) * batch.response_mask, batch.returns,
                                multi_modal_inputs=batch.multi_modal_inputs)


def _tower(engine) -> dict:
    from critic_adapters.tests.transform_worker import parameters

    return {name: tensor for name, tensor in parameters(engine).items() if ".visual." in f".{name}"}


def machinery(dist, backend: str, root: str, family: str) -> None:
    """The rest of the machinery with images, each against the plain engine's step."""
    work = os.path.join(root, family)
    model_dir = os.path.join(work, "critic")
    batch = vision_rollout(family, dist.rank)
    images = batch.multi_modal_inputs
    out = {}
    base = engine_config(model_dir)
    plain = build_engine(backend, base, dist)
    text = vision_rollout(family, 0).select([2])  # the text row, the same on every rank
    out["text_values"] = plain.compute_values(text.input_ids, text.attention_mask)
    out["blind"] = blind_calls(plain, batch)
    out["plain"] = plain.update(_step(plain, batch)[1])
    out["plain_values"] = plain.compute_values(batch.input_ids, batch.attention_mask, images)
    # Ranks with and without images in one call: rank 1 passes its text row only, then no rows at all
    # (the vision tower is an FSDP unit: every rank must run it as often).
    mixed = batch if dist.rank == 0 else batch.select([2])
    out["mixed_values"] = plain.compute_values(mixed.input_ids, mixed.attention_mask, mixed.multi_modal_inputs)
    empty = batch if dist.rank == 0 else batch.select([])
    out["empty_values"] = plain.compute_values(empty.input_ids, empty.attention_mask, empty.multi_modal_inputs)
    out["mixed_update"] = plain.update(_step(plain, mixed)[1])
    plain.close()
    hsdp = build_engine(backend, dataclasses.replace(base, parallel=ParallelConfig(replicate=2)), dist)
    out["hsdp"] = hsdp.update(_step(hsdp, batch)[1])
    out["hsdp_values"] = hsdp.compute_values(batch.input_ids, batch.attention_mask, images)
    hsdp.close()
    frozen_config = dataclasses.replace(base, gradient_checkpointing=True, transforms=["freeze_vision"])
    frozen = build_engine(backend, frozen_config, dist)
    tower_before = _tower(frozen)
    frozen.offload()
    frozen.onload()
    out["frozen"] = frozen.update(_step(frozen, batch)[1])
    tower_after = _tower(frozen)
    out["tower_unchanged"] = bool(tower_before) and all(torch.equal(tower_before[n], tower_after[n])
                                                        for n in tower_before)
    out["tower_size"] = len(tower_before)
    out["counts"] = frozen.parameter_counts()
    checkpoint = os.path.join(work, "checkpoint")
    frozen.save_checkpoint(checkpoint, {"step": 1})
    out["next"] = frozen.update(_step(frozen, batch)[1])
    out["next_values"] = frozen.compute_values(batch.input_ids, batch.attention_mask, images)
    frozen.close()
    resumed = build_engine(backend, frozen_config, dist)
    resumed.load_checkpoint(checkpoint)
    out["resumed"] = resumed.update(_step(resumed, batch)[1])
    out["resumed_values"] = resumed.compute_values(batch.input_ids, batch.attention_mask, images)
    resumed.close()
    lora = build_engine(backend, dataclasses.replace(base, lora=LoRAConfig(rank=4, alpha=8.0)), dist)
    out["lora_before"] = lora.compute_values(batch.input_ids, batch.attention_mask, images)
    out["lora"] = lora.update(_step(lora, batch)[1])
    out["lora_trainable"] = sorted(n for n, p in lora.model.named_parameters() if p.requires_grad)
    lora.close()
    # Ulysses 2 (both ranks one sequence group): text rows run, images are refused at the call (fsdp;
    # VeOmni refuses the layout at build, its model running the tower in every forward).
    try:
        split = build_engine(backend, dataclasses.replace(base, parallel=ParallelConfig(ulysses=2)), dist)
    except ValueError as error:
        out["ulysses_build"] = str(error)
        torch.save(out, os.path.join(work, f"machinery-{backend}{dist.rank}.pt"))
        return
    out["ulysses_build"] = None
    out["ulysses_text_values"] = split.compute_values(text.input_ids, text.attention_mask)
    out["ulysses_text_update"] = split.update(_step(split, text)[1])
    out["ulysses_text_after"] = split.compute_values(text.input_ids, text.attention_mask)
    try:
        split.compute_values(batch.input_ids, batch.attention_mask, images)
        out["ulysses_images"] = None
    except ValueError as error:
        out["ulysses_images"] = str(error)
    split.close()
    torch.save(out, os.path.join(work, f"machinery-{backend}{dist.rank}.pt"))


def blind_calls(engine, batch: RolloutBatch) -> dict:
    """The image rows without their images, through compute_values, forward_backward and update: each
    refusal's message (None where a call accepted them)."""
    blind = dataclasses.replace(batch, multi_modal_inputs=None)
    calls = {"compute_values": lambda: engine.compute_values(blind.input_ids, blind.attention_mask),
             "forward_backward": lambda: engine.forward_backward(blind.input_ids, blind.attention_mask, None),
             "update": lambda: engine.update(dataclasses.replace(_step(engine, batch)[1], multi_modal_inputs=None))}
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except ValueError as error:
            out[name] = str(error)
    return out


def main() -> None:
    warnings.filterwarnings("ignore")
    backend, root, families = sys.argv[1], sys.argv[2], sys.argv[3:]
    dist = init_distributed()
    for family in families:
        run(dist, backend, root, family)
    if dist.world_size == 2:
        machinery(dist, backend, root, families[0])
    shutdown()


if __name__ == "__main__":
    main()
