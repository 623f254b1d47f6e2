"""HL-Gauss distributional values (Farebrother et al., 2024, "Stop Regressing"): the critic's head
gives logits over `num_bins` bins of a fixed return range; the value is the expectation of the bin
centres under softmax(logits), and training is cross-entropy against the return smeared by a
Gaussian of width sigma = sigma_ratio * bin width over the bins.

  edges  e_0..e_K = linspace(min_value, max_value, K + 1);  centres c_k = (e_k + e_{k+1}) / 2
  target p_k(y)   = [Phi((e_{k+1} - y) / sigma) - Phi((e_k - y) / sigma)]
                    / [Phi((e_K - y) / sigma) - Phi((e_0 - y) / sigma)],   y clamped to the range
  value           = sum_k softmax(logits)_k * c_k   (float32)

A critic carries its support in its HF config as `critic_value_head` ({"kind": "hl_gauss",
"num_bins", "min_value", "max_value", "sigma_ratio"}); a config without it is a scalar critic.
Its head module is HLGaussHead: the same `weight` [K, H] and `bias` [K] as the Linear that
transformers builds (so state dicts and exports are plain), whose forward returns the values
[..., 1] — so every caller that reads `.logits` (compute_values, verl's critic, trl's PPOTrainer)
gets values, never bin logits. Training code asks for the logits inside `bin_logits(model)`.

Torch only: nothing here imports transformers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

CONFIG_KEY = "critic_value_head"
KIND = "hl_gauss"


@dataclasses.dataclass(frozen=True, slots=True)
class HLGaussSupport:
    num_bins: int
    min_value: float
    max_value: float
    sigma_ratio: float = 0.75

    def __post_init__(self):
        problem = support_problem(self.num_bins, self.min_value, self.max_value, self.sigma_ratio)
        if problem:
            raise ValueError(problem)

    @property
    def bin_width(self) -> float:
        return (self.max_value - self.min_value) / self.num_bins

    @property
    def sigma(self) -> float:
        return self.sigma_ratio * self.bin_width

    def edges(self, device=None) -> torch.Tensor:
        return torch.linspace(self.min_value, self.max_value, self.num_bins + 1, dtype=torch.float32, device=device)

    def centres(self, device=None) -> torch.Tensor:
        edges = self.edges(device)
        return (edges[:-1] + edges[1:]) / 2

    def to_dict(self) -> dict:
        return {"kind": KIND, "num_bins": self.num_bins, "min_value": self.min_value, "max_value": self.max_value,
                "sigma_ratio": self.sigma_ratio}

    @classmethod
    def from_dict(cls, entry: dict, where: str = "config.json") -> "HLGaussSupport":
        if not isinstance(entry, dict) or entry.get("kind") != KIND:
            raise ValueError(f"{where}: {CONFIG_KEY}={entry!r} is not a value head this package knows "
                             f"(expected {{'kind': '{KIND}', 'num_bins', 'min_value', 'max_value', 'sigma_ratio'}})")
        missing = [key for key in ("num_bins", "min_value", "max_value", "sigma_ratio") if key not in entry]
        if missing:
            raise ValueError(f"{where}: {CONFIG_KEY} lacks {', '.join(missing)}")
        return cls(num_bins=int(entry["num_bins"]), min_value=float(entry["min_value"]),
                   max_value=float(entry["max_value"]), sigma_ratio=float(entry["sigma_ratio"]))

    def describe(self) -> str:
        return (f"an HL-Gauss head ({self.num_bins} bins over [{self.min_value:g}, {self.max_value:g}], "
                f"sigma_ratio {self.sigma_ratio:g})")


def support_problem(num_bins, min_value, max_value, sigma_ratio, prefix: str = "") -> str | None:
    """What is wrong with these support settings (keys named with `prefix`), or None."""
    if min_value is None or max_value is None:
        return (f"{prefix}min_value and {prefix}max_value are required with HL-Gauss: set them to the range of "
                f"the returns (e.g. {prefix}min_value=-1.5 {prefix}max_value=1.5)")
    if not (math.isfinite(min_value) and math.isfinite(max_value)) or min_value >= max_value:
        return f"{prefix}min_value={min_value} must be below {prefix}max_value={max_value} (both finite)"
    if num_bins < 2:
        return f"{prefix}num_bins={num_bins} must be >= 2"
    if not sigma_ratio > 0:
        return f"{prefix}sigma_ratio={sigma_ratio} must be > 0 (sigma = sigma_ratio * bin width)"
    return None


def support_of(config) -> HLGaussSupport | None:
    """The HL-Gauss support an HF critic config declares, or None for a scalar critic."""
    entry = getattr(config, CONFIG_KEY, None)
    return None if entry is None else HLGaussSupport.from_dict(entry)


def describe(support: HLGaussSupport | None) -> str:
    return "a scalar head" if support is None else support.describe()


def targets(returns: torch.Tensor, support: HLGaussSupport) -> torch.Tensor:
    """[..., K] float32 HL-Gauss target distributions of `returns` (clamped to the support)."""
    y = returns.float().clamp(support.min_value, support.max_value)[..., None]
    edges = support.edges(returns.device)
    cdf = 0.5 * (1.0 + torch.special.erf((edges - y) / (support.sigma * math.sqrt(2.0))))
    mass = cdf[..., 1:] - cdf[..., :-1]
    return mass / (cdf[..., -1:] - cdf[..., :1])


def expectation(logits: torch.Tensor, support: HLGaussSupport) -> torch.Tensor:
    """[...] float32 values from [..., K] bin logits."""
    return torch.softmax(logits.float(), dim=-1) @ support.centres(logits.device)


def cross_entropy(logits: torch.Tensor, returns: torch.Tensor, support: HLGaussSupport) -> torch.Tensor:
    """[...] per-position cross-entropy between softmax(logits) and the targets of `returns`."""
    return -(targets(returns, support) * torch.log_softmax(logits.float(), dim=-1)).sum(-1)


def head_values(outputs: torch.Tensor, support: HLGaussSupport | None) -> torch.Tensor:
    """[...] float32 values from a head's raw outputs [..., 1] (scalar) or [..., K] (HL-Gauss)."""
    return outputs.squeeze(-1).float() if support is None else expectation(outputs, support)


