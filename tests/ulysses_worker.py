"""torchrun worker (2 ranks): one backend's engine at engine.parallel.ulysses=2 against the same
engine at ulysses=1, on the same rows (every rank passes the whole mini-batch; at ulysses=1 the two
ranks are data-parallel over duplicated rows, whose global-mean loss and gradient are those of the
rows once).

argv: backend workdir model_dir... (one per family). Rank 0 writes workdir/result.pt:
{(family, packing): {ulysses: {"values", "short_values", "metrics" (5 updates), "values_after"}}},
plus, under "controls", the values of two naive splits at ulysses=2 (packed qwen2): attention over
this rank's columns only, and attention across the packed sequences' boundaries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import warnings

import torch

from critic_adapters.common.parallel import ulysses
from critic_adapters.common.engine.config import BatchingConfig, EngineConfig, LossConfig, ModelConfig, OptimConfig, ParallelConfig
from critic_adapters.common.parallel.distributed import init_distributed, shutdown
from critic_adapters.common.engine import RolloutBatch, build_engine
from critic_adapters.common.parallel.packed_attention import segment_bounds
from critic_adapters.common.tests.helpers import save_rollout_batch

# Packed: one micro-batch of 43 tokens, split at 22, so the third sequence straddles the ranks;
# padded: rows of 13 columns split 7 + 6, every long row straddles.
LENGTHS = [7, 12, 13, 5, 6]
STEPS = 5


def engine_config(path: str, *, degree: int, packing: bool, checkpointing: bool) -> EngineConfig:
    return EngineConfig(model=ModelConfig(path=path), optim=OptimConfig(lr=1e-3, grad_clip=1.0),
                        loss=LossConfig(clip_range=0.2), batching=BatchingConfig(micro_batch_tokens=64, packing=packing),
                        parallel=ParallelConfig(ulysses=degree), gradient_checkpointing=checkpointing)


def rollout_batch(workdir: str, lengths: list[int], name: str) -> RolloutBatch:
    data = save_rollout_batch(f"{workdir}/{name}_{torch.distributed.get_rank()}.pt", lengths, seed=3)
    return RolloutBatch(data["input_ids"], data["attention_mask"], data["response_mask"], data["old_values"],
                        data["returns"])


def run(backend: str, config: EngineConfig, dist, batch: RolloutBatch, short: RolloutBatch, *, train: bool) -> dict:
    engine = build_engine(backend, config, dist)
    try:
        out = {"values": engine.compute_values(batch.input_ids, batch.attention_mask),
               "short_values": engine.compute_values(short.input_ids, short.attention_mask)}
        if train:
            out["metrics"] = [engine.update(batch) for _ in range(STEPS)]
            out["values_after"] = engine.compute_values(batch.input_ids, batch.attention_mask)
        return out
    finally:
        engine.close()


@contextlib.contextmanager
def naive_split(kind: str):
    """A broken Ulysses for the negative control: 'local' attends over this rank's columns only (no
    all-to-all), 'across' lets the packed sequences attend to each other (one span per row)."""
    real_all_to_all, real_split = ulysses.all_to_all, ulysses.split_micro_batch

    def local_split(mb, group):  # each rank's own columns, cut at their own position restarts
        split = real_split(mb, group)
        return dataclasses.replace(split, spans=[segment_bounds(row) for row in split.position_ids])

    def whole_row(mb, group):  # one span over the whole packed row
        split = real_split(mb, group)
        full = split.input_ids.shape[1] * split.size
        return dataclasses.replace(split, spans=[[(0, full)] for _ in split.spans])

    if kind == "local":
        ulysses.all_to_all = lambda x, group, **kw: x
        ulysses.split_micro_batch = local_split
    else:
        ulysses.split_micro_batch = whole_row
    try:
        yield
    finally:
        ulysses.all_to_all, ulysses.split_micro_batch = real_all_to_all, real_split


def main() -> None:
    warnings.filterwarnings("ignore")
    backend, workdir, model_dirs = sys.argv[1], sys.argv[2], sys.argv[3:]
    dist = init_distributed()
    batch = rollout_batch(workdir, LENGTHS, "batch")
    short = rollout_batch(workdir, [1], "short")  # a batch shorter than the Ulysses degree
    result: dict = {}
    for path in model_dirs:
        family = path.rstrip("/").rsplit("/", 1)[-1]
        for packing in (True, False):
            # Gradient checkpointing on llama: the backward recomputes Ulysses attention.
            checkpointing = family == "llama"
            result[(family, packing)] = {
                degree: run(backend, engine_config(path, degree=degree, packing=packing, checkpointing=checkpointing),
                            dist, batch, short, train=True)
                for degree in (1, 2)}
    qwen2 = next(p for p in model_dirs if p.rstrip("/").endswith("qwen2"))
    controls = {}
    for kind in ("local", "across"):
        with naive_split(kind):
            controls[kind] = run(backend, engine_config(qwen2, degree=2, packing=True, checkpointing=False),
                                 dist, batch, short, train=False)["values"]
    result["controls"] = controls
    if dist.is_main:
        torch.save(result, f"{workdir}/result.pt")
    shutdown()


if __name__ == "__main__":
    main()
