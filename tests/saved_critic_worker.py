"""Torchrun worker of test_saved_critics.py: a critic another stack saved, through every backend's
engine at this world size, beside load_critic and plain transformers.

  python -m critic_adapters.tests.saved_critic_worker OUT_JSON NAME=MODEL_DIR [NAME=MODEL_DIR ...]

Each rank writes OUT_JSON.rank<r>: per critic NAME and registered backend, the largest difference (over every row's
real tokens) of `engine.compute_values` from load_critic + compute_values and from transformers'
own AutoModelForTokenClassification.from_pretrained(dtype=float32) on each row alone; or the error
its build or values raised; or why the backend cannot be built in this environment (its library is
not installed). Rank 0 also converts each critic with the CLI (`convert SRC DST`, float32 by default):
the dtypes written and the largest difference from the source's tensors. At two ranks megatron
runs at tensor degree 2 (each rank reads its partition of every matrix), the others data parallel 2
(each rank reads its rows of every tensor).
"""

from __future__ import annotations

import importlib.util
import json
import sys

import torch

from critic_adapters.common.engine.config import EngineConfig, ModelConfig, ParallelConfig
from critic_adapters.common.engine.registry import BACKENDS, build_engine
from critic_adapters.common.parallel.distributed import init_distributed, shutdown
from critic_adapters.common.valuehead import compute_values, load_critic

# The library each built-in backend needs beyond torch and transformers (a host's backend: none known).
LIBRARIES = {"megatron": "megatron.core", "veomni": "veomni"}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 12, 7 and 10 tokens: a right-padded, a left-padded and a plain row."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 990, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, :2] = 0
    return ids * mask, mask


def transformers_values(model_dir: str, ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Each row's real tokens alone through transformers' own critic class, in float32."""
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(input_ids=row[m.bool()][None]).logits[0, :, 0].float() for row, m in zip(ids, mask)]


def largest_difference(values: torch.Tensor, rows: list[torch.Tensor], mask: torch.Tensor) -> float:
    return max(float((values[i][m.bool()] - row).abs().max()) for i, (row, m) in enumerate(zip(rows, mask)))


def parallel(backend: str, world_size: int) -> ParallelConfig:
    return ParallelConfig(tensor=2) if backend == "megatron" and world_size == 2 else ParallelConfig()


def check(model_dir: str, dist) -> dict:
    ids, mask = batch()
    critic, _ = load_critic(model_dir)
    with torch.no_grad():
        loaded = compute_values(critic, ids, mask)
    reference = [row[m.bool()] for row, m in zip(loaded, mask)]
    plain = transformers_values(model_dir, ids, mask)
    result = {"load_critic_vs_transformers": largest_difference(loaded, plain, mask), "backends": {}}
    for backend in sorted(BACKENDS):
        library = LIBRARIES.get(backend)
        if library and importlib.util.find_spec(library.split(".")[0]) is None:
            result["backends"][backend] = {"not_installed": library}
            continue
        config = EngineConfig(model=ModelConfig(path=model_dir), parallel=parallel(backend, dist.world_size))
        try:  # every rank builds the same engine and fails alike: the next backend still runs
            engine = build_engine(backend, config, dist)
            values = engine.compute_values(ids, mask).cpu().float()
            engine.close()
        except Exception as error:  # noqa: BLE001 - reported by the test, under the backend's name
            result["backends"][backend] = {"error": f"{type(error).__name__}: {error}"}
            continue
        result["backends"][backend] = {"vs_load_critic": largest_difference(values, reference, mask),
                                       "vs_transformers": largest_difference(values, plain, mask)}
    return result


def converted(model_dir: str, out_dir: str) -> dict:
    """The CLI's `convert` of the critic (the default --dtype float32): what it wrote against the source."""
    from safetensors.torch import load_file

    from critic_adapters.common.valuehead.cli import main as cli

    assert cli(["convert", model_dir, out_dir]) == 0
    source, written = load_file(f"{model_dir}/model.safetensors"), load_file(f"{out_dir}/model.safetensors")
    return {"dtypes": sorted({str(t.dtype) for t in written.values()}),
            "difference": max(float((source[k].float() - written[k].float()).abs().max()) for k in source)}


def main() -> None:
    out, critics = sys.argv[1], dict(arg.split("=", 1) for arg in sys.argv[2:])
    dist = init_distributed()
    result = {name: check(model_dir, dist) for name, model_dir in critics.items()}
    if dist.rank == 0:
        for name, model_dir in critics.items():
            result[name]["convert"] = converted(model_dir, f"{out}.{name}.converted")
    with open(f"{out}.rank{dist.rank}", "w") as f:
        json.dump(result, f)
    shutdown()


if __name__ == "__main__":
    main()
