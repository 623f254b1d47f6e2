"""The VeOmni vision-language critic (vision_critic.py) against transformers' generic critic of the same
family with the same weights, in one process on CPU fp32: the same tensor names, the same rope index,
and the same logits (<= 1e-5) for one sequence with an image, two packed in one row (positions per
sequence, concatenated), padded rows with an attention mask (2 rows, and 3: VeOmni's [*, 3, N]
reading), a video, an HL-Gauss head; the probe's twin; the FSDP units; the layouts refused."""

import contextlib

import pytest
import torch

from critic_adapters.backends.veomni import parallelize, value_model, vision_critic
from critic_adapters.backends.veomni.quiet import veomni_output
from critic_adapters.common.engine.config import EngineConfig, ParallelConfig
from critic_adapters.common.learning.hl_gauss import HLGaussSupport, bin_logits
from critic_adapters.common.parallel import packed_attention
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.testdata import VLM_FAMILIES, tiny_config
from critic_adapters.common.valuehead.config import critic_class, critic_config, install_value_head

TOL = 1e-5


def build_pair(family: str, attn: str = "sdpa", value_head: HLGaussSupport | None = None):
    """(VeOmni's critic, transformers' critic), the same random weights (a non-zero head), eval mode,
    each with its value head installed as the engine does (after check_class)."""
    config = critic_config(tiny_config(family), value_head=value_head)
    torch.manual_seed(0)
    reference = critic_class(config)._from_config(config, attn_implementation="sdpa").eval()
    torch.nn.init.normal_(reference.score.weight, std=0.5)
    with veomni_output():
        critic = value_model.build_critic(config, weights_path=None, dtype="float32", attn_implementation=attn,
                                          init_device="cpu")
    value_model.check_class(critic, config)
    critic = install_value_head(critic)
    critic.load_state_dict(install_value_head(reference).state_dict())
    return critic.eval(), reference


