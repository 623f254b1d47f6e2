"""Vision-language critics loaded from what stacks write, with their images: a base
*ForConditionalGeneration checkpoint (fresh head) and trl's value head over one (trl's own
save_pretrained; qwen2_vl / qwen2_5_vl keep transformers' legacy key names there), each equal to
the original model's forward with the same images; the rows' images checked against their
placeholders by row; the vision tower's transforms (freeze_vision, LoRA's targets)."""

import pytest
import torch
from transformers import AutoModelForImageTextToText

from critic_adapters.common.engine.config import LoRAConfig
from critic_adapters.common.engine.lora import lora_transform
from critic_adapters.common.engine.transforms import apply_transforms
from critic_adapters.common.testdata import VLM_FAMILIES, save_tiny_causal_lm, tiny_causal_lm, tiny_config
from critic_adapters.common.testdata.vision import vision_batch
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.tests import checkpoint_builders
from critic_adapters.common.valuehead import compute_values, load_critic
from critic_adapters.common.valuehead.config import critic_head
from critic_adapters.common.valuehead.multimodal import RowError, check_rows, token_types, vision_tower

LAYOUT = [[(1, 4, 4)], [], [(1, 2, 4), (1, 4, 4)]]


def _alone(forward, ids, mask, images, config):
    """forward(ids [1, L], **image kwargs) -> [L] for each row alone, as the original model is called."""
    out = torch.zeros(ids.shape)
    with torch.no_grad():
        for row in range(ids.shape[0]):
            valid = mask[row].bool()
            one = ids[row][valid][None]
            kwargs = dict(images[row], mm_token_type_ids=token_types(config, one)) if images[row] else {}
            out[row, valid] = forward(one, kwargs)
    return out


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_a_base_vlm_checkpoint_loads_as_a_critic_that_sees_the_images(tmp_path, family):
    path = save_tiny_causal_lm(family, str(tmp_path / family))
    critic, report = load_critic(path)
    assert report.head == "initialized" and not hasattr(critic, "lm_head")
    ids, mask, images = vision_batch(tiny_config(family), LAYOUT, seed=1, left=(1,))
    values = compute_values(critic, ids, mask, multi_modal_inputs=images)
    backbone = AutoModelForImageTextToText.from_pretrained(path).model.eval()
    head = critic_head(critic)
    expected = _alone(lambda one, kw: (backbone(input_ids=one, use_cache=False, **kw).last_hidden_state[0]
                                       @ head.weight.T + head.bias)[:, 0], ids, mask, images, backbone.config)
    valid = mask.bool()
    assert (values - expected)[valid].abs().max() < 1e-5
    zeroed = [row and dict(row, pixel_values=torch.zeros_like(row["pixel_values"])) for row in images]
    blind = compute_values(critic, ids, mask, multi_modal_inputs=zeroed)  # the same tokens, other pixels
    assert (values - blind)[0].abs().max() > 1e-4 and torch.allclose(values[1], blind[1], atol=1e-6)
    # Without any images the placeholders are refused by row, never computed blind (issue 49).
    with pytest.raises(ValueError, match=r"row 0: input_ids hold 4 image placeholder.*no row was given multi_modal"):
        compute_values(critic, ids, mask)
    assert torch.allclose(compute_values(critic, ids[1:2], mask[1:2]), values[1:2], atol=1e-6)  # a text row alone


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_trls_value_head_over_a_vlm_loads_with_its_head_and_equals_trls_forward(tmp_path, family):
    cls = checkpoint_builders.trl_class_or_skip()
    base = tiny_causal_lm(family)
    wrapper = cls.from_pretrained(base, summary_dropout_prob=0.0)
    torch.manual_seed(3)
    torch.nn.init.normal_(wrapper.v_head.summary.weight)
    wrapper.eval()
    wrapper.save_pretrained(str(tmp_path / "trl"))
    critic, report = load_critic(str(tmp_path / "trl"))
    assert report.format == "trl-value-head" and report.head == "loaded"
    ids, mask, images = vision_batch(tiny_config(family), LAYOUT, seed=2)
    values = compute_values(critic, ids, mask, multi_modal_inputs=images)
    expected = _alone(lambda one, kw: wrapper(input_ids=one, **kw)[2][0], ids, mask, images, base.config)
    assert (values - expected)[mask.bool()].abs().max() < 1e-5


