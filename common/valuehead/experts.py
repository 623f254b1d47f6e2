"""What a mixture-of-experts config says about its experts, in one place for the loader's report,
`inspect` and the benchmarks: how many routed experts, how many each token goes to, the shared
expert, which layers route. Read from the config fields the MoE families use (transformers'
mixtral, qwen2_moe, qwen3_moe, deepseek_v3, ...); None for a dense model.
"""

from __future__ import annotations

import dataclasses

from transformers import PretrainedConfig


@dataclasses.dataclass(frozen=True, slots=True)
class Experts:
    routed: int
    """Routed experts per MoE layer."""
    top_k: int
    """Experts each token is sent to."""
    renormalised: bool | None
    """The top-k routing weights rescaled to sum to 1 (None: the family routes its own way)."""
    shared: str | None
    """The shared expert(s) every token also goes through, described (qwen2_moe, deepseek_v3)."""
    moe_layers: int
    layers: int
    ffn: int = 0
    """Each routed expert's intermediate size."""
    hidden: int = 0

    @property
    def idle_parameters(self) -> int:
        """Routed-expert parameters a token does not go through (SwiGLU experts: 3 * hidden * ffn each,
        routed - top_k per MoE layer): what model FLOPs leave out of the parameter count."""
        return self.moe_layers * (self.routed - self.top_k) * 3 * self.hidden * self.ffn

    def __str__(self) -> str:
        weights = {True: ", renormalised", False: ", not renormalised", None: ""}[self.renormalised]
        text = f"{self.routed} routed, top-{self.top_k}{weights}"
        if self.shared:
            text += f"; {self.shared}"
        return text + f"; MoE in {self.moe_layers} of {self.layers} layers"


def moe_layer_flags(config: PretrainedConfig) -> tuple[bool, ...]:
    """Per layer: does it route (True) or run the family's dense MLP, as transformers builds it."""
    layers = config.num_hidden_layers
    if config.model_type in ("qwen2_moe", "qwen3_moe"):
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    first_dense = getattr(config, "first_k_dense_replace", 0) or 0  # deepseek: the first k layers are dense
    return tuple(i >= first_dense for i in range(layers))


def experts_of(config: PretrainedConfig) -> Experts | None:
    """The experts of a (text) config, or None for a dense model."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    routed = next((getattr(config, key) for key in ("num_local_experts", "num_experts", "n_routed_experts")
                   if getattr(config, key, None)), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not routed or not top_k:
        return None
    if config.model_type == "mixtral":
        renormalised = True
    elif hasattr(config, "norm_topk_prob"):
        renormalised = bool(config.norm_topk_prob)
    else:
        renormalised = None
    shared = None
    if getattr(config, "shared_expert_intermediate_size", None):
        shared = f"a gated shared expert of width {config.shared_expert_intermediate_size}"
    elif getattr(config, "n_shared_experts", None):
        shared = f"{config.n_shared_experts} shared expert(s)"
    ffn = getattr(config, "moe_intermediate_size", None) or config.intermediate_size  # mixtral: intermediate_size
    return Experts(routed=routed, top_k=top_k, renormalised=renormalised, shared=shared,
                   moe_layers=sum(moe_layer_flags(config)), layers=config.num_hidden_layers, ffn=ffn,
                   hidden=config.hidden_size)


def describe_experts(config: PretrainedConfig) -> str | None:
    """The experts in words (the loader's report, `inspect`), None for a dense model."""
    experts = experts_of(config)
    return None if experts is None else str(experts)
