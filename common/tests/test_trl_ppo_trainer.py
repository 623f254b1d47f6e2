"""A critic from load_critic is usable, unchanged, as the value_model of trl 1.12's own PPOTrainer.

trl's PPO reads values as `value_model.score(backbone(...).hidden_states[-1])` (PolicyAndValueWrapper
in training, trl.experimental.utils.get_reward in rollouts), with the backbone found through
`base_model_prefix`. Families whose token-classification head is named `classifier` (gpt_neox; also
gpt2, bloom, falcon) used to fail there with AttributeError: no attribute 'score'. For a qwen2 and
a gpt_neox critic this runs 2 real PPO updates on CPU (tiny policy, reference, reward model and an
in-memory tokenizer; nothing downloaded) and checks that:
  - the critic trained: its head and its backbone weights changed;
  - common.valuehead.compute_values equals trl's own value path (get_reward) on the same ids;
  - the critic's state_dict holds the head once, under its own name (a `score` alias adds no keys).
The same holds for an HL-Gauss qwen2 critic: trl's value path reads values from its head, never bins.
"""

import copy
import warnings

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # trl.experimental warns on every import
    # trl 0.27 to 1.12 has PPO; trl >= 1.13 removed it (trl #7020), and trl is optional
    pytest.importorskip("trl.experimental.ppo", reason="needs trl's PPOTrainer: trl 0.27 to 1.12 (trl >= 1.13 "
                                                       "removed PPO), which this environment lacks")
from datasets import Dataset  # noqa: E402  (trl's dependency)
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

from critic_adapters.common.learning.hl_gauss import HLGaussSupport
from critic_adapters.common.testdata import save_tiny_causal_lm, tiny_causal_lm, tiny_config
from critic_adapters.common.tests.helpers import VOCAB, assert_close_on_mask, padded_batch, run_pytest
from critic_adapters.common.valuehead import compute_values, load_critic

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # trl.experimental warns on every import
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.utils import get_reward

PAD, BOS, EOS = 0, 1, 2  # as in common/testdata/configs/*.json
PROMPT_LEN = 6
RESPONSE_LEN = 8
BATCH = 2
PPO_UPDATES = 2
# The critic's own head attribute per family: the only head keys its state_dict may hold.
HEADS = {"qwen2": "score", "gpt_neox": "classifier"}
# An HL-Gauss critic (common/learning/hl_gauss.py): trl reads its head's output, which is the values.
HL_GAUSS = HLGaussSupport(num_bins=21, min_value=-1.0, max_value=3.0)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over VOCAB made-up tokens, built in memory; ids match the tiny configs."""
    vocab = {"<pad>": PAD, "<bos>": BOS, "<eos>": EOS, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, VOCAB)})
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")


def prompt_dataset(rows: int) -> Dataset:
    """Equal-length prompts of ordinary (non-special) token ids, so no prompt needs padding."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(4, VOCAB, (rows, PROMPT_LEN), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist()})


def tiny_reward_model() -> torch.nn.Module:
    config = tiny_config("qwen2")
    config.num_labels = 1
    torch.manual_seed(3)
    return AutoModelForSequenceClassification.from_config(config)


def ppo_config(output_dir: str) -> PPOConfig:
    """trl's PPOConfig for exactly PPO_UPDATES updates of BATCH rollouts, one PPO epoch each, fp32 on CPU."""
    return PPOConfig(
        output_dir=output_dir,
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        learning_rate=1e-3,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        num_ppo_epochs=1,
        total_episodes=PPO_UPDATES * BATCH,
        local_rollout_forward_batch_size=BATCH,
        response_length=RESPONSE_LEN,
        num_sample_generations=0,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )


def assert_no_aliased_tensors(model: torch.nn.Module) -> None:
    """Every state_dict entry is its own tensor: no weight is saved twice under another name."""
    by_ptr: dict[int, list[str]] = {}
    for key, tensor in model.state_dict().items():
        by_ptr.setdefault(tensor.data_ptr(), []).append(key)
    shared = [keys for keys in by_ptr.values() if len(keys) > 1]
    assert not shared, f"{type(model).__name__} saves tensors under several names: {shared}"


def changed(before: dict, after: dict, prefix: str) -> list[str]:
    return [k for k in before if k.startswith(prefix) and not torch.equal(before[k], after[k])]


# trl logs the variance of a single-element stats tensor (one epoch, one minibatch): harmless here.
@pytest.mark.filterwarnings("ignore:var\\(\\)")
@pytest.mark.parametrize("family, value_head", [(family, None) for family in HEADS] + [("qwen2", HL_GAUSS)],
                         ids=[*HEADS, "qwen2-hl_gauss"])
def test_ppo_trainer_trains_critic(family, value_head, tmp_path):
    torch.manual_seed(0)
    critic, report = load_critic(save_tiny_causal_lm(family, str(tmp_path / "critic"), seed=1), value_head=value_head)
    head = HEADS[family]
    assert (critic.config.num_labels == 21) == (value_head is not None), report
    backbone = critic.base_model_prefix
    keys = list(critic.state_dict())
    assert_no_aliased_tensors(critic)
    assert [k for k in keys if k.split(".")[0] in ("score", "classifier")] == [f"{head}.weight", f"{head}.bias"], (
        f"{report.critic_class} saves its head under more than one name: {keys}")
    before = copy.deepcopy(critic.state_dict())

    trainer = PPOTrainer(
        args=ppo_config(str(tmp_path / "out")),
        processing_class=tiny_tokenizer(),
        model=tiny_causal_lm("qwen2", seed=0),
        ref_model=tiny_causal_lm("qwen2", seed=0),
        reward_model=tiny_reward_model(),
        train_dataset=prompt_dataset(PPO_UPDATES * BATCH),
        value_model=critic,
    )
    trainer.train()
    assert trainer.state.global_step == PPO_UPDATES

    after = critic.state_dict()
    assert list(after) == keys, "training changed the critic's keys"
    assert changed(before, after, f"{head}."), f"PPO did not update the critic's head {head}"
    assert changed(before, after, f"{backbone}.layers.") or changed(before, after, f"{backbone}.embed"), (
        f"PPO did not update the critic's backbone ({backbone}.*)")

    critic.eval()
    ids, mask = padded_batch(seed=2, length=PROMPT_LEN + RESPONSE_LEN)  # right-padded with PAD
    with torch.no_grad():
        ours = compute_values(critic, ids, mask)
        trl_values, _, _ = get_reward(critic, ids, PAD, PROMPT_LEN)
    assert trl_values.shape == (*ids.shape, 1)
    assert float(ours[mask.bool()].abs().max()) > 0, "the critic's values are all zero"
    assert_close_on_mask(ours, trl_values.squeeze(-1).float(), mask, atol=1e-5,
                         what=f"{family}: compute_values vs trl get_reward")


if __name__ == "__main__":
    run_pytest(__file__)