def test_images_that_do_not_match_their_placeholders_are_refused_by_row():
    config = tiny_config("qwen2_vl")
    ids, mask, images = vision_batch(config, LAYOUT, seed=0)
    check_rows(config, ids, mask, tuple(row or {} for row in images))  # as written: fine
    swapped = (images[2], {}, images[0])  # row 0's placeholders are 4, row 2's grids make 4 + 2
    with pytest.raises(ValueError, match=r"row 0: input_ids hold 4 image placeholder token\(s\).*makes 6"):
        check_rows(config, ids, mask, swapped)
    with pytest.raises(ValueError, match="row 0: multi_modal_inputs has image_grid_thw without pixel_values"):
        check_rows(config, ids, mask, ({"image_grid_thw": images[0]["image_grid_thw"]}, {}, images[2]))
    with pytest.raises(ValueError, match=r"row 2: input_ids hold 6 image placeholder token\(s\).*no pixel_values"):
        check_rows(config, ids, mask, (images[0], {}, {}))
    short = dict(images[0], pixel_values=images[0]["pixel_values"][:-1])
    with pytest.raises(ValueError, match="row 0: pixel_values has 15 patch rows"):
        check_rows(config, ids, mask, (short, {}, images[2]))
    with pytest.raises(ValueError, match="text-only and cannot see them"):
        check_rows(tiny_config("qwen2"), ids, mask, tuple(row or {} for row in images))
    # Dimensions the processor config fixes (issue 49): the grid's h and w against the merge size, the
    # pixel rows' width, positive entries; one video timing per video.
    odd = dict(images[0], image_grid_thw=torch.tensor([[1, 16, 1]]))  # 16 patches and 4 tokens, as [1, 4, 4]
    with pytest.raises(ValueError, match=r"row 0: image_grid_thw has an entry \[1, 16, 1\]: h and w must be "
                                         r"multiples of this critic's spatial_merge_size 2"):
        check_rows(config, ids, mask, (odd, {}, images[2]))
    narrow = dict(images[0], pixel_values=images[0]["pixel_values"][:, :-1])
    with pytest.raises(ValueError, match=r"row 0: pixel_values has shape \(16, 1175\); this critic's processor "
                                         r"makes rows of 1176 values"):
        check_rows(config, ids, mask, (narrow, {}, images[2]))
    with pytest.raises(RowError) as refused:
        check_rows(config, ids, mask, (dict(images[0], image_grid_thw=torch.tensor([[0, 4, 4]])), {}, images[2]))
    assert str(refused.value.in_rows([7, 8, 9])).startswith("row 7: image_grid_thw has an entry [0, 4, 4]")
    # No images for any row: placeholders refused by row; a text row passes.
    with pytest.raises(ValueError, match=r"row 0: input_ids hold 4 image placeholder token\(s\).*no row was given"):
        check_rows(config, ids, mask, None)
    check_rows(config, ids[1:2], mask[1:2], None)


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_freeze_vision_and_lora_leave_the_vision_tower_alone(tmp_path, family):
    path = save_tiny_causal_lm(family, str(tmp_path / family))
    critic, _ = load_critic(path)
    apply_transforms(critic, ["freeze_vision"])
    tower = {id(p) for p in vision_tower(critic).parameters()}
    assert tower and all(not p.requires_grad for p in vision_tower(critic).parameters())
    assert all(p.requires_grad for p in critic.parameters() if id(p) not in tower)
    # LoRA's default targets are the language model's projections only (Qwen2.5-VL's vision MLP has
    # gate/up/down_proj too); a target only the vision tower has is refused by name.
    critic, _ = load_critic(path)
    apply_transforms(critic, [lora_transform(LoRAConfig(rank=2))])
    adapted = [name for name, _ in critic.named_parameters() if ".lora_A." in name]
    assert adapted and not [name for name in adapted if ".visual." in name]
    vision_only = {"qwen2_vl": "qkv", "qwen2_5_vl": "qkv", "qwen3_vl": "linear_fc1"}[family]
    critic, _ = load_critic(path)
    with pytest.raises(ValueError, match=rf"\['{vision_only}'\], which exist only in the vision tower"):
        apply_transforms(critic, [lora_transform(LoRAConfig(rank=2, target_modules=["q_proj", vision_only]))])


def test_freeze_vision_on_a_text_critic_is_refused_by_name(tmp_path):
    critic, _ = load_critic(save_tiny_causal_lm("qwen2", str(tmp_path / "qwen2")))
    with pytest.raises(ValueError, match="freeze_vision, but .* has no vision tower"):
        apply_transforms(critic, ["freeze_vision"])


if __name__ == "__main__":
    run_pytest(__file__)
