"""HL-Gauss critics (common/learning/hl_gauss.py) on every backend, checked against an independent reference:
plain transformers loading the engine's export (a TokenCls with num_bins labels), the HL-Gauss
cross-entropy written here from its definition (torch.special.ndtr for the Gaussian CDF), AdamW and
clip 1.0 in one process over the whole mini-batch."""

import json

import pytest
import torch
from transformers import AutoModelForTokenClassification

from critic_adapters.common.engine import shift_to_tokens
from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.tests.torchrun import run_torchrun_group, worker_env
from critic_adapters.common.valuehead import compute_values, load_critic, save_critic
from critic_adapters.tests.conformance.worker import rollout
from critic_adapters.tests.hl_gauss_worker import LR, SUPPORT

# name: (backend, processes, tensor-parallel degree)
RUNS = {"fsdp-1": ("fsdp", 1, 1), "fsdp-2": ("fsdp", 2, 1), "veomni-2": ("veomni", 2, 1),
        "megatron-1": ("megatron", 1, 1), "megatron-tp2": ("megatron", 2, 2)}
FIELDS = ("input_ids", "attention_mask", "response_mask", "old_values", "returns")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hl_gauss")
    causal = save_tiny_causal_lm("qwen2", str(root / "causal"))
    return save_critic(load_critic(causal)[0], str(root / "base"))  # a scalar critic: its head seeds the bins


_DONE: dict[str, tuple] = {}


def _run_once(name, base_dir, tmp_path_factory):
    """(data-parallel ranks, workdir, result) of run RUNS[name]: the first call runs every run of the
    same process count in one hl_gauss_worker torchrun, once per module."""
    if name not in _DONE:
        ranks = RUNS[name][1]
        group = [other for other, (_, n, _) in sorted(RUNS.items()) if n == ranks]
        works = run_torchrun_group(ranks, "critic_adapters.tests.hl_gauss_worker", group,
                                   lambda other: (RUNS[other][0], RUNS[other][2]), tmp_path_factory, base_dir,
                                   env=worker_env(PYTHONWARNINGS="ignore"))
        for other in group:
            _DONE[other] = ranks // RUNS[other][2], works[other], torch.load(works[other] / "result.pt")
    return _DONE[name]


@pytest.fixture(scope="module", params=sorted(RUNS))
def run(request, base_dir, tmp_path_factory):
    return _run_once(request.param, base_dir, tmp_path_factory)


def reference_targets(returns: torch.Tensor) -> torch.Tensor:
    """p_k = Phi((e_{k+1} - y) / s) - Phi((e_k - y) / s), normalised over [e_0, e_K], in float64."""
    edges = torch.linspace(SUPPORT.min_value, SUPPORT.max_value, SUPPORT.num_bins + 1, dtype=torch.float64)
    sigma = SUPPORT.sigma_ratio * (SUPPORT.max_value - SUPPORT.min_value) / SUPPORT.num_bins
    y = returns.double().clamp(SUPPORT.min_value, SUPPORT.max_value)[..., None]
    cdf = torch.special.ndtr((edges - y) / sigma)
    return (cdf[..., 1:] - cdf[..., :-1]) / (cdf[..., -1:] - cdf[..., :1])


def reference_values(logits: torch.Tensor) -> torch.Tensor:
    edges = torch.linspace(SUPPORT.min_value, SUPPORT.max_value, SUPPORT.num_bins + 1, dtype=torch.float64)
    centres = (edges[1:] + edges[:-1]) / 2
    return (torch.softmax(logits.double(), -1) * centres).sum(-1)


def plain_logits(model, batch) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # [B, T, num_bins]


