"""RayCriticGroup on a local Ray cluster of this machine (2 actors, CPU, gloo): the same values as
an in-process engine, the same update as the 2-rank torchrun engine, a vision-language critic's
images going with their rows, checkpoints that a new group continues bit-identically, megatron at
TP 2 across the actors, a host's placement group shared with its actors between phases (and its
partly taken bundles refused within startup_timeout_s), the whole engine contract
(common.engine.CriticEngine) with the step in pieces equal to one engine's, and faults (a killed
actor, NaN returns) that end in a clear error on the driver, never a hang."""

import os
import re
import time

import pytest
import torch

from critic_adapters.common.engine.config import BatchingConfig, EngineConfig, LossConfig, ModelConfig, OptimConfig, ParallelConfig
from critic_adapters.common.engine import RolloutBatch
from critic_adapters.common.tests.helpers import FIELDS, run_pytest, save_rollout_batch
from critic_adapters.common.tests.torchrun import run_torchrun, worker_env
from critic_adapters.common.testdata import save_tiny_causal_lm

LENGTHS = [12, 7, 10, 5, 9]  # 5 rows over 2 data-parallel workers: uneven shares (3 and 2)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A local cluster for this module; token authentication off in this test's own environment only."""
    import ray

    saved = {key: os.environ.get(key) for key in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    from critic_adapters.integrations.ray.cluster import ensure_ray, shutdown_ray

    ensure_ray(num_cpus=2)
    yield ray
    shutdown_ray()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray_models")
    return {family: save_tiny_causal_lm(family, str(root / family)) for family in ("qwen2", "llama")}


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ray_batch") / "batch.pt")
    save_rollout_batch(path, LENGTHS)
    return path


def engine_config(model_dir: str, **parallel) -> EngineConfig:
    # The settings of tests/update_worker.py (the torchrun reference).
    return EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-3, grad_clip=1.0),
                        loss=LossConfig(clip_range=0.2), batching=BatchingConfig(micro_batch_tokens=48),
                        parallel=ParallelConfig(**parallel))


def rollout_batch(batch_file: str) -> RolloutBatch:
    data = torch.load(batch_file)
    return RolloutBatch(*(data[key] for key in FIELDS))


def in_process_values(backend: str, config: EngineConfig, batch: RolloutBatch) -> torch.Tensor:
    from critic_adapters.common.parallel.distributed import init_distributed
    from critic_adapters.common.engine.registry import build_engine

    engine = build_engine(backend, config, init_distributed())
    try:
        return engine.compute_values(batch.input_ids, batch.attention_mask)
    finally:
        engine.close()


def torchrun_update(backend: str, model_dir: str, batch_file: str, out, **spec) -> dict:
    import json

    run_torchrun(2, "critic_adapters.tests.update_worker", backend, str(out), json.dumps(spec), model_dir, batch_file,
                 env=worker_env(PYTHONWARNINGS="ignore"))
    return torch.load(out)[0]