class HLGaussHead(torch.nn.Linear):
    """Linear(H, K) whose forward returns the expected value [..., 1] (float32); inside
    bin_logits(model) it returns the bin logits [..., K] instead. Parameters as nn.Linear's."""

    def __init__(self, in_features: int, support: HLGaussSupport, bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, support.num_bins, bias=bias, device=device, dtype=dtype)
        self.support = support
        self.emit_bin_logits = False

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, support: HLGaussSupport) -> "HLGaussHead":
        """The same Parameter objects (meta or real) under this class."""
        if linear.out_features != support.num_bins:
            raise ValueError(f"a head of {linear.out_features} outputs cannot hold {support.describe()}")
        head = cls.__new__(cls)
        torch.nn.Module.__init__(head)
        head.in_features, head.out_features = linear.in_features, linear.out_features
        head.weight, head.bias = linear.weight, linear.bias
        head.support, head.emit_bin_logits = support, False
        return head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().forward(hidden)
        return logits if self.emit_bin_logits else expectation(logits, self.support)[..., None]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.support.describe()}"


@contextlib.contextmanager
def bin_logits(model: torch.nn.Module):
    """Inside the block, every HLGaussHead of `model` returns bin logits instead of values."""
    heads = [m for m in model.modules() if isinstance(m, HLGaussHead)]
    for head in heads:
        head.emit_bin_logits = True
    try:
        yield heads
    finally:
        for head in heads:
            head.emit_bin_logits = False


@torch.no_grad()
def from_scalar_head(weight: torch.Tensor, bias: torch.Tensor | None, support: HLGaussSupport
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [K, H], bias [K]) of an HL-Gauss head whose distribution at every token is a Gaussian
    (of the support's sigma) over the bin centres, centred on the scalar head's value v = w.h + b:
    logit_k = -(c_k - v)^2 / (2 sigma^2) = (c_k / sigma^2) v - c_k^2 / (2 sigma^2) + (terms equal
    for every k, which softmax ignores). Linear in v, so it is exactly a linear head. Its expected
    value is v up to the discretisation (and pulled inwards near the support's edges)."""
    centres = support.centres().double()
    scale = centres / support.sigma ** 2
    w = weight.double().reshape(1, -1)
    b = torch.zeros(1, dtype=torch.float64) if bias is None else bias.double().reshape(1)
    return (scale[:, None] * w).float(), (scale * b - centres ** 2 / (2 * support.sigma ** 2)).float()