def test_values_are_the_exports_expectations_through_plain_transformers_and_our_loader(run):
    _, work, result = run
    batch = rollout(0)
    real = batch.attention_mask.bool()
    plain, info = AutoModelForTokenClassification.from_pretrained(str(work / "export_before"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert plain.config.num_labels == SUPPORT.num_bins
    assert plain.config.critic_value_head == {"kind": "hl_gauss", "num_bins": SUPPORT.num_bins,
                                              "min_value": SUPPORT.min_value, "max_value": SUPPORT.max_value,
                                              "sigma_ratio": SUPPORT.sigma_ratio}
    with torch.no_grad():
        expected = reference_values(plain_logits(plain, {"input_ids": batch.input_ids,
                                                         "attention_mask": batch.attention_mask}))
    assert torch.allclose(result["values_before"][real].double(), expected[real], atol=1e-5)
    for name, values in (("export_before", result["values_before"]), ("export_after", result["values_after"])):
        ours, report = load_critic(str(work / name))  # the loader gives values, never bins
        got = compute_values(ours, batch.input_ids, batch.attention_mask)
        assert report.head == "loaded" and "HL-Gauss" in report.value_head
        assert torch.allclose(got[real], values[real], atol=1e-5), (name, (got[real] - values[real]).abs().max())


def test_one_update_equals_a_single_process_reference_step(run):
    ranks, work, result = run
    model = AutoModelForTokenClassification.from_pretrained(str(work / "export_before"))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    parts = [rollout(rank) for rank in range(ranks)]
    cat = {name: torch.cat([getattr(b, name) for b in parts]) for name in FIELDS}
    logits = shift_to_tokens(plain_logits(model, cat))
    mask = cat["response_mask"].bool()
    cross_entropy = -(reference_targets(cat["returns"]).float() * torch.log_softmax(logits, -1)).sum(-1)
    loss = cross_entropy[mask].sum() / mask.sum()  # token-mean over the whole mini-batch
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    metrics = result["metrics"]
    assert metrics["value_loss"] == pytest.approx(float(loss.detach()), abs=1e-5)
    assert metrics["grad_norm"] == pytest.approx(float(grad_norm), rel=1e-4)
    assert metrics["clip_fraction"] == 0.0
    batch = rollout(0)
    real = batch.attention_mask.bool()
    model.eval()
    with torch.no_grad():
        after = reference_values(plain_logits(model, {"input_ids": batch.input_ids,
                                                      "attention_mask": batch.attention_mask}))
    assert torch.allclose(result["values_after"][real].double(), after[real], atol=2e-4), \
        (result["values_after"][real].double() - after[real]).abs().max()
    assert not torch.allclose(result["values_after"][real], result["values_before"][real], atol=1e-3)  # it learned


def test_a_checkpoint_resumes_bit_identically_and_names_the_head(run):
    _, work, result = run
    (next_metrics, next_values), (resumed_metrics, resumed_values) = result["next"], result["resumed"]
    assert torch.equal(next_values, resumed_values)
    for key in ("value_loss", "grad_norm", "explained_variance"):
        assert next_metrics[key] == resumed_metrics[key], key
    assert result["fingerprint"]["value_head"]["num_bins"] == SUPPORT.num_bins
    meta = json.loads((work / "checkpoint" / "critic_checkpoint.json").read_text())
    assert meta["fingerprint"]["value_head"]["kind"] == "hl_gauss"
    assert result["scalar_error"] is not None and result["scalar_error"].endswith(
        "holds a critic with an HL-Gauss head (21 bins over [-3, 3], sigma_ratio 0.75), but this engine has a scalar "
        "head: resume it with the engine.loss.kind and engine.loss.hl_gauss settings it was trained with")


def test_megatron_tp2_and_the_fsdp_engine_agree(base_dir, tmp_path_factory):
    _, _, megatron = _run_once("megatron-tp2", base_dir, tmp_path_factory)
    _, _, fsdp = _run_once("fsdp-1", base_dir, tmp_path_factory)  # one data-parallel rank each: the same rollout
    real = rollout(0).attention_mask.bool()
    for key in ("values_before", "values_after"):
        assert torch.allclose(megatron[key][real], fsdp[key][real], atol=1e-5), (key, (megatron[key] - fsdp[key])[real].abs().max())
    assert megatron["metrics"]["value_loss"] == pytest.approx(fsdp["metrics"]["value_loss"], abs=1e-5)


if __name__ == "__main__":
    run_pytest(__file__)