def gone(pids, deadline_s: float = 60.0) -> bool:
    """Every pid has exited (polled: a killed process takes a moment to be reaped)."""
    import psutil

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.5)
    return False


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_values_and_one_update_equal_the_engines(ray_cluster, models, batch_file, family, tmp_path):
    from critic_adapters.integrations.ray import RayCriticGroup

    batch, config = rollout_batch(batch_file), engine_config(models[family])
    expected = in_process_values("fsdp", config, batch)
    reference = torchrun_update("fsdp", models[family], batch_file, tmp_path / "metrics.pt")
    with RayCriticGroup("fsdp", config, num_workers=2) as group:
        assert len(group.actors) == 2 and group.data_parallel_ranks == 2
        # The local cluster is loopback-only: Ray reports 127.0.0.1 for its node, the rendezvous is there.
        assert [node["NodeManagerAddress"] for node in ray_cluster.nodes()] == ["127.0.0.1"]
        assert group.hosts == ["127.0.0.1", "127.0.0.1"]
        values = group.compute_values(batch.input_ids, batch.attention_mask)  # 3 rows on worker 0, 2 on worker 1
        assert values.dtype == torch.float32 and values.shape == batch.input_ids.shape
        assert torch.allclose(values, expected, atol=1e-6, rtol=0), (values - expected).abs().max()
        # Rollouts by reference: an object a stack's generation actors put in the store.
        metrics = group.update(ray_cluster.put(batch))
    assert metrics["value_loss"] == pytest.approx(reference["value_loss"], abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    assert metrics["valid_tokens"] == reference["valid_tokens"]  # rank 0's share, as the torchrun job logs it


@pytest.fixture(scope="module")
def vision_critic(tmp_path_factory) -> str:
    from critic_adapters.common.testdata.vision import save_vision_critic

    return save_vision_critic("qwen2_vl", str(tmp_path_factory.mktemp("ray_vision") / "critic"))


def test_a_vision_critics_images_go_with_their_rows_to_the_actors(ray_cluster, vision_critic):
    """A qwen2_vl critic with images (several per row, a text-only row, a left-padded row) through 2
    actors: the shares are balanced with the image patches counted, each actor's rows take their
    images; values (compute_values and forward_backward) equal transformers' own forward of each row
    and an in-process engine's; one update equals that engine's (loss, grad norm, values after); the rows
    without their images are refused by row."""
    from critic_adapters.common.engine import shift_to_tokens
    from critic_adapters.common.engine.registry import build_engine
    from critic_adapters.common.parallel.batching import data_parallel_shares
    from critic_adapters.common.parallel.distributed import init_distributed
    from critic_adapters.common.valuehead.multimodal import vision_patches
    from critic_adapters.integrations.ray import RayCriticGroup
    from critic_adapters.common.testdata.vision import transformers_values
    from critic_adapters.tests.vision_worker import vision_rollout

    batch, config = vision_rollout("qwen2_vl", 0), engine_config(vision_critic)
    ids, mask, images = batch.input_ids, batch.attention_mask, batch.multi_modal_inputs
    real = mask.bool()
    expected = transformers_values(vision_critic, batch)
    shares = data_parallel_shares(mask, 2, vision_patches(images, ids.shape[0]))
    assert [s.tolist() for s in shares] != [s.tolist() for s in data_parallel_shares(mask, 2)]  # the patches count
    engine = build_engine("fsdp", config, init_distributed())
    try:
        with RayCriticGroup("fsdp", config, num_workers=2) as group:
            values = group.compute_values(ids, mask, images)
            assert (values - expected)[real].abs().max() < 1e-4, (values - expected)[real].abs().max()
            assert values[~real].abs().max() == 0
            alone = engine.compute_values(ids, mask, images)
            assert torch.allclose(values[real], alone[real], atol=1e-5), (values - alone)[real].abs().max()
            # Each actor's rows (every actor called: the engines check the images together).
            answers = ray_cluster.get([actor.compute_values.remote(ids, mask, images) for actor in group.actors])
            assert [rows.tolist() for rows, _ in answers] == [s.tolist() for s in shares]
            pieces, no_loss = group.forward_backward(ids, mask, None, images)
            assert no_loss is None and torch.allclose(pieces[real], values[real], atol=1e-5)
            # The same rows without their images: refused by row, never computed blind (issue 49).
            with pytest.raises(ValueError, match=r"row \d+: input_ids hold \d+ image placeholder token\(s\)") as error:
                group.compute_values(ids, mask)
            named, count = map(int, re.search(r"row (\d+): input_ids hold (\d+)", str(error.value)).groups())
            assert count == int((ids[named] == 998).sum()) > 0  # named by the caller's row, not the actor's
            step = RolloutBatch(ids, mask, batch.response_mask, shift_to_tokens(values) * batch.response_mask,
                                batch.returns, multi_modal_inputs=images)
            ours, reference = group.update(ray_cluster.put(step)), engine.update(step)
            after = group.compute_values(ids, mask, images)
        for key in ("value_loss", "grad_norm", "explained_variance"):
            assert ours[key] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), key
        expected_after = engine.compute_values(ids, mask, images)
        # Relative, as the metrics are: values of up to ~8 after one step in another summation order (two
        # ranks' reduction against one engine's) differed by 2e-4 on this machine's CPU.
        assert torch.allclose(after[real], expected_after[real], rtol=1e-4, atol=1e-4), \
            (after - expected_after)[real].abs().max()
        assert (after - values)[real].abs().max() > 1e-3  # the step moved the critic
    finally:
        engine.close()


