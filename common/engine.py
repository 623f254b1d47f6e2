"""The engine API every backend implements, and the registry that builds one by name.

An engine owns a critic, its optimizer and schedule, and its parallelisation:
  compute_values(input_ids, attention_mask) -> float32 [B, T]   (value at each position, unshifted)
  update(batch) -> metrics                                       (one optimizer step on a mini-batch)
  save_checkpoint(dir, extra_state) / load_checkpoint(dir) -> extra_state
  export_hf(dir)                                                 (a plain *ForTokenClassification)
  close()                                                        (release it; before the process group)
Each rank passes its own share of a mini-batch; the engine normalises the loss over all ranks.

Importing this module imports no backend: the registry maps names to module paths, imported
only when that backend is built.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Protocol

import torch

from common.config import EngineConfig
from common.distributed import DistContext


@dataclasses.dataclass(frozen=True, slots=True)
class RolloutBatch:
    """One rank's share of a mini-batch; all tensors [B, T], right- or left-padded.

    Per-token fields are aligned with input_ids: response_mask[t] = 1 when token t is a response
    token; old_values[t] and returns[t] belong to that token. The critic's prediction for token t is
    its value at position t - 1 (the state before the token), as in verl, OpenRLHF and trl.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    old_values: torch.Tensor
    returns: torch.Tensor

    def __post_init__(self):
        shape = self.input_ids.shape
        for field in dataclasses.fields(self):
            tensor = getattr(self, field.name)
            if tensor.shape != shape:
                raise ValueError(f"RolloutBatch.{field.name} has shape {tuple(tensor.shape)}, input_ids {tuple(shape)}")
        if bool((self.response_mask.bool() & ~self.attention_mask.bool()).any()):
            raise ValueError("RolloutBatch.response_mask marks padding positions as response tokens")
        if shape[-1] and bool(self.response_mask[:, 0].any()):
            raise ValueError("RolloutBatch.response_mask marks position 0: a response token needs a token before it")


class CriticEngine(Protocol):
    def compute_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor: ...

    def update(self, batch: RolloutBatch) -> dict[str, float]: ...

    def save_checkpoint(self, directory: str, extra_state: dict | None = None) -> None: ...

    def load_checkpoint(self, directory: str) -> dict: ...

    def export_hf(self, directory: str) -> None: ...

    def close(self) -> None: ...


# backend name -> "module:factory"; factory(config, dist) -> CriticEngine.
BACKENDS: dict[str, str] = {
    "fsdp": "backends.fsdp.engine:FSDPCriticEngine",
    "megatron": "backends.megatron.engine:MegatronCriticEngine",
}


def build_engine(backend: str, config: EngineConfig, dist: DistContext) -> CriticEngine:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; available: {', '.join(sorted(BACKENDS))}")
    module_name, factory = BACKENDS[backend].split(":")
    return getattr(importlib.import_module(module_name), factory)(config, dist)


def shift_to_tokens(values: torch.Tensor) -> torch.Tensor:
    """[B, T] values at positions -> predictions for tokens: pred[:, t] = values[:, t - 1], pred[:, 0] = 0."""
    return torch.cat([values.new_zeros(values.shape[0], 1), values[:, :-1]], dim=1)
