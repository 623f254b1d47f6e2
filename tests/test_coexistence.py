"""Engines that share a process (verl colocates actor, critic and reference model per GPU, the actor
often on megatron): two megatron engines alive at once, one built on parallel state the host set up
itself (and left as the host had it), a different layout refused naming both, an FSDP engine
beside a megatron one, engines of different backends one after another, and checkpoints passed
between the two FSDP2-based backends."""

import json

import pytest

from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.tests.torchrun import run_torchrun, worker_env


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("coexist")
    model_dir = save_tiny_causal_lm("qwen2", str(root / "model"))
    run_torchrun(2, "critic_adapters.tests.coexist_worker", model_dir, str(root),
                 env=worker_env(PYTHONWARNINGS="ignore"), timeout=900)
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]


def test_two_megatron_engines_alive_at_once(ranks):
    for rank in ranks:
        run = rank["two_megatron"]
        assert run["second_vs_first"] <= 1e-6  # the second loaded the first's checkpoint
        assert run["first_after_second_closed"] == 0.0
        assert run["groups_left"] is False  # the last close destroyed the groups the first created


def test_an_engine_on_the_hosts_megatron_state_leaves_it_to_the_host(ranks):
    for rank in ranks:
        host = rank["host"]
        assert host["engine_dp_group_is_hosts"] and host["host_groups_kept"]
        assert host["host_dp_all_reduce"] == 2.0
        assert "megatron's process groups in this process (the host's) have {'tensor': 1" in host["other_layout"]
        assert "engine.parallel asks for {'tensor': 2" in host["other_layout"]


def test_an_fsdp_engine_beside_a_megatron_engine(ranks):
    for rank in ranks:
        mix = rank["mix"]
        assert mix["values_diff"] <= 1e-5
        assert mix["losses"][0] == pytest.approx(mix["losses"][1], rel=1e-5)
        assert mix["fsdp_after_megatron_closed"] > 0


def test_engines_one_after_another_in_one_process_give_the_same_values(ranks):
    for rank in ranks:
        assert rank["sequential"]["fsdp_then_megatron"] <= 1e-5
        assert rank["sequential"]["megatron_then_fsdp"] <= 1e-5


def test_fsdp_and_veomni_resume_each_others_checkpoints(ranks):
    for rank in ranks:
        assert rank["fsdp_veomni_checkpoints"]["fsdp_to_veomni"] <= 1e-6
        assert rank["fsdp_veomni_checkpoints"]["veomni_to_fsdp"] <= 1e-6


def test_two_veomni_engines_and_one_on_the_hosts_veomni_state(ranks):
    for rank in ranks:
        run = rank["veomni"]
        assert run["second_vs_first"] <= 1e-6 and run["first_after_second_closed"] == 0.0
        assert run["state_left"] is False  # our engines never make VeOmni's process-wide state
        assert run["engine_state_from_its_mesh"] and run["host_state_ambient_beside_the_engine"]
        assert run["host_state_kept"]


def test_no_gloo_worker_thread_outlives_shutdown(ranks):
    assert [r["gloo_threads_after_shutdown"] for r in ranks] == [0, 0]


if __name__ == "__main__":
    run_pytest(__file__)