def test_a_new_group_continues_from_a_checkpoint_bit_identically(ray_cluster, models, batch_file, tmp_path):
    from critic_adapters.integrations.ray import RayCriticGroup

    batch, config = rollout_batch(batch_file), engine_config(models["qwen2"])
    with RayCriticGroup("fsdp", config, num_workers=2) as group:
        group.update(batch)
        group.save_checkpoint(str(tmp_path / "ckpt"), extra_state={"step": 1})
        values = group.compute_values(batch.input_ids, batch.attention_mask)
        after = group.update(batch)
        group.export_hf(str(tmp_path / "hf"))
    with RayCriticGroup("fsdp", config, num_workers=2) as group:
        assert group.load_checkpoint(str(tmp_path / "ckpt")) == {"step": 1}
        assert torch.equal(group.compute_values(batch.input_ids, batch.attention_mask), values)
        resumed = group.update(batch)
    for key in ("value_loss", "grad_norm", "explained_variance", "lr"):
        assert resumed[key] == after[key], key
    from transformers import AutoModelForTokenClassification

    exported = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "hf"))
    assert type(exported).__name__ == "Qwen2ForTokenClassification"


def test_megatron_at_tensor_parallel_two_across_the_actors(ray_cluster, models, batch_file, tmp_path):
    from critic_adapters.common.tests.helpers import skip_without_backend
    from critic_adapters.integrations.ray import RayCriticGroup

    skip_without_backend("megatron")
    batch = rollout_batch(batch_file)
    config = engine_config(models["qwen2"], tensor=2)
    reference = torchrun_update("megatron", models["qwen2"], batch_file, tmp_path / "metrics.pt", tensor=2)
    expected = in_process_values("fsdp", engine_config(models["qwen2"]), batch)
    with RayCriticGroup("megatron", config, num_workers=2) as group:
        assert group.data_parallel_ranks == 1  # the two actors are tensor-parallel peers: the same rows
        values = group.compute_values(batch.input_ids, batch.attention_mask)
        metrics = group.update(batch)
    real = batch.attention_mask.bool()
    assert torch.allclose(values[real], expected[real], atol=1e-5), (values[real] - expected[real]).abs().max()
    assert metrics["value_loss"] == pytest.approx(reference["value_loss"], abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)


def test_a_killed_actor_ends_the_next_call_with_an_error_naming_it(ray_cluster, models, batch_file):
    from critic_adapters.integrations.ray import CriticWorkerError, RayCriticGroup

    batch, config = rollout_batch(batch_file), engine_config(models["qwen2"])
    group = RayCriticGroup("fsdp", config, num_workers=2)
    group.update(batch)
    pids = list(group.pids)
    ray_cluster.kill(group.actors[1])
    start = time.monotonic()
    with pytest.raises(CriticWorkerError, match=r"critic worker 1 of 2 \(actor \w+, pid \d+\) died during update"):
        group.update(batch)
    assert time.monotonic() - start < 60
    assert gone(pids), "a worker of the group is still running"
    with pytest.raises(RuntimeError, match="closed"):
        group.compute_values(batch.input_ids, batch.attention_mask)
    group.close()  # nothing left to close: no error


