"""The service's door in this process, over a stand-in critic whose calls the test holds and releases (no
model, no ranks): a full queue answers 429 with Retry-After; an engine failure answers 500 with the rank's
message and applies nothing (the retry then applies once); a client that disconnects mid-request costs
nothing; a stopping server refuses new work with 503. Then over a one-rank vision critic's engine: images
sent as JSON come back as the engine's own values with the same tensors, and placeholders without
pixels are refused before anything runs."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.serve.app import build_app
from critic_adapters.serve.batcher import Batcher, BatchingConfig
from critic_adapters.serve.ledger import Journal, Ledger
from critic_adapters.serve.metrics import Metrics
from critic_adapters.serve.schema import Limits

TOKEN = "user-token-of-the-door-test"


class HeldCritic:
    """compute_values waits for `gate`; update raises `failure` while it is set."""

    def __init__(self):
        self.version, self.gate, self.failure, self.calls = 0, threading.Event(), None, 0
        self.entered = threading.Semaphore(0)

    def compute_values(self, input_ids, attention_mask, multi_modal_inputs=None, *, return_version=False):
        self.calls += 1
        self.entered.release()
        assert self.gate.wait(300), "the test never released the critic"
        return input_ids.float(), self.version

    def update(self, batch):
        if self.failure is not None:
            raise self.failure
        self.version += 1
        return {"value_loss": 0.25}


def _serving(critic, tmp_path, limits: Limits, critic_config=None, **batching):
    """(url, batcher, stop) of a server in a thread of this process over `critic`."""
    import uvicorn

    metrics = Metrics()
    batcher = Batcher(critic, BatchingConfig(**batching), ledger=Ledger(),
                      journal=Journal(str(tmp_path / "serve" / "journal.jsonl")), checkpoint_root=str(tmp_path / "ck"),
                      save_every=0, keep_last=1, metrics=metrics, say=lambda *_: None)
    batcher.start()
    app = build_app(batcher, limits=limits, critic_config=critic_config, user_token=TOKEN, admin_token=None,
                    max_body_bytes=1 << 20, metrics=metrics)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:  # a thread's start, not a timing assumption: it either starts or the test hangs
        assert thread.is_alive(), "the server thread ended"
        time.sleep(0.01)

    def stop():
        server.should_exit = True
        thread.join(60)
        batcher.stop()
    return f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", batcher, stop


@pytest.fixture
def door(tmp_path):
    critic = HeldCritic()
    url, batcher, stop = _serving(critic, tmp_path, Limits(vocab_size=100, max_positions=64), max_queue=2,
                                  batching=False)
    yield url, critic, batcher
    critic.gate.set()
    stop()


def _post(url: str, path: str, body: dict):
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), err.headers


VALUES = {"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1, 1]]}
UPDATE = {"request_id": "u", "input_ids": [[1, 2, 3]], "attention_mask": [[1, 1, 1]], "response_mask": [[0, 1, 1]],
          "old_values": [[0.0, 0.0, 0.0]], "returns": [[0.0, 1.0, 1.0]]}


def _queued(batcher, count: int) -> None:
    while len(batcher._queue) < count:  # noqa: SLF001 - the state the test waits for
        time.sleep(0.01)


def test_a_full_queue_answers_429_with_retry_after(door):
    url, critic, batcher = door
    answers = []
    waiting = [threading.Thread(target=lambda: answers.append(_post(url, "/v1/values", VALUES))) for _ in range(3)]
    waiting[0].start()
    assert critic.entered.acquire(timeout=300)  # the first is in the engine, held
    for thread in waiting[1:]:
        thread.start()
    _queued(batcher, 2)  # --max-queue 2: full
    status, body, headers = _post(url, "/v1/values", VALUES)
    assert status == 429 and headers["Retry-After"] == "1", body
    critic.gate.set()
    for thread in waiting:
        thread.join(300)
    assert sorted(a[0] for a in answers) == [200, 200, 200]
    assert all(a[1]["values"] == [[1.0, 2.0, 3.0]] for a in answers)


def test_an_engine_failure_answers_500_with_its_message_and_applies_nothing(door, tmp_path):
    url, critic, _ = door
    critic.failure = RuntimeError("update failed on rank 1: CUDA out of memory")
    status, body, _ = _post(url, "/v1/update", UPDATE)
    assert status == 500 and "rank 1: CUDA out of memory" in body["error"]["message"], body
    assert critic.version == 0
    assert not (tmp_path / "serve" / "journal.jsonl").exists() or not (tmp_path / "serve" / "journal.jsonl").read_text()
    critic.failure = None
    status, body, _ = _post(url, "/v1/update", UPDATE)  # the retry: applied now, once
    assert status == 200 and body["version"] == 1
    status, again, headers = _post(url, "/v1/update", UPDATE)
    assert again == body and headers["X-Critic-Replayed"] == "true" and critic.version == 1
    critic.failure = ValueError("returns hold NaN")  # the engine's refusal of the input: the caller's to fix
    assert _post(url, "/v1/update", {**UPDATE, "request_id": "v"})[0] == 422


def test_a_client_that_disconnects_costs_nothing(door):
    url, critic, batcher = door
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(VALUES).encode()
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(b"POST /v1/values HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() +
                    b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert critic.entered.acquire(timeout=300)  # its work is in the engine when it leaves
    critic.gate.set()
    status, answer, _ = _post(url, "/v1/values", VALUES)
    assert status == 200 and answer["values"] == [[1.0, 2.0, 3.0]]
    assert batcher._thread.is_alive()  # noqa: SLF001
    assert critic.calls == 2


def test_a_stopping_server_refuses_new_work(door):
    url, critic, batcher = door
    critic.gate.set()
    batcher.stop()
    status, body, _ = _post(url, "/v1/values", VALUES)
    assert status == 503 and "shutting down" in body["error"]["message"]


class SavingCritic:
    """Versions, checkpoints as small files (the engine's marker, the extra state), updates that count."""

    def __init__(self):
        self.version = 0

    def update(self, batch):
        self.version += 1
        return {"value_loss": 0.5}

    def save_checkpoint(self, directory, extra_state):
        from critic_adapters.common.storage.checkpoints import META_FILE

        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "state.json"), "w") as f:
            json.dump({"version": self.version, "extra": extra_state}, f)
        open(os.path.join(directory, META_FILE), "w").close()

    def load_checkpoint(self, directory):
        with open(os.path.join(directory, "state.json")) as f:
            state = json.load(f)
        self.version = state["version"]
        return state["extra"]


