"""Per-update telemetry a user reads next to the loss (docs/METRICS.md defines each):

  time/update_s          wall seconds of engine.update, the slowest rank's
  time/compute_values_s  wall seconds of the compute_values pass that renewed old values before this
                         update (the slowest rank's; 0 when the update had none)
  mfu                    the update's model FLOPs over (time/update_s x the summed peak of every rank's
                         device): GPU, the device's dense bf16 peak; CPU, the matmul peak measured at
                         start with the rank's threads
  memory/peak_bytes      the largest per-rank peak during the update: CUDA max allocated, or on CPU the
                         process's resident high-water mark (common/parallel/host_memory.py)

Model FLOPs follow the PaLM convention: per token, 2N forward and 2N backward through the weights
plus 2N_trainable for the weight gradients (6N when every weight trains), N the non-embedding
parameters; attention adds 12 x layers x hidden x the row's length per token (forward and
backward, causal mask ignored). It assumes gradients flow through every layer (full training,
LoRA); a critic that trains its head alone does less backward work than counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from ..parallel.distributed import all_reduce, world_group
from ..parallel.host_memory import peak_resident_bytes, reset_peak
from ..valuehead.experts import experts_of

# Dense bf16 peak FLOP/s by device name (vendor datasheets), for MFU on GPU; others are measured.
BF16_PEAK = {"H200": 989.4e12, "H100": 989.4e12, "H800": 989.4e12, "A100": 312e12, "A800": 312e12,
             "L40S": 362.05e12, "L40": 181e12, "A10G": 70e12, "A10": 125e12, "L4": 121e12, "B200": 2250e12}


def measured_matmul_peak(device: torch.device, dtype: torch.dtype = torch.float32, seconds: float = 0.2) -> float:
    """FLOP/s of square matmuls on `device` (the rank's threads on CPU), the best of a few runs."""
    size = 512 if device.type == "cpu" else 4096
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best, spent = 0.0, 0.0
    while spent < seconds:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        spent += elapsed
        best = max(best, 4 * 2 * size**3 / elapsed)
    return best


def device_peak(device: torch.device) -> float:
    """This rank's device peak FLOP/s for MFU."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in BF16_PEAK.items():
            if key in name:
                return peak
        return measured_matmul_peak(device, torch.bfloat16)
    return measured_matmul_peak(device)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelShape:
    """What model FLOPs are counted from."""

    parameters: int
    """Non-embedding parameters."""
    trainable: int
    """Of those, the ones the optimizer steps."""
    layers: int
    hidden: int

    @classmethod
    def of(cls, engine, hf_config) -> "ModelShape":
        text = hf_config.get_text_config()
        trainable, total = engine.parameter_counts()
        embedding = text.vocab_size * text.hidden_size
        # A mixture of experts: each token goes through top_k of the routed experts, not all of them.
        experts = experts_of(text)
        idle = experts.idle_parameters if experts is not None else 0
        # The embedding is a lookup, not a matmul; counted as trainable only what the others can hold
        # (a frozen embedding under full training, LoRA's adapters, the head).
        active = max(total - embedding - idle, 0)
        return cls(active, max(min(trainable - idle if trainable == total else trainable, active), 0),
                   text.num_hidden_layers, text.hidden_size)

    def training_flops(self, lengths: torch.Tensor) -> float:
        """Model FLOPs of one update over rows of these lengths (non-padding tokens)."""
        tokens = float(lengths.sum())
        attention = 12.0 * self.layers * self.hidden * float((lengths.double() ** 2).sum())
        return tokens * (4.0 * self.parameters + 2.0 * self.trainable) + attention


class Telemetry:
    """Measures updates for the trainer; every method with a collective runs on every rank."""

    def __init__(self, engine, hf_config, device: torch.device):
        self.shape = ModelShape.of(engine, hf_config)
        self.device = device
        (self.peak_flops,) = all_reduce([device_peak(device)], group=world_group())
        self.values_seconds = 0.0

    @contextlib.contextmanager
    def compute_values(self):
        """Around the compute_values pass that renews old values before an update."""
        start = time.perf_counter()
        yield
        self.values_seconds += time.perf_counter() - start

    def _reset_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_peak()

    def _peak_memory(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return peak_resident_bytes()

    @contextlib.contextmanager
    def update(self, lengths: torch.Tensor):
        """Around engine.update of a mini-batch whose rows (all ranks) have `lengths`: yields a dict
        that holds this module's metrics once the block is done."""
        self._reset_memory()
        start = time.perf_counter()
        metrics: dict = {}
        yield metrics
        seconds = time.perf_counter() - start
        update_s, values_s, peak = all_reduce([seconds, self.values_seconds, float(self._peak_memory())], op="max",
                                              group=world_group())
        self.values_seconds = 0.0
        metrics.update({"time/update_s": update_s, "time/compute_values_s": values_s,
                        "mfu": self.shape.training_flops(lengths) / (update_s * self.peak_flops),
                        "memory/peak_bytes": peak})
