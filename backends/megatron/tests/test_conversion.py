"""HF critic -> megatron shards (TP 1/2 x PP 1/2) -> HF reproduces every tensor exactly, for every
supported family; unmapped or missing keys and shape mismatches are errors that list them."""

import pytest
import torch
from transformers import AutoModelForTokenClassification

from critic_adapters.backends.megatron import convert
from critic_adapters.backends.megatron.config import family_traits
from critic_adapters.common.testdata import tiny_config
from critic_adapters.common.tests.helpers import run_pytest

FAMILIES = ("qwen2", "llama", "mistral", "qwen3")


def hf_critic_state(family: str):
    config = tiny_config(family)
    config.num_labels = 1
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_config(config)
    g = torch.Generator().manual_seed(1)
    # Noise on every tensor (norm weights and biases included), so no tensor is trivially equal.
    state = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    return config, state


def layouts(config, tp: int, pp: int):
    per_stage = config.num_hidden_layers // pp
    return {(p, t): convert.Layout(t, tp, p * per_stage, per_stage, p == 0, p == pp - 1)
            for p in range(pp) for t in range(tp)}


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