def test_a_load_becomes_the_latest_checkpoint_and_moves_the_later_ones_aside(tmp_path):
    """An admin load of an older state: a restart resumes it (it is the latest, never pruned), its ledger
    answers, and the checkpoints of the line it replaced are kept aside."""
    from critic_adapters.common.storage import checkpoints
    from critic_adapters.serve.schema import Limits, update_request

    root = str(tmp_path / "ck")
    batcher = Batcher(SavingCritic(), BatchingConfig(), ledger=Ledger(), journal=Journal(str(tmp_path / "j.jsonl")),
                      checkpoint_root=root, save_every=1, keep_last=2, metrics=Metrics(), say=lambda *_: None)
    limits = Limits(vocab_size=100, max_positions=64)
    first = batcher._update(update_request(UPDATE, limits))[0]  # noqa: SLF001 - the engine thread's call
    batcher.save(str(tmp_path / "snapshot"))  # version 1, with u's answer
    for index in range(3):
        batcher._update(update_request({**UPDATE, "request_id": f"later-{index}"}, limits))  # noqa: SLF001
    assert [os.path.basename(p) for p in checkpoints.complete_checkpoints(root)] == ["step_000003", "step_000004"]
    batcher._load(str(tmp_path / "snapshot"))  # noqa: SLF001
    assert batcher.version == 1
    assert checkpoints.find_latest(root) == checkpoints.step_dir(root, 1)
    assert [os.path.basename(p) for p in checkpoints.complete_checkpoints(root)] == ["step_000001"]
    (aside,) = [n for n in os.listdir(root) if n.startswith("superseded-")]
    assert sorted(os.listdir(os.path.join(root, aside))) == ["step_000003", "step_000004"]
    assert batcher._update(update_request(UPDATE, limits)) == (first, True)  # noqa: SLF001 - the snapshot's ledger


def test_a_vision_critic_takes_its_images_as_json(tmp_path):
    """multi_modal_inputs as nested lists reach a one-rank qwen2_vl engine as the processor's tensors."""
    from critic_adapters.common.engine.config import EngineConfig, ModelConfig
    from critic_adapters.common.engine.registry import build_engine
    from critic_adapters.common.parallel.distributed import init_distributed
    from critic_adapters.common.testdata.vision import save_vision_critic, vision_batch
    from critic_adapters.common.valuehead.load import load_critic
    from critic_adapters.serve.ranks import RankZeroCritic

    critic_dir = save_vision_critic("qwen2_vl", str(tmp_path / "critic"))
    engine = build_engine("fsdp", EngineConfig(model=ModelConfig(path=critic_dir)), init_distributed())
    config = load_critic(critic_dir)[0].config
    url, _, stop = _serving(RankZeroCritic(engine, None, timeout_s=600), tmp_path,
                            Limits(vocab_size=config.get_text_config().vocab_size, max_positions=4096), config)
    try:
        ids, mask, images = vision_batch(config, [[(1, 4, 4)], [], [(1, 4, 4), (1, 2, 4)]], seed=0)
        body = {"input_ids": ids.tolist(), "attention_mask": mask.tolist(),
                "multi_modal_inputs": [{k: v.tolist() for k, v in row.items()} if row else None for row in images]}
        status, answer, _ = _post(url, "/v1/values", body)
        assert status == 200, answer
        expected = engine.compute_values(ids, mask, images)
        diff = float((torch.tensor(answer["values"]) - expected).abs()[mask.bool()].max())
        assert diff <= 1e-5, f"values of images sent as JSON differ from the engine's by {diff}"
        blind = _post(url, "/v1/values", {"input_ids": ids.tolist(), "attention_mask": mask.tolist()})
        assert blind[0] == 422 and blind[1]["error"]["field"] == "multi_modal_inputs", blind[1]
    finally:
        stop()
        engine.close()


if __name__ == "__main__":
    run_pytest(__file__)
