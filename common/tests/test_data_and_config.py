"""Rollout reading/validation, GAE returns, config loading, LR schedules, the embedded data set."""

import json
import math
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from critic_adapters.common.engine.config import OptimConfig, flat_keys, load_train_config, TrainConfig
from critic_adapters.common.learning.data import gae_returns, load_rollouts, make_default_records, validate_records
from critic_adapters.common.engine.schedule import lr_multiplier
from critic_adapters.common.tests.helpers import run_pytest


def test_gae_matches_hand_computation():
    # One row: prompt token, then response tokens with rewards r and value predictions v.
    rewards = torch.tensor([[0.0, 1.0, 0.0, 2.0]])
    values = torch.tensor([[0.0, 0.5, 1.0, 1.5]])
    mask = torch.tensor([[0, 1, 1, 1]])
    gamma, lam = 0.9, 0.8
    r, v = [1.0, 0.0, 2.0], [0.5, 1.0, 1.5]
    deltas = [r[0] + gamma * v[1] - v[0], r[1] + gamma * v[2] - v[1], r[2] - v[2]]
    a2 = deltas[2]
    a1 = deltas[1] + gamma * lam * a2
    a0 = deltas[0] + gamma * lam * a1
    expected = [0.0, a0 + v[0], a1 + v[1], a2 + v[2]]
    assert gae_returns(rewards, values, mask, gamma, lam)[0].tolist() == pytest.approx(expected, rel=1e-6)
    # gamma = lambda = 1: reward-to-go, whatever the values.
    assert gae_returns(rewards, values, mask, 1.0, 1.0)[0].tolist() == pytest.approx([0.0, 3.0, 2.0, 2.0])


def test_gae_skips_non_response_tokens_between_turns():
    rewards = torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    mask = torch.tensor([[0, 1, 0, 1]])  # token 2 is tool output: not part of the trajectory
    out = gae_returns(rewards, torch.ones(1, 4), mask, 0.5, 0.0)  # one-step TD: the next response token's value
    assert out[0].tolist() == [0.0, 1.5, 0.0, 1.0]
    # A reward on it was dropped once (issue 42); it is refused now (common/tests/test_gae.py has the rest).
    with pytest.raises(ValueError, match="row 0 has reward 5.0 at position 2, outside response_mask"):
        gae_returns(torch.tensor([[0.0, 1.0, 5.0, 1.0]]), torch.zeros(1, 4), mask, 1.0, 1.0)