def sequence(config, grids, *, before: int, after: int, seed: int, video: bool = False):
    """(ids [L], media kwargs): text, each grid as vision_start + placeholders + vision_end, text."""
    g = torch.Generator().manual_seed(seed)
    vision = config.vision_config
    token = config.video_token_id if video else config.image_token_id
    # Qwen3-VL's processor writes a video frame by frame, each in its own vision_start/end block.
    blocks = [(1, h, w) for t, h, w in grids for _ in range(t)] if video and config.model_type == "qwen3_vl" else grids
    ids = [torch.randint(3, 900, (before,), generator=g)]
    for t, h, w in blocks:
        ids.append(torch.tensor([config.vision_start_token_id] + [token] * (t * h * w // vision.spatial_merge_size ** 2)
                                + [config.vision_end_token_id]))
    ids.append(torch.randint(3, 900, (after,), generator=g))
    patches = sum(t * h * w for t, h, w in grids)
    width = 3 * vision.temporal_patch_size * vision.patch_size ** 2
    pixels, grid = torch.randn(patches, width, generator=g), torch.tensor(grids)
    media = {"pixel_values_videos": pixels, "video_grid_thw": grid} if video else {"pixel_values": pixels,
                                                                                  "image_grid_thw": grid}
    if video and config.model_type == "qwen2_5_vl":
        media["second_per_grid_ts"] = torch.ones(len(grids))
    return torch.cat(ids), media


def token_types(config, ids):
    return (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()


def alone(reference, ids, media) -> torch.Tensor:
    """[L] values of one sequence through transformers' critic, its rope computed by transformers."""
    with torch.no_grad():
        return reference(input_ids=ids[None], mm_token_type_ids=token_types(reference.config, ids[None]),
                         use_cache=False, **media).logits[0, :, 0]


def positions(reference, ids, media) -> torch.Tensor:
    """[4, L]: text positions, then transformers' get_rope_index t/h/w of the sequence alone."""
    grids = {k: v for k, v in media.items() if k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")}
    rope, _ = reference.model.get_rope_index(ids[None], token_types(reference.config, ids[None]), **grids)
    return torch.cat([torch.arange(ids.numel())[None], rope[:, 0]])


def joined(*medias) -> dict:
    return {key: torch.cat([m[key] for m in medias]) for key in medias[0]}


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def pair(request):
    return request.param, *build_pair(request.param)


def test_the_tensors_are_transformers_critics_by_name(pair):
    _, critic, reference = pair
    assert list(critic.state_dict()) == list(reference.state_dict())
    assert {"score.weight", "score.bias"} <= set(critic.state_dict())
    # Non-persistent buffers too: the engine fills every tensor of the tree by name.
    assert sorted(n for n, _ in critic.named_buffers()) == sorted(n for n, _ in reference.named_buffers())
    assert type(critic).__name__ == type(reference).__name__
    assert type(critic.model).__module__.startswith("veomni.")  # VeOmni's backbone, not transformers'
    value_model.check_class(critic, reference.config)


def test_the_rope_index_is_transformers(pair):
    _, critic, reference = pair
    config = reference.config
    a, media_a = sequence(config, [(1, 4, 4), (1, 2, 4)], before=3, after=2, seed=1)
    b, media_b = sequence(config, [(2, 4, 4)], before=2, after=3, seed=2, video=True)
    for ids, media in ((a, media_a), (b, media_b)):
        kwargs = {k: v for k, v in media.items() if "grid" in k or k == "second_per_grid_ts"}
        types = token_types(config, ids[None])
        mask = torch.ones(1, ids.numel() + 2, dtype=torch.long)
        mask[0, :2] = 0  # left padding
        padded_ids = torch.cat([torch.zeros(2, dtype=torch.long), ids])[None]
        for call_ids, call_types, call_mask in ((ids[None], types, None),
                                                (padded_ids, token_types(config, padded_ids), mask)):
            got = critic.model.get_rope_index(call_ids, call_types, attention_mask=call_mask, **kwargs)
            want = reference.model.get_rope_index(call_ids, call_types, attention_mask=call_mask, **kwargs)
            assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_one_sequence_with_an_image(pair):
    _, critic, reference = pair
    ids, media = sequence(reference.config, [(1, 4, 4)], before=2, after=3, seed=3)
    with torch.no_grad():
        got = critic(input_ids=ids[None], position_ids=positions(reference, ids, media)[:, None],
                     use_cache=False, **media).logits
    assert got.shape == (1, ids.numel(), 1)
    diff = float((got[0, :, 0] - alone(reference, ids, media)).abs().max())
    assert diff <= TOL, diff


def test_one_sequence_with_a_video(pair):
    _, critic, reference = pair
    ids, media = sequence(reference.config, [(2, 4, 4)], before=2, after=3, seed=4, video=True)
    with torch.no_grad():
        got = critic(input_ids=ids[None], position_ids=positions(reference, ids, media)[:, None],
                     use_cache=False, **media).logits
    diff = float((got[0, :, 0] - alone(reference, ids, media)).abs().max())
    assert diff <= TOL, diff


@pytest.mark.parametrize("attn", ["sdpa", packed_attention.ATTENTION_NAME])
def test_two_sequences_packed_in_one_row(pair, attn):
    """The engine's packed layout: [4, 1, N] positions, each sequence's own, concatenated; with our packed
    attention (the engine's choice on CPU) the text layers take it and the vision tower stays on sdpa."""
    family, critic, reference = pair
    if attn != "sdpa":
        packed_attention.register()
        critic, _ = build_pair(family, attn)
    config = reference.config
    a, media_a = sequence(config, [(1, 4, 4)], before=2, after=3, seed=5)
    b, media_b = sequence(config, [(1, 4, 6), (1, 2, 2)], before=1, after=2, seed=6)
    row = torch.cat([positions(reference, a, media_a), positions(reference, b, media_b)], dim=1)[:, None]
    bounds = packed_attention.sequence_bounds(row[0]) if attn != "sdpa" else contextlib.nullcontext()
    with torch.no_grad(), bounds:
        got = critic(input_ids=torch.cat([a, b])[None], attention_mask=None, position_ids=row, use_cache=False,
                     **joined(media_a, media_b)).logits[0, :, 0]
    want = torch.cat([alone(reference, a, media_a), alone(reference, b, media_b)])
    diff = float((got - want).abs().max())
    assert diff <= TOL, diff


@pytest.mark.parametrize("rows", [2, 3])
def test_padded_rows_with_an_attention_mask(pair, rows):
    """Right- and left-padded rows, [4, B, N] positions (0 on padding); a text-only row among 3. Three rows
    take vision_critic's spare fourth row (VeOmni would transpose [4, 3, N] positions)."""
    _, critic, reference = pair
    config = reference.config
    seqs = [sequence(config, [(1, 4, 4)], before=2, after=3, seed=7),
            sequence(config, [(1, 2, 4), (1, 4, 4)], before=4, after=5, seed=8)]
    if rows == 3:
        seqs.append((torch.randint(3, 900, (6,), generator=torch.Generator().manual_seed(9)), {}))
    width = max(ids.numel() for ids, _ in seqs)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    pos = torch.zeros(4, rows, width, dtype=torch.long)
    for index, (seq, media) in enumerate(seqs):
        span = slice(width - seq.numel(), width) if index == 0 else slice(0, seq.numel())  # row 0 left-padded
        ids[index, span], mask[index, span] = seq, 1
        pos[:, index, span] = positions(reference, seq, media) if media else torch.arange(seq.numel())
    with torch.no_grad():
        got = critic(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                     **joined(*[media for _, media in seqs if media])).logits[..., 0]
    assert got.shape == (rows, width)
    for index, (seq, media) in enumerate(seqs):
        want = alone(reference, seq, media) if media else reference(input_ids=seq[None]).logits[0, :, 0].detach()
        diff = float((got[index][mask[index].bool()] - want).abs().max())
        assert diff <= TOL, (index, diff)


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_an_hl_gauss_head(family):
    """The head install_value_head makes of an HL-Gauss config: values and bin logits as transformers'."""
    critic, reference = build_pair(family, value_head=HLGaussSupport(num_bins=5, min_value=-2.0, max_value=2.0))
    ids, media = sequence(reference.config, [(1, 4, 4)], before=2, after=3, seed=10)
    kwargs = dict(input_ids=ids[None], use_cache=False, **media)
    with torch.no_grad():
        for context, labels in ((contextlib.nullcontext, 1), (bin_logits, 5)):
            with context(critic), context(reference):
                got = critic(position_ids=positions(reference, ids, media)[:, None], **kwargs).logits
                want = reference(mm_token_type_ids=token_types(reference.config, ids[None]), **kwargs).logits
            assert got.shape == (1, ids.numel(), labels)
            diff = float((got - want).abs().max())
            assert diff <= TOL, (labels, diff)


def test_the_probes_twin_is_a_small_valid_vision_critic(pair):
    family, critic, reference = pair
    twin_config = value_model.probe_config(reference.config)
    assert twin_config.vision_config.depth == 1 and reference.config.vision_config.depth >= 1
    assert twin_config.vision_config.hidden_size == reference.config.vision_config.hidden_size
    with veomni_output():
        twin = value_model.build_critic(twin_config, weights_path=None, dtype="float32", attn_implementation="sdpa",
                                        init_device="cpu")
    value_model.check_class(twin, twin_config)
    value_model.check_probe_output(twin, twin_config, torch.device("cpu"))
    # The tower runs on an image as the critic's would (what VeOmni's dummy pass does under FSDP).
    with torch.no_grad():
        assert twin.model.visual.dummy_forward().pooler_output.isfinite().all()


def test_the_vision_tower_and_its_blocks_are_fsdp_units(pair):
    _, critic, _ = pair
    units = parallelize.fsdp_units(critic)
    assert type(critic.model.visual).__name__ in units
    assert {type(block).__name__ for block in critic.model.visual.blocks} <= set(units)
    assert {type(layer).__name__ for layer in critic.model.language_model.layers} <= set(units)


def test_the_layouts_it_cannot_run_are_refused(monkeypatch):
    config = critic_config(tiny_config("qwen2_vl"))
    with pytest.raises(ValueError, match="VeOmni's model runs its vision tower in every forward.*use backend=fsdp"):
        value_model.check_layout(config, EngineConfig(parallel=ParallelConfig(ulysses=2)), 2)
    monkeypatch.setenv("MODELING_BACKEND", "hf")
    with pytest.raises(ValueError, match="unset MODELING_BACKEND"):
        value_model.check_family_registered(config)
    monkeypatch.delenv("MODELING_BACKEND")
    value_model.check_layout(config, EngineConfig(), 2)
    assert set(VLM_FAMILIES) <= set(vision_critic.BACKBONES) <= set(value_model.VEOMNI_FAMILIES)


if __name__ == "__main__":
    run_pytest(__file__)
