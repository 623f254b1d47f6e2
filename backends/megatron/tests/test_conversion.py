"""HF critic -> megatron shards (TP 1/2 x PP 1/2, and EP 1/2/4 for the MoE families) -> HF reproduces
every tensor exactly, for every supported family; unmapped or missing keys and shape mismatches are
errors that list them."""

import pytest
import torch
from transformers import AutoModelForTokenClassification

from critic_adapters.backends.megatron import convert
from critic_adapters.backends.megatron.config import family_traits
from critic_adapters.common.testdata import tiny_config
from critic_adapters.common.tests.helpers import run_pytest

FAMILIES = ("qwen2", "llama", "mistral", "qwen3")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def hf_critic_state(family: str):
    config = tiny_config(family)
    config.num_labels = 1
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_config(config)
    g = torch.Generator().manual_seed(1)
    # Noise on every tensor (norm weights and biases included), so no tensor is trivially equal.
    state = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    return config, state


def layouts(config, tp: int, pp: int, ep: int = 1):
    per_stage = config.num_hidden_layers // pp
    plan = {(p, t, e): convert.Layout(t, tp, p * per_stage, per_stage, p == 0, p == pp - 1, ep_rank=e, ep_size=ep)
            for p in range(pp) for t in range(tp) for e in range(ep)}
    return plan if ep > 1 else {key[:2]: layout for key, layout in plan.items()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_is_exact(family, tp, pp):
    config, state = hf_critic_state(family)
    traits = family_traits(config)
    plan = layouts(config, tp, pp)
    shards = {key: convert.hf_to_mcore(state, config, traits, layout) for key, layout in plan.items()}
    back = convert.mcore_to_hf(shards, plan, config, traits)
    assert set(back) == set(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name
    if tp == 2:  # the shards really differ between tensor ranks
        key = "decoder.layers.0.self_attention.linear_qkv.weight"
        first = shards[(0, 0)][key]
        assert first.shape[0] == (4 + 2 * 2) * 16 // 2 and not torch.equal(first, shards[(0, 1)][key])


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("tp, pp, ep", [(1, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 4), (2, 2, 1)])
def test_moe_round_trip_is_exact(family, tp, pp, ep):
    """Router, routed experts (each from its row of transformers' fused expert tensors, split over
    the expert ranks and then the tensor ranks) and qwen2_moe's gated shared expert."""
    config, state = hf_critic_state(family)
    traits = family_traits(config)
    plan = layouts(config, tp, pp, ep)
    shards = {key: convert.hf_to_mcore(state, config, traits, layout) for key, layout in plan.items()}
    back = convert.mcore_to_hf(shards, plan, config, traits)
    assert set(back) == set(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name
    # Expert 1 of the first layer: gate rows then up rows of transformers' gate_up_proj[1], on the
    # expert rank and local index megatron gives it (experts split evenly, in order).
    gate_up = state["model.layers.0.mlp.experts.gate_up_proj"][1]
    local = 4 // ep
    key = (0, 0, 1 // local) if ep > 1 else (0, 0)
    fc1 = shards[key][f"decoder.layers.0.mlp.experts.local_experts.{1 % local}.linear_fc1.weight"]
    ffn = gate_up.shape[0] // 2
    assert torch.equal(fc1, torch.cat([gate_up[:ffn].chunk(tp)[0], gate_up[ffn:].chunk(tp)[0]]))
    assert torch.equal(shards[key]["decoder.layers.0.mlp.router.weight"], state["model.layers.0.mlp.gate.weight"])
    if family == "qwen2_moe":
        assert torch.equal(shards[key]["decoder.layers.0.mlp.shared_experts.gate_weight"],
                           state["model.layers.0.mlp.shared_expert_gate.weight"])


def test_moe_traits_follow_the_families_routing():
    """mixtral renormalises the top-k weights; qwen does when norm_topk_prob; qwen's mlp_only_layers
    and decoder_sparse_step leave dense layers, whose MLP converts as a dense one."""
    mixtral, qwen3 = tiny_config("mixtral"), tiny_config("qwen3_moe")
    assert family_traits(mixtral).moe.normalize_top_k and family_traits(qwen3).moe.normalize_top_k
    qwen2 = tiny_config("qwen2_moe")
    assert not family_traits(qwen2).moe.normalize_top_k and family_traits(qwen2).moe.shared_ffn_size == 64
    qwen3.mlp_only_layers = [1]
    qwen3.num_labels = 1
    traits = family_traits(qwen3)
    assert traits.moe.moe_layers == (True, False)
    torch.manual_seed(0)
    state = AutoModelForTokenClassification.from_config(qwen3).state_dict()
    assert "model.layers.1.mlp.gate_proj.weight" in state  # transformers builds a dense layer 1 as well
    plan = layouts(qwen3, 1, 1)
    shards = {key: convert.hf_to_mcore(state, qwen3, traits, layout) for key, layout in plan.items()}
    assert "decoder.layers.1.mlp.linear_fc1.weight" in shards[(0, 0)]
    back = convert.mcore_to_hf(shards, plan, qwen3, traits)
    assert all(torch.equal(back[name], tensor) for name, tensor in state.items())


def test_qkv_is_grouped_per_kv_head():
    config, state = hf_critic_state("qwen2")
    traits = family_traits(config)
    fused = convert.hf_to_mcore(state, config, traits, layouts(config, 1, 1)[(0, 0)])[
        "decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (state[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    d = 16  # group 0: its two query heads, then its key head, then its value head
    assert torch.equal(fused[: 2 * d], q[: 2 * d])
    assert torch.equal(fused[2 * d: 3 * d], k[:d])
    assert torch.equal(fused[3 * d: 4 * d], v[:d])
    assert torch.equal(fused[4 * d: 6 * d], q[2 * d: 4 * d])  # group 1 starts with its queries
    # Negative control: a naive [q; k; v] concatenation is not this layout.
    assert not torch.equal(fused, torch.cat([q, k, v]))


def test_unmapped_and_missing_keys_are_listed():
    config, state = hf_critic_state("llama")
    traits = family_traits(config)
    layout = layouts(config, 1, 1)[(0, 0)]
    extra = dict(state, **{"lm_head.weight": torch.zeros(1000, 64)})
    with pytest.raises(ValueError, match=r"unmapped \['lm_head.weight'\]"):
        convert.hf_to_mcore(extra, config, traits, layout)
    missing = {k: v for k, v in state.items() if k != "score.bias"}
    with pytest.raises(ValueError, match=r"missing \['score.bias'\]"):
        convert.hf_to_mcore(missing, config, traits, layout)


def test_shape_mismatch_is_listed():
    config, state = hf_critic_state("qwen2")
    traits = family_traits(config)
    converted = convert.hf_to_mcore(state, config, traits, layouts(config, 1, 1)[(0, 0)])

    class Fake(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for name, tensor in converted.items():
                self.register_buffer(name.replace(".", "_"), tensor)

        def state_dict(self, *args, **kwargs):
            own = dict(converted)
            own["decoder.final_layernorm.weight"] = torch.zeros(32)
            return own

    with pytest.raises(ValueError, match=r"decoder.final_layernorm.weight: model \(32,\) vs converted \(64,\)"):
        convert.load_into(Fake(), converted)


if __name__ == "__main__":
    run_pytest(__file__)