def test_the_critic_shares_a_hosts_placement_group_with_its_actors_between_phases(ray_cluster, models, batch_file):
    """A host's placement group of two 1-CPU bundles, a stand-in actor model on each (half a CPU:
    it holds a tensor and works), our critic's two workers on the same bundles (the other half).
    Phases alternate: the actors work while the critic is offloaded, then the critic onloads,
    computes values, updates and offloads again. The critic trains as a group of its own would,
    bit for bit; the host's actors and placement group outlive the critic group."""
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from critic_adapters.integrations.ray import RayCriticGroup

    @ray_cluster.remote(num_cpus=0.5)
    class StandInActor:
        def __init__(self, seed: int):
            self.weights = torch.randn(64, 64, generator=torch.Generator().manual_seed(seed)) / 8

        def work(self) -> float:
            self.weights = torch.tanh(self.weights @ self.weights)
            return float(self.weights.sum())

    batch, config = rollout_batch(batch_file), engine_config(models["qwen2"])
    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
    ray_cluster.get(pg.ready())
    try:
        host = [StandInActor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))
                .remote(i) for i in range(2)]
        expected_work = [float(torch.tanh(w @ w).sum()) for w in
                         (torch.randn(64, 64, generator=torch.Generator().manual_seed(i)) / 8 for i in range(2))]
        with pytest.raises(ValueError, match=r"bundle 0 of the placement group holds \{'CPU': 1.0\}, a critic worker "
                                             r"reserves \{'CPU': 2\}"):
            RayCriticGroup("fsdp", config, placement_group=pg, bundle_indices=[0, 1], resources_per_worker={"CPU": 2})
        shared = []
        with RayCriticGroup("fsdp", config, placement_group=pg, bundle_indices=[1, 0],
                            resources_per_worker={"CPU": 0.5}) as group:
            assert group.num_workers == 2 and group.offloaded == set()
            group.offload()
            assert ray_cluster.get([actor.work.remote() for actor in host]) == pytest.approx(expected_work)
            for _ in range(2):  # rollout: the actors work while the critic is off; then the critic's phase
                group.onload()
                values = group.compute_values(batch.input_ids, batch.attention_mask)
                shared.append((values, group.update(batch)))
                group.offload()
                assert group.offloaded == {"model", "grads", "optimizer"}
                assert all(abs(x) > 0 for x in ray_cluster.get([actor.work.remote() for actor in host]))
        assert placement_group_table(pg)["state"] == "CREATED"  # the host's group stays the host's
        assert all(abs(x) > 0 for x in ray_cluster.get([actor.work.remote() for actor in host]))
        for actor in host:
            ray_cluster.kill(actor)
    finally:
        remove_placement_group(pg)
    alone = []
    with RayCriticGroup("fsdp", config, num_workers=2) as group:
        for _ in range(2):
            alone.append((group.compute_values(batch.input_ids, batch.attention_mask), group.update(batch)))
    for (values, metrics), (values_alone, metrics_alone) in zip(shared, alone):
        assert torch.equal(values, values_alone)
        assert {k: metrics[k] for k in ("value_loss", "grad_norm", "explained_variance")} == \
               {k: metrics_alone[k] for k in ("value_loss", "grad_norm", "explained_variance")}


