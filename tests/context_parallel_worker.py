"""torchrun worker for tests/test_context_parallel.py: the megatron engine at engine.parallel.context
N beside the same engine without context parallelism, on the same rows.

argv: mode out_file spec_json model_dir work_dir [+ the same for another run ...] (the runs one after
another in these processes)
  compare (2 ranks): for each packing in spec["packings"], an engine per layout in spec["layouts"]
     ({"name": {"context": 2, ...}}; the others' ranks are data parallel) computes the values of two
     batches (sequences that straddle the CP split, and one of 1-token sequences), then one
     forward_backward + step_optimizer (the verl primitive) and spec["steps"] updates; rank 0
     writes {packing: {layout: results}}. A layout with "control": true replaces the K/V gather of
     attention.py with this rank's keys repeated N times: the naive split the test must catch.
  save (2 ranks, CP 2): 2 updates, a checkpoint in work_dir/ckpt, the HF export in
     work_dir/hf_export, then the values and one more update.
  resume (1 rank, CP 1): the checkpoint loaded, then the values and one more update.
"""

import json
import os
import sys
import warnings

import torch
import torch.distributed as torch_dist

from critic_adapters.common.engine.config import BatchingConfig, EngineConfig, LossConfig, ModelConfig, OptimConfig, ParallelConfig
from critic_adapters.common.parallel.distributed import init_distributed, shutdown
from critic_adapters.common.engine import RolloutBatch, build_engine
from critic_adapters.common.tests.helpers import FIELDS, save_rollout_batch
from critic_adapters.common.tests.torchrun import argv_runs

# Right-padded rows of these lengths: at CP 2 every sequence of 4 tokens or more straddles a chunk
# boundary, and 11 is not a multiple of 4 (dummy padding inside each sequence).
STRADDLING = (11, 7, 3, 10, 5, 1)
ONE_TOKEN = (1, 1, 1, 1)  # 4 rows: every rank of a 4-rank reference holds one
UPDATE_LENGTHS = [17, 9, 20, 4, 13, 11, 20, 6]


def _rows(lengths, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 990, (len(lengths), max(lengths)), generator=g)
    mask = torch.zeros(ids.shape, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return ids * mask, mask


def _engine(dist, model_dir: str, layout: dict, packing: bool):
    config = EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-3, grad_clip=1.0),
                          loss=LossConfig(clip_range=0.2),
                          batching=BatchingConfig(micro_batch_tokens=48, packing=packing),
                          parallel=ParallelConfig(**{k: v for k, v in layout.items() if k != "control"}))
    return build_engine("megatron", config, dist)


def _mine(engine, rows: int) -> torch.Tensor:
    return torch.arange(engine.dp_rank, rows, engine.dp_size)


def _full_values(engine, dist, ids, mask) -> torch.Tensor:
    """compute_values of this rank's share, the shares put together (every rank gets them)."""
    mine = _mine(engine, ids.shape[0])
    values = engine.compute_values(ids[mine], mask[mine])
    shares = [None] * dist.world_size
    torch_dist.all_gather_object(shares, (mine, values))
    full = torch.zeros(ids.shape)
    for index, part in shares:
        full[index] = part
    return full


def _forward_backward(engine, batch: dict) -> dict:
    """One forward_backward of this rank's rows with a loss averaged over the mini-batch's rows, then
    the optimizer step: its grad norm, and the loss summed over the data-parallel ranks."""
    mine = _mine(engine, batch["input_ids"].shape[0])
    rows = batch["input_ids"].shape[0]
    mask, returns = batch["response_mask"][mine].float(), batch["returns"][mine]
    # Each rank's share of the mini-batch loss (DDP averages over dp_size ranks: times dp_size).
    loss_fn = lambda values: (((values - returns) ** 2) * mask).sum() / rows * engine.dp_size  # noqa: E731
    _, loss = engine.forward_backward(batch["input_ids"][mine], batch["attention_mask"][mine], loss_fn)
    counts = engine.cp_rank == 0 and engine.tp_rank == 0 and engine.pp_rank == 0  # one rank per share
    total = torch.tensor([float(loss) / engine.dp_size if counts else 0.0], dtype=torch.float64)
    torch_dist.all_reduce(total)
    return {"loss": float(total), "grad_norm": engine.step_optimizer()}


def _batch(engine, data: dict) -> RolloutBatch:
    mine = _mine(engine, data["input_ids"].shape[0])
    return RolloutBatch(*(data[k][mine] for k in FIELDS))


def _naive_split(layout_size: int):
    """The negative control: attention over this rank's own keys only (tiled to the full length)."""
    from critic_adapters.backends.megatron import attention

    original = attention.gather_keys
    attention.gather_keys = lambda x, group, bounds: torch.cat([x] * layout_size, dim=0)
    return lambda: setattr(attention, "gather_keys", original)


def compare(dist, spec: dict, model_dir: str, work_dir: str) -> dict:
    data = save_rollout_batch(os.path.join(work_dir, f"batch_{dist.rank}.pt"), UPDATE_LENGTHS)
    results = {}
    for packing in spec["packings"]:
        for name, layout in spec["layouts"].items():
            restore = _naive_split(layout["context"]) if layout.get("control") else None
            engine = _engine(dist, model_dir, layout, packing)
            out = {"straddling": _full_values(engine, dist, *_rows(STRADDLING, 1)),
                   "one_token": _full_values(engine, dist, *_rows(ONE_TOKEN, 2)),
                   "mask": _rows(STRADDLING, 1)[1]}
            if not layout.get("control"):
                out["forward_backward"] = _forward_backward(engine, data)
                out["updates"] = [engine.update(_batch(engine, data)) for _ in range(spec["steps"])]
            engine.close()
            if restore is not None:
                restore()
            results.setdefault(str(packing), {})[name] = out
    return results


def checkpoint_round(dist, mode: str, model_dir: str, work_dir: str) -> dict:
    """save: CP 2 (2 ranks); resume: CP 1 (1 rank). Both end with the values and one update."""
    data = save_rollout_batch(os.path.join(work_dir, f"batch_{mode}_{dist.rank}.pt"), UPDATE_LENGTHS)
    engine = _engine(dist, model_dir, {"context": 2} if mode == "save" else {}, packing=True)
    ckpt = os.path.join(work_dir, "ckpt")
    if mode == "save":
        for _ in range(2):
            engine.update(_batch(engine, data))
        engine.save_checkpoint(ckpt, {"step": 2})
        engine.export_hf(os.path.join(work_dir, "hf_export"))
    else:
        assert engine.load_checkpoint(ckpt) == {"step": 2}
    out = {"values": _full_values(engine, dist, *_rows(STRADDLING, 1)), "weights": engine.hf_state_dict()}
    out["next"] = engine.update(_batch(engine, data))
    engine.close()
    return out


def main() -> None:
    warnings.filterwarnings("ignore")
    dist = init_distributed()
    for mode, out_file, spec, model_dir, work_dir in argv_runs(sys.argv[1:]):
        if mode == "compare":
            result = compare(dist, json.loads(spec), model_dir, work_dir)
        else:
            result = checkpoint_round(dist, mode, model_dir, work_dir)
        if dist.is_main:
            torch.save(result, out_file)
    shutdown()


if __name__ == "__main__":
    main()