def test_parquet_and_jsonl_read_the_same(tmp_path):
    records = make_default_records(6, seed=3)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "r.parquet")
    with open(tmp_path / "r.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    a, b = load_rollouts(str(tmp_path / "r.parquet"), 1000), load_rollouts(str(tmp_path / "r.jsonl"), 1000)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.rewards, b.rewards)
    assert a.returns is None and a.old_values is None
    assert a.attention_mask.sum(dim=1).tolist() == [len(r["input_ids"]) for r in records]


def test_multi_turn_fields_read_the_same_from_parquet_and_jsonl(tmp_path):
    """Issue 42: turn_ids, value_mask and truncated (a bool column) through both formats alike."""
    from critic_adapters.common.learning.multi_turn import make_multi_turn_records

    records = make_multi_turn_records(24, seed=5)
    for record in records:
        record["value_mask"] = [int(m and t == 0) for m, t in zip(record["response_mask"], record["turn_ids"])]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "r.parquet")
    with open(tmp_path / "r.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    kwargs = {"off_mask_rewards": "previous", "timestep_unit": "turn"}
    a = load_rollouts(str(tmp_path / "r.parquet"), 1000, **kwargs)
    b = load_rollouts(str(tmp_path / "r.jsonl"), 1000, **kwargs)
    for name in ("input_ids", "rewards", "value_mask", "turn_ids", "truncated"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.truncated.dtype == torch.bool and a.truncated.tolist() == [r["truncated"] for r in records]
    assert int((a.turn_ids[a.attention_mask == 0] != -1).sum()) == 0  # padding is off the response
    assert torch.equal(a.loss_mask, a.value_mask) and int(a.value_mask.sum()) < int(a.response_mask.sum())


@pytest.mark.parametrize("edit,message", [
    (lambda r: r.update(returns=r["rewards"]), "both 'returns' and 'rewards'"),
    (lambda r: r["response_mask"].__setitem__(0, 1), "response_mask[0] is 1"),
    (lambda r: r["response_mask"].__setitem__(4, 2), "only 0 and 1"),
    (lambda r: r.update(input_ids=[]), "empty input_ids"),
])
def test_validation_messages(edit, message):
    records = make_default_records(3)
    edit(records[0])
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_records(records, 1000, "test")


def test_embedded_rollouts_are_deterministic_and_learnable():
    a, b = make_default_records(64, seed=0), make_default_records(64, seed=0)
    assert a == b
    # The return is mostly set by the task token (position 1): its share of the variance is large.
    finals = torch.tensor([r["rewards"][-1] for r in a])
    tasks = torch.tensor([r["input_ids"][1] for r in a])
    within = sum(float(finals[tasks == t].var(unbiased=False)) * int((tasks == t).sum()) for t in tasks.unique())
    assert within / len(a) < 0.1 * float(finals.var(unbiased=False))


def test_config_overrides_and_every_key_documented():
    config = load_train_config([], ["engine.optim.lr=3e-4", "data.gamma=0.99", "engine.loss.clip_range=null"])
    assert config.engine.optim.lr == 3e-4 and config.data.gamma == 0.99 and config.engine.loss.clip_range is None
    assert "engine.batching.micro_batch_tokens" in flat_keys(TrainConfig)
    with pytest.raises(ValueError, match="did you mean engine.batching.packing"):
        load_train_config([], ["engine.batching.packin=false"])
    with pytest.raises(ValueError, match="key=value"):
        load_train_config([], ["engine.optim.lr"])
    with pytest.raises(ValueError, match="mixed_precision='fp8'"):
        load_train_config([], ["engine.mixed_precision=fp8"])



@pytest.mark.parametrize("override, message", [
    ("engine.optim.lr=-1", "engine.optim.lr=-1.0 must be > 0"),  # the key as the user writes it
    ("engine.loss.agg_mode=mean", "engine.loss.agg_mode='mean'"),
    ("engine.lora.target_modules=[q_proj,v_proj]", "engine.lora.target_modules=['q_proj', 'v_proj'] set, but "
                                                   "engine.lora.rank=0 turns LoRA off"),
    ("data.rollout_batch_size=-1", "data.rollout_batch_size=-1 must be >= 0"),
    ("engine.collective_timeout_s=0", "engine.collective_timeout_s=0.0 must be > 0"),
    # Issue 27, 4.8: every missing HL-Gauss setting in one message, not one per run.
    ("engine.loss.kind=hl_gauss", "engine.loss.clip_range=0.5 does not apply to engine.loss.kind=hl_gauss (a value "
                                  "clip has no cross-entropy form): set engine.loss.clip_range=null; "
                                  "engine.loss.hl_gauss.min_value and engine.loss.hl_gauss.max_value are required"),
])
def test_config_errors_name_the_key_as_the_user_writes_it(override, message):
    with pytest.raises(ValueError) as raised:
        load_train_config([], [override])
    assert message in str(raised.value), str(raised.value)

def test_the_ppo_iteration_follows_the_mini_batch_and_is_checked_only_where_it_renews_old_values():
    # Issue 40, 6: data.mini_batch_size=12 alone was refused against a fixed default of 256.
    import torch

    from critic_adapters.common.job.trainer import renewal
    from critic_adapters.common.learning.data import Rollouts

    def refreshes_old_values(config, rollouts):
        return renewal(config, rollouts).old_values

    assert load_train_config([], ["data.mini_batch_size=12"]).data.iteration_rollouts == 48
    assert load_train_config([], []).data.iteration_rollouts == 256  # 4 x the default 64, as before
    assert load_train_config([], ["data.rollout_batch_size=null"]).data.iteration_rollouts is None
    config = load_train_config([], ["data.mini_batch_size=12", "data.rollout_batch_size=100"])
    ids = torch.ones(2, 3, dtype=torch.long)
    without_old = Rollouts(ids, ids, ids, returns=torch.zeros(2, 3), rewards=None, old_values=None)
    with pytest.raises(ValueError, match=r"rollout_batch_size=100 must be a multiple of data.mini_batch_size=12 .*use "
                                         r"96 or 108"):
        refreshes_old_values(config, without_old)
    with_old = Rollouts(ids, ids, ids, returns=torch.zeros(2, 3), rewards=None, old_values=torch.zeros(2, 3))
    assert refreshes_old_values(config, with_old) is False  # old values in the data: never renewed, not checked
    unclipped = load_train_config([], ["data.mini_batch_size=12", "data.rollout_batch_size=100",
                                       "engine.loss.clip_range=null"])
    assert refreshes_old_values(unclipped, without_old) is False
    small = load_train_config([], ["data.mini_batch_size=12", "data.rollout_batch_size=5"])
    with pytest.raises(ValueError, match="use 12,"):
        refreshes_old_values(small, without_old)
    # Issue 42: returns a truncated row bootstraps from the critic are renewed too (and checked), with
    # or without a clip and old values in the data; rows that end all keep the returns they started with.
    truncated = Rollouts(ids, ids, ids, returns=None, rewards=torch.zeros(2, 3), old_values=torch.zeros(2, 3),
                         truncated=torch.tensor([True, False]), brought_old_values=True)
    with pytest.raises(ValueError, match="whose returns the critic renews"):
        renewal(unclipped, truncated)
    fits = load_train_config([], ["data.mini_batch_size=12", "data.rollout_batch_size=96", "engine.loss.clip_range=null"])
    assert renewal(fits, truncated).returns and not renewal(fits, truncated).old_values
    ended = Rollouts(ids, ids, ids, returns=None, rewards=torch.zeros(2, 3), old_values=None)
    assert not renewal(fits, ended)
    assert renewal(load_train_config([], ["data.lam_critic=0.95"]), ended).returns  # GAE weighs the critic's values


def test_a_resume_may_change_the_expert_and_replicate_degrees_but_not_what_it_computes(tmp_path):
    """Issue 40, 5: checkpoints hold global tensors, so an EP 2 or HSDP run resumes at another degree
    (tests/test_moe.py resumes EP 2 at EP 1; tests/test_new_user.py an fsdp run at replicate 2)."""
    from critic_adapters.common.engine.config import to_yaml
    from critic_adapters.common.job.plan import PREPARED, check_run
    from critic_adapters.common.storage.checkpoints import META_FILE, step_dir

    run = [f"trainer.run_dir={tmp_path}", "backend=megatron", "engine.model.path=embedded:qwen3_moe"]
    (tmp_path / "config.yaml").write_text(to_yaml(load_train_config([], [*run, "engine.parallel.expert=2",
                                                                         "engine.parallel.replicate=1"])))
    (tmp_path / PREPARED).write_bytes(b"")
    os.makedirs(step_dir(str(tmp_path / "checkpoints"), 4))
    (tmp_path / "checkpoints" / "step_000004" / META_FILE).write_text("{}")
    resume = check_run(load_train_config([], [*run, "trainer.resume=true", "engine.parallel.expert=1",
                                              "engine.parallel.replicate=2"]))
    assert resume.latest.endswith("step_000004") and resume.processes is None
    assert [key for key, _, _ in resume.changes] == ["engine.parallel.replicate", "engine.parallel.expert"]
    with pytest.raises(ValueError, match="engine.loss.clip_range: 0.5 in the run, 0.2 now"):
        check_run(load_train_config([], [*run, "trainer.resume=true", "engine.loss.clip_range=0.2"]))
    with pytest.raises(ValueError, match="already holds checkpoints"):
        check_run(load_train_config([], run))


def test_lr_schedules():
    constant = OptimConfig(lr=1.0, warmup_steps=4)
    assert [lr_multiplier(s, constant) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cosine = OptimConfig(lr=1.0, lr_schedule="cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    assert lr_multiplier(2, cosine) == pytest.approx(1.0)
    assert lr_multiplier(7, cosine) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_multiplier(12, cosine) == pytest.approx(0.1) and lr_multiplier(50, cosine) == pytest.approx(0.1)


def test_the_default_jobs_warm_up_is_a_share_of_the_run_so_a_short_run_reaches_its_lr():
    # Issue 27, 4.4: warmup_steps 10 kept a 4-step run at 0.4 of its lr.
    import dataclasses

    from critic_adapters.common.job.launcher import DEFAULT_JOB

    optim = load_train_config([DEFAULT_JOB], []).engine.optim
    for total, warmup in ((4, 0), (116, 12), (1000, 100)):
        run = dataclasses.replace(optim, total_steps=total)
        assert run.warmup == warmup
        assert max(lr_multiplier(step, run) for step in range(total)) == pytest.approx(1.0)
    assert dataclasses.replace(optim, warmup_steps=3, total_steps=4).warmup == 3  # warmup_steps, when set, wins
    with pytest.raises(ValueError, match="warmup_ratio=0.1 needs engine.optim.total_steps"):
        OptimConfig(warmup_ratio=0.1).warmup


if __name__ == "__main__":
    run_pytest(__file__)