def test_a_critic_that_does_not_fit_a_hosts_partly_taken_bundles_is_refused_by_startup_timeout_s(ray_cluster, models):
    """A host's placement group of two 1-CPU bundles whose own actors hold half of each; critic
    workers reserving 0.75 CPU fit the bundles' size but not what is free in them, so Ray keeps them
    pending. The group gives up after startup_timeout_s (it used to wait forever: the bound covered
    only the placement group's readiness, which a host's group had long passed), names the bundles,
    the reservation and what is free in each, and leaves nothing behind: the host's actors keep
    working, and once they are gone the host's own whole-bundle actors are placed there (a worker
    left pending would have taken a bundle first)."""
    import threading

    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from critic_adapters.integrations.ray import RayCriticGroup

    @ray_cluster.remote
    class HostActor:
        def ping(self) -> int:
            return os.getpid()

    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
    ray_cluster.get(pg.ready())

    def on_bundle(index: int, cpus: float):
        return HostActor.options(num_cpus=cpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=index)).remote()

    try:
        host = [on_bundle(i, 0.5) for i in range(2)]
        ray_cluster.get([actor.ping.remote() for actor in host])  # both halves are held now
        outcome = {}

        def start():
            try:
                RayCriticGroup("fsdp", engine_config(models["qwen2"]), placement_group=pg, bundle_indices=[0, 1],
                               resources_per_worker={"CPU": 0.75}, startup_timeout_s=20).close()
                outcome["started"] = True
            except Exception as err:  # noqa: BLE001 - asserted below
                outcome["error"] = err

        # In a thread, so that a group that waits forever fails this test rather than hanging the suite.
        thread = threading.Thread(target=start, daemon=True)
        thread.start()
        thread.join(timeout=240)
        assert not thread.is_alive(), "RayCriticGroup still waiting for its workers 220 s past startup_timeout_s=20"
        error = outcome.get("error")
        assert isinstance(error, RuntimeError), outcome
        message = str(error)
        assert "critic worker(s) 0, 1 of 2 not scheduled within 20 s: bundle(s) 0, 1 of the host's placement " \
               "group could not take a worker reserving {'CPU': 0.75}" in message, message
        assert "Free now in those bundles: bundle 0: {'CPU': 0.5} of {'CPU': 1.0}; bundle 1: {'CPU': 0.5} of " \
               "{'CPU': 1.0}; free in the cluster outside placement groups: {'CPU': 0.0}" in message, message
        assert placement_group_table(pg)["state"] == "CREATED"  # the host's group stays the host's
        assert len(ray_cluster.get([actor.ping.remote() for actor in host], timeout=120)) == 2
        for actor in host:
            ray_cluster.kill(actor)
        whole = [on_bundle(i, 1.0) for i in range(2)]
        ready, _ = ray_cluster.wait([actor.ping.remote() for actor in whole], num_returns=2, timeout=120)
        assert len(ready) == 2, "a bundle is still held: the critic's pending workers were not stopped"
        for actor in whole:
            ray_cluster.kill(actor)
    finally:
        remove_placement_group(pg)


@pytest.fixture(scope="module")
def fsdp_group(ray_cluster, models):
    """One fsdp group of 2 actors (data parallel 2) for the last tests of the file, which share it (it
    holds the cluster's 2 CPUs until the module ends: no group may start after it)."""
    from critic_adapters.integrations.ray import RayCriticGroup

    with RayCriticGroup("fsdp", engine_config(models["qwen2"]), num_workers=2) as group:
        yield group


def test_the_group_has_the_whole_contract_and_its_step_in_pieces_is_one_engines(fsdp_group, models, batch_file):
    """forward_backward / step_optimizer / zero_grad / scheduler on the group (each actor on its
    data-parallel share, gradients averaged over the 2) equal one in-process engine's on every row
    with half the loss."""
    from critic_adapters.common.parallel.distributed import init_distributed
    from critic_adapters.common.engine import contract_members
    from critic_adapters.common.engine.registry import build_engine

    group, batch = fsdp_group, rollout_batch(batch_file)
    assert [name for name in contract_members() if not hasattr(group, name)] == []
    assert group.parallel is None and group.load_report.format
    engine = build_engine("fsdp", engine_config(models["qwen2"]), init_distributed())
    try:
        values, loss = group.forward_backward(batch.input_ids, batch.attention_mask, loss_fn=lambda v: (v ** 2).sum())
        expected, whole = engine.forward_backward(batch.input_ids, batch.attention_mask,
                                                  loss_fn=lambda v: (v ** 2).sum() / 2)
        real = batch.attention_mask.bool()
        assert torch.allclose(values[real], expected[real], atol=1e-6), (values - expected).abs().max()
        assert 0 < float(loss) < 2 * float(whole)  # data-parallel rank 0's share of the loss
        assert group.step_optimizer() == pytest.approx(engine.step_optimizer(), rel=1e-5)
        group.scheduler.step()
        engine.scheduler.step()
        assert group.scheduler.get_last_lr() == engine.scheduler.get_last_lr()
        after = group.compute_values(batch.input_ids, batch.attention_mask)
        assert torch.allclose(after[real], engine.compute_values(batch.input_ids, batch.attention_mask)[real], atol=1e-5)
        assert not torch.allclose(after[real], values[real], atol=1e-4)  # the step moved the critic
        group.forward_backward(batch.input_ids, batch.attention_mask, loss_fn=lambda v: v.sum())
        group.zero_grad()
        assert group.step_optimizer() == 0.0  # the gradients zero_grad dropped are not stepped on
        values_only, no_loss = group.forward_backward(batch.input_ids, batch.attention_mask)
        assert no_loss is None and values_only.shape == batch.input_ids.shape
        # Between phases: every actor's engine off its device and back, the critic unchanged.
        resident = group.resident_bytes()
        group.offload(model=False)
        assert group.offloaded == {"grads", "optimizer"} and group.resident_bytes()["optimizer"] == 0
        assert torch.equal(group.compute_values(batch.input_ids, batch.attention_mask), values_only)
        group.offload()
        assert group.resident_bytes() == {"model": 0, "grads": 0, "optimizer": 0}
        with pytest.raises(ValueError, match=r"compute_values: the critic's model is offloaded"):
            group.compute_values(batch.input_ids, batch.attention_mask)
        group.onload()
        assert group.offloaded == set() and group.resident_bytes()["optimizer"] == resident["optimizer"] > 0
        assert torch.equal(group.compute_values(batch.input_ids, batch.attention_mask), values_only)
    finally:
        engine.close()


