"""Critics as other stacks save them, through every backend's engine, in every environment the suite
has (tests/environments.py: the venv at 2 ranks, and the verl overlay with the older transformers verl
pins at 1 and 2 ranks).

The critics (tests/saved_critic_worker.py checks each):
  - "verl-bf16": tests/testdata/verl-fsdp2-bf16, written by verl 0.9.1's own fsdp2 value-model engine at
    model_dtype=bf16 through its checkpoint manager's hf_model contents (bf16 weights, "dtype": "bfloat16"
    in config.json; tests/verl/verl_worker.py save_hf makes it, test_verl_engine checks verl still
    writes this format);
  - "fp32-labelled-bf16": fp32 weights under "dtype": "bfloat16", as the same save path writes an
    fp32-trained critic with transformers >= 5.12 (its from_config(torch_dtype=bf16) records bf16 in the
    config, then save_pretrained writes the fp32 state dict it is given); made here, with the
    venv's transformers.

The engines compute in float32 (the default engine config): their values must equal load_critic's
and transformers' own AutoModelForTokenClassification.from_pretrained(dtype=float32), whatever dtype
the checkpoint declares. Before transformers 5.12 a critic class built from a config took the
config's dtype for its backbone (common.valuehead.config.build_critic says how): at 2 ranks the fsdp
engine then computed in bf16 (values 2e-3 off), VeOmni failed on a bf16 backbone under an fp32
head, megatron read fp32 weights rounded to bf16 (1e-3 off), and the CLI's convert wrote them in bf16.
"""

import json
import os

import pytest
import torch

from critic_adapters.common.engine.registry import BACKENDS
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.tests.torchrun import run_torchrun
from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.valuehead import load_critic, save_critic
from critic_adapters.tests.environments import ENVIRONMENTS, REPO

VERL_BF16 = os.path.join(REPO, "tests", "testdata", "verl-fsdp2-bf16")
# megatron's usual tolerance (backends/megatron/tests/test_values_parity.py: tensor parallel 2 <= 2e-5).
TOLERANCE = {"megatron": 2e-5}
DEFAULT_TOLERANCE = 1e-5


def fp32_labelled_bf16(root: str) -> str:
    """An fp32 critic saved the way verl's checkpoint manager saves hf_model, with this transformers:
    the model class built from the config in bf16 on meta, then save_pretrained(state_dict=) of the
    fp32 state (float32 safetensors under "dtype": "bfloat16")."""
    from transformers import AutoModelForTokenClassification

    critic, _ = load_critic(save_critic(load_critic(save_tiny_causal_lm("qwen2", f"{root}/causal"))[0],
                                        f"{root}/critic"))
    state = {name: t.detach().clone() for name, t in critic.state_dict().items()}
    with torch.device("meta"):
        shell = AutoModelForTokenClassification.from_config(critic.config, dtype=torch.bfloat16)
    shell.to_empty(device="cpu")
    shell.save_pretrained(f"{root}/saved", state_dict=state)
    # transformers < 5.12 leaves the config's own dtype (float32) in config.json: label it as >= 5.12 does.
    with open(f"{root}/saved/config.json") as f:
        config = json.load(f)
    if config["dtype"] != "bfloat16":
        with open(f"{root}/saved/config.json", "w") as f:
            json.dump(dict(config, dtype="bfloat16"), f, indent=2)
    return f"{root}/saved"


@pytest.fixture(scope="module")
def critics(tmp_path_factory) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("saved"))
    made = {"verl-bf16": VERL_BF16, "fp32-labelled-bf16": fp32_labelled_bf16(root)}
    declared = {name: json.load(open(f"{path}/config.json"))["dtype"] for name, path in made.items()}
    assert declared == {"verl-bf16": "bfloat16", "fp32-labelled-bf16": "bfloat16"}, declared
    return made


# The older transformers (the overlay) at 1 and 2 ranks: where the declared dtype once leaked in; the
# venv's at 2 ranks (its one-rank engines load as load_critic does, which every other test runs).
RUNS = [("venv", 2), ("verl-overlay", 1), ("verl-overlay", 2)]


@pytest.fixture(scope="module", params=RUNS, ids=[f"{env}-{n}" for env, n in RUNS])
def run(request, critics, tmp_path_factory) -> tuple[str, int, dict]:
    environment, processes = request.param
    out = tmp_path_factory.mktemp(f"{environment}-{processes}") / "values.json"
    run_torchrun(processes, "critic_adapters.tests.saved_critic_worker", str(out),
                 *(f"{name}={path}" for name, path in critics.items()),
                 env=ENVIRONMENTS[environment](), timeout=900)
    ranks = [json.loads(open(f"{out}.rank{r}").read()) for r in range(processes)]
    return environment, processes, ranks


@pytest.mark.parametrize("critic", ["verl-bf16", "fp32-labelled-bf16"])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_an_engine_computes_a_saved_critics_values_in_float32(run, critic, backend):
    environment, processes, ranks = run
    tolerance = TOLERANCE.get(backend, DEFAULT_TOLERANCE)
    for rank, result in enumerate(ranks):
        seen = result[critic]
        assert seen["load_critic_vs_transformers"] <= DEFAULT_TOLERANCE, seen
        outcome = seen["backends"][backend]
        # tools/setup.sh installs every backend's library in both environments (another Python runs
        # this file with -k for the backends it holds).
        assert "not_installed" not in outcome, f"{backend} needs {outcome.get('not_installed')} in {environment}"
        assert "error" not in outcome, f"{backend} on {critic}, rank {rank}/{processes}: {outcome['error']}"
        assert outcome["vs_load_critic"] <= tolerance, (environment, processes, rank, outcome)
        assert outcome["vs_transformers"] <= tolerance, (environment, processes, rank, outcome)


@pytest.mark.parametrize("critic", ["verl-bf16", "fp32-labelled-bf16"])
def test_convert_writes_float32_exactly_whatever_the_label(run, critic):
    _, _, ranks = run
    converted = ranks[0][critic]["convert"]
    assert converted == {"dtypes": ["torch.float32"], "difference": 0.0}, converted


if __name__ == "__main__":
    run_pytest(__file__)