def test_an_update_with_a_value_mask_reaches_every_actor_and_counts_only_those_tokens(fsdp_group, models, batch_file,
                                                                                      tmp_path):
    """RolloutBatch.value_mask through the group (each actor takes its rows of it): the step equals an
    in-process engine's from the same checkpoint, and its loss is the clipped loss over the value-mask
    tokens alone, normalised over both actors' shares."""
    import dataclasses

    from critic_adapters.common.engine import shift_to_tokens
    from critic_adapters.common.engine.registry import build_engine
    from critic_adapters.common.learning.loss import value_loss
    from critic_adapters.common.parallel.distributed import init_distributed

    group, batch = fsdp_group, rollout_batch(batch_file)
    value_mask = batch.response_mask.clone()
    value_mask[:, 1::3] = 0
    value_mask[0] = 0
    masked = dataclasses.replace(batch, value_mask=value_mask)
    group.save_checkpoint(str(tmp_path / "ckpt"))
    engine = build_engine("fsdp", engine_config(models["qwen2"]), init_distributed())
    try:
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        values, version = group.compute_values(batch.input_ids, batch.attention_mask, return_version=True)
        before = shift_to_tokens(values)
        assert version == group.version == engine.version  # the checkpoint carried the actors' step count
        ours, reference = group.update(masked), engine.update(masked)
        assert group.version == version + 1
        expected, _ = value_loss(before, batch.old_values, batch.returns, value_mask, clip_range=0.2)
        assert ours["value_loss"] == pytest.approx(float(expected), rel=1e-5)
        assert ours["valid_tokens"] == int(value_mask.sum()) < int(batch.response_mask.sum())
        for key in ("value_loss", "grad_norm", "explained_variance"):
            assert ours[key] == pytest.approx(reference[key], rel=1e-5), key
        real = batch.attention_mask.bool()
        after = group.compute_values(batch.input_ids, batch.attention_mask)
        assert torch.allclose(after[real], engine.compute_values(batch.input_ids, batch.attention_mask)[real],
                              atol=1e-5)
    finally:
        engine.close()


def test_bad_input_raises_the_engines_message_and_the_group_stays_usable(fsdp_group, batch_file):
    batch, group = rollout_batch(batch_file), fsdp_group
    returns = batch.returns.clone()
    returns[0, 5] = float("nan")
    before = group.compute_values(batch.input_ids, batch.attention_mask)
    with pytest.raises(ValueError, match=r"returns has 1 non-finite \(NaN/inf\) entries on response tokens"):
        group.update(RolloutBatch(batch.input_ids, batch.attention_mask, batch.response_mask, batch.old_values,
                                  returns))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, \d+\) for this model"):
        group.compute_values(batch.input_ids.clamp(min=0) + 5000, batch.attention_mask)
    assert torch.equal(group.compute_values(batch.input_ids, batch.attention_mask), before)  # weights untouched
    metrics = group.update(batch)
    assert metrics["value_loss"] > 0 and metrics["grad_norm"] > 0


if __name__ == "__main__":
    run_pytest(__file__)
