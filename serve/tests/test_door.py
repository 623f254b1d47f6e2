"""The service's door in this process, over stand-in critics whose calls the test holds, fails or counts (no
model, no ranks): a full queue answers 429 with Retry-After; an engine failure answers 500 with the rank's
message and applies nothing (the retry then applies once); a client that disconnects mid-request costs
nothing; a stopping server refuses new work with 503; values queued behind an offload are 503, not 422; a
dead engine thread answers everyone 503, health says so and the server is told to stop; a journal that
cannot be written hands the update to a checkpoint, and when that fails too the service stops unanswered;
a failing --save-every checkpoint still answers; the same update written by another serialiser is a
retry; admin saves never replace a directory the service did not write; deep JSON, 404 and 405 in the
one error shape. The journal alone: a torn tail cut at resume, a line appended onto a torn one kept, a
corrupt middle refused. Then over a one-rank vision critic's engine: images sent as JSON come back as
the engine's own values with the same tensors, and placeholders without pixels are refused before
anything runs."""

from __future__ import annotations

import errno
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
from critic_adapters.serve.batcher import BatchingConfig, Kind
from critic_adapters.serve.crash_points import CrashPoints
from critic_adapters.serve.launch import serve_in_thread
from critic_adapters.serve.ledger import Journal, JournalCorrupt
from critic_adapters.serve.metrics import Metrics
from critic_adapters.serve.schema import Limits, update_request
from critic_adapters.serve.updates import Updates

TOKEN = "user-token-of-the-door-test"
LIMITS = Limits(vocab_size=100, max_positions=64)


class HeldCritic:
    """compute_values waits for `gate`; update raises `failure` while it is set."""

    def __init__(self):
        self.version, self.gate, self.failure, self.calls = 0, threading.Event(), None, 0
        self.entered = threading.Semaphore(0)

    def compute_values(self, input_ids, attention_mask, multi_modal_inputs=None, *, return_version=False):
        self.calls += 1
        self.entered.release()
        assert self.gate.wait(300), "the test never released the critic"
        return (input_ids.float(), self.version) if return_version else input_ids.float()

    def update(self, batch):
        if self.failure is not None:
            raise self.failure
        self.version += 1
        return {"value_loss": 0.25}

    def offload(self):
        pass

    def lost(self):
        return None


@pytest.fixture
def door(tmp_path):
    critic = HeldCritic()
    service, url, stop = serve_in_thread(critic, str(tmp_path), (TOKEN, None), limits=LIMITS, max_queue=2,
                                         no_batching=True, max_body_bytes=1 << 20, max_parsing=2)
    yield url, critic, service
    critic.gate.set()
    stop()


def _post(url: str, path: str, body, token: str = TOKEN, method: str = "POST"):
    data = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method, headers={"Authorization": f"Bearer {token}"})
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
    url, critic, service = door
    batcher = service.batcher
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
    url, critic, service = door
    batcher = service.batcher
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
    url, critic, service = door
    batcher = service.batcher
    critic.gate.set()
    batcher.stop()
    status, body, _ = _post(url, "/v1/values", VALUES)
    assert status == 503 and "shutting down" in body["error"]["message"]


class SavingCritic:
    """Versions, checkpoints as small files (the engine's marker, the extra state), updates that count;
    save_failure: what a save raises while it is set."""

    def __init__(self):
        self.version, self.save_failure = 0, None

    def update(self, batch):
        self.version += 1
        return {"value_loss": 0.5}

    def save_checkpoint(self, directory, extra_state):
        from critic_adapters.common.storage.checkpoints import META_FILE

        if self.save_failure is not None:
            raise self.save_failure
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "state.json"), "w") as f:
            json.dump({"version": self.version, "extra": extra_state}, f)
        open(os.path.join(directory, META_FILE), "w").close()

    def load_checkpoint(self, directory):
        with open(os.path.join(directory, "state.json")) as f:
            state = json.load(f)
        self.version = state["version"]
        return state["extra"]

    def lost(self):
        return None


def _updates(tmp_path, critic, **settings) -> Updates:
    settings = {"save_every": 0, "journal_limit_bytes": 1 << 30, "keep_last": 2, **settings}
    return Updates(critic, journal=Journal(str(tmp_path / "serve" / "journal.jsonl")), checkpoint_root=str(tmp_path / "ck"),
                   metrics=Metrics(), crash=CrashPoints(""), say=lambda *_: None, **settings)


def test_a_load_becomes_the_latest_checkpoint_and_moves_the_later_ones_aside(tmp_path):
    """An admin load of an older state: a restart resumes it (it is the latest, never pruned), its ledger
    answers, and the checkpoints of the line it replaced are kept aside (the newest keep_last such sets)."""
    from critic_adapters.common.storage import checkpoints

    root = str(tmp_path / "ck")
    updates = _updates(tmp_path, SavingCritic(), save_every=1)
    first = updates.update(update_request(UPDATE, LIMITS))[0]
    updates.save(str(tmp_path / "snapshot"))  # version 1, with u's answer
    for index in range(3):
        updates.update(update_request({**UPDATE, "request_id": f"later-{index}"}, LIMITS))
    assert [os.path.basename(p) for p in checkpoints.complete_checkpoints(root)] == ["step_000003", "step_000004"]
    updates.load(str(tmp_path / "snapshot"))
    assert updates.version == 1
    assert checkpoints.find_latest(root) == checkpoints.step_dir(root, 1)
    assert [os.path.basename(p) for p in checkpoints.complete_checkpoints(root)] == ["step_000001"]
    (aside,) = [n for n in os.listdir(root) if n.startswith("superseded-")]
    assert sorted(os.listdir(os.path.join(root, aside))) == ["step_000003", "step_000004"]
    assert updates.update(update_request(UPDATE, LIMITS)) == (first, True)  # the snapshot's ledger
    for round_ in range(3):  # three more lines replaced: only the newest keep_last=2 sets stay
        updates.update(update_request({**UPDATE, "request_id": f"again-{round_}"}, LIMITS))
        updates.load(str(tmp_path / "snapshot"))
    assert len([n for n in os.listdir(root) if n.startswith("superseded-")]) == 2


def test_a_journal_that_cannot_be_written_hands_the_update_to_a_checkpoint(tmp_path):
    """apply -> journal fails (a full disk) -> a checkpoint records it (answered); when that fails too the
    service stops without answering, and a restart from the disk does not hold the update (its retry
    applies it once). A failing --save-every checkpoint still answers: the journal holds the update."""
    critic = SavingCritic()
    updates = _updates(tmp_path, critic, save_every=2)
    journal = updates.journal
    full = OSError(errno.ENOSPC, "No space left on device")

    def no_space(*_):
        raise full

    updates.update(update_request({**UPDATE, "request_id": "a"}, LIMITS))
    journal.append = no_space
    answer, replayed = updates.update(update_request({**UPDATE, "request_id": "b"}, LIMITS))
    assert (answer["version"], replayed) == (2, False)
    restarted = _updates(tmp_path, SavingCritic())
    restarted.resume(lambda body: update_request(body, LIMITS))
    assert restarted.version == 2 and restarted.ledger.answer("b", answer and update_request(
        {**UPDATE, "request_id": "b"}, LIMITS).digest) == answer

    critic.save_failure = full
    from critic_adapters.serve.updates import ServiceBroken
    with pytest.raises(ServiceBroken, match="neither the journal .* nor a checkpoint"):
        updates.update(update_request({**UPDATE, "request_id": "c"}, LIMITS))
    restarted = _updates(tmp_path, SavingCritic())
    restarted.resume(lambda body: update_request(body, LIMITS))
    assert restarted.version == 2 and restarted.ledger.answer("c", "any") is None

    del journal.append  # the journal writes again; the --save-every checkpoint (every 2) keeps failing
    said = []
    updates = _updates(tmp_path, critic, save_every=1)
    updates.say = said.append
    updates.resume(lambda body: update_request(body, LIMITS))
    answer, _ = updates.update(update_request({**UPDATE, "request_id": "d"}, LIMITS))
    assert answer["version"] == 3 and any("checkpoint after update 'd'" in line for line in said), said
    assert updates.metrics.checkpoint_failures == 1
    restarted = _updates(tmp_path, SavingCritic())
    restarted.resume(lambda body: update_request(body, LIMITS))
    assert restarted.version == 3  # from the checkpoint at 2 and the journal's d


def test_the_journal_cuts_a_torn_tail_and_keeps_an_update_appended_onto_one(tmp_path):
    path = tmp_path / "serve" / "journal.jsonl"
    journal = Journal(str(path))
    body = {"request_id": "x", "input_ids": [[1, 2]]}
    journal.append(body, "d1", {"version": 1})
    journal.append({**body, "request_id": "y"}, "d2", {"version": 2})
    journal.close()
    whole = path.read_bytes()
    path.write_bytes(whole + whole.splitlines(keepends=True)[0][:17])  # killed mid-line
    said = []
    assert [e["answer"]["version"] for e in Journal(str(path)).recover(said.append)] == [1, 2]
    assert path.read_bytes() == whole and "cut a torn last line (17 bytes" in said[0]
    journal = Journal(str(path))
    journal.append({**body, "request_id": "z"}, "d3", {"version": 3})  # lands after the last complete line
    assert [e["answer"]["version"] for e in Journal(str(path)).recover()] == [1, 2, 3]

    # A journal written before the cut: a torn fragment with an answered update appended onto it.
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + lines[1][:30] + lines[1] + lines[2])
    said = []
    assert [e["answer"]["version"] for e in Journal(str(path)).recover(said.append)] == [1, 2, 3]
    assert "held 30 bytes of a torn line" in said[0]
    path.write_bytes(lines[0] + b"not json\n" + lines[1])
    with pytest.raises(JournalCorrupt, match="line 2 is not a journal entry"):
        list(Journal(str(path)).recover())

    # A failed append (a full disk half-way through the line) leaves the journal as it was.
    journal = Journal(str(path))
    path.write_bytes(lines[0])
    journal = Journal(str(path))

    class HalfThenFull:
        def __init__(self, f):
            self.f = f

        def __getattr__(self, name):
            return getattr(self.f, name)

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    f = journal._open()  # noqa: SLF001 - the file the append writes
    journal._file = HalfThenFull(f)  # noqa: SLF001
    with pytest.raises(OSError):
        journal.append(body, "d", {"version": 2})
    journal._file = f  # noqa: SLF001
    assert path.read_bytes() == lines[0]
    journal.append(body, "d", {"version": 2})
    assert [e["answer"]["version"] for e in Journal(str(path)).recover()] == [1, 2]


def test_the_same_update_from_another_serialiser_is_a_retry(tmp_path):
    """The digest is over the update's meaning: ints written as floats, an explicit null value_mask, a
    value_mask equal to response_mask, other digits for the same float32 -- one update, not a 409."""
    updates = _updates(tmp_path, SavingCritic())
    first, _ = updates.update(update_request(UPDATE, LIMITS))
    rewritten = {**UPDATE, "input_ids": [[1.0, 2.0, 3.0]], "value_mask": None, "returns": [[0, 1, 1.0000000001]]}
    assert updates.update(update_request(rewritten, LIMITS)) == (first, True)
    explicit = {**UPDATE, "value_mask": UPDATE["response_mask"]}
    assert updates.update(update_request(explicit, LIMITS)) == (first, True)
    from critic_adapters.serve.ledger import Conflict
    with pytest.raises(Conflict):
        updates.update(update_request({**UPDATE, "returns": [[0.0, 1.0, 0.5]]}, LIMITS))


def test_values_queued_behind_an_offload_are_503_and_health_says_offloaded(door):
    url, critic, service = door
    batcher = service.batcher
    batcher.config = BatchingConfig(max_queue=8, batching=False)  # room for the offload and one behind it
    answers = []
    held = threading.Thread(target=lambda: answers.append(_post(url, "/v1/values", VALUES)))
    held.start()
    assert critic.entered.acquire(timeout=300)  # a values call in the engine, held
    done = threading.Event()
    batcher.submit(Kind.OFFLOAD, None, lambda result, error: done.set())  # the admin route's work, queued
    behind = threading.Thread(target=lambda: answers.append(_post(url, "/v1/values", VALUES)))
    behind.start()
    _queued(batcher, 2)  # the offload, then the values request behind it
    critic.gate.set()
    held.join(300)
    behind.join(300)
    assert done.wait(300)
    statuses = sorted((status, body.get("error", {}).get("message", "")) for status, body, _ in answers)
    assert statuses[0][0] == 200 and statuses[1][0] == 503 and "offloaded" in statuses[1][1], statuses
    status, body, _ = _post(url, "/v1/health", None, method="GET")
    assert status == 503 and body["status"] == "offloaded"
    assert _post(url, "/v1/update", UPDATE)[0] == 503


def test_a_dead_engine_thread_answers_everyone_and_stops_the_service(door):
    url, critic, service = door
    batcher = service.batcher

    class Died(BaseException):
        pass

    def die(*_, **__):
        raise Died("a bug on the engine thread")

    critic.compute_values = die
    status, body, _ = _post(url, "/v1/values", VALUES)
    assert status == 503 and "the engine thread died: Died: a bug on the engine thread" in body["error"]["message"]
    assert service.server.should_exit, "the server was not told to stop"
    status, body, _ = _post(url, "/v1/health", None, method="GET")
    assert status == 503 and body["status"] == "failed" and "engine thread died" in body["reason"]
    assert _post(url, "/v1/update", UPDATE)[0] == 503


def test_one_error_shape_for_every_refusal(door):
    url, critic, _ = door
    critic.gate.set()
    cases = [("GET", "/v1/values", None, 405), ("POST", "/v1/nowhere", {}, 404), ("POST", "/v1/values", b"[" * 200_000, 400),
             ("POST", "/v1/values", b'{"input_ids": ' + b"[" * 40 + b"]" * 40 + b"}", 400),
             ("POST", "/v1/update", {**UPDATE, "request_id": 7}, 422), ("POST", "/v1/save", {}, 403)]
    for method, path, body, expected in cases:
        status, answer, _ = _post(url, path, body, method=method)
        assert status == expected, (path, status, answer)
        assert set(answer) == {"error"} and answer["error"]["status"] == expected and answer["error"]["message"], answer
        if "field" in answer["error"]:
            assert answer["error"]["rule"], answer
    assert "nested 200000 levels deep" in _post(url, "/v1/values", b"[" * 200_000)[1]["error"]["rule"]


def test_admin_saves_never_replace_what_the_service_did_not_write(tmp_path):
    admin = "admin-token-of-the-door-test"
    critic = SavingCritic()
    _, url, stop = serve_in_thread(critic, str(tmp_path), (TOKEN, admin), limits=LIMITS)
    try:
        user_dir = tmp_path / "users-dir"
        user_dir.mkdir()
        (user_dir / "notes.txt").write_text("mine")
        status, body, _ = _post(url, "/v1/save", {"path": str(user_dir)}, token=admin)
        assert status == 409 and body["error"]["field"] == "path" and str(user_dir) in body["error"]["rule"], body
        assert (user_dir / "notes.txt").read_text() == "mine" and sorted(os.listdir(user_dir)) == ["notes.txt"]
        (tmp_path / "a-file").write_text("x")
        assert _post(url, "/v1/save", {"path": str(tmp_path / "a-file")}, token=admin)[0] == 409
        status, body, _ = _post(url, "/v1/save", {"path": "/proc/critic-checkpoint"}, token=admin)
        assert status == 422 and "cannot be written" in body["error"]["rule"], body
        assert _post(url, "/v1/save", {"path": str(tmp_path / "checkpoints" / "mine")}, token=admin)[0] == 409
        target = tmp_path / "exports" / "v0"
        for _ in range(2):  # a new directory, then over the checkpoint it wrote
            status, body, _ = _post(url, "/v1/save", {"path": str(target)}, token=admin)
            assert status == 200 and body == {"path": str(target), "version": 0}, body
        critic.save_failure = OSError(errno.ENOSPC, "No space left on device")
        status, body, _ = _post(url, "/v1/save", {}, token=admin)
        assert status == 507 and "disk is full" in body["error"]["message"], body
    finally:
        stop()


def test_a_vision_critic_takes_its_images_as_json(tmp_path):
    """multi_modal_inputs as nested lists reach a one-rank qwen2_vl engine as the processor's tensors."""
    from critic_adapters.common.engine.config import EngineConfig, ModelConfig
    from critic_adapters.common.engine.registry import build_engine
    from critic_adapters.common.parallel.distributed import init_distributed
    from critic_adapters.common.testdata.vision import save_vision_critic, vision_batch
    from critic_adapters.common.valuehead.load import load_critic
    from critic_adapters.serve.ranks import RankZeroCritic, rank_processes

    critic_dir = save_vision_critic("qwen2_vl", str(tmp_path / "critic"))
    engine = build_engine("fsdp", EngineConfig(model=ModelConfig(path=critic_dir)), init_distributed())
    config = load_critic(critic_dir)[0].config
    _, url, stop = serve_in_thread(RankZeroCritic(engine, None, timeout_s=600, processes=rank_processes(None)),
                                   str(tmp_path), (TOKEN, None), critic_config=config,
                                   limits=Limits(vocab_size=config.get_text_config().vocab_size, max_positions=4096))
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


PARSER_HOST = """
import asyncio, sys
from critic_adapters.serve.bodies import Bodies
from critic_adapters.serve.batcher import Kind
from critic_adapters.serve.schema import Limits
bodies = Bodies(limits=Limits(vocab_size=100, max_positions=None, max_rows=4096, max_tokens=1 << 24),
                critic_config=None, max_body_bytes=1 << 26, max_parsing=1, max_waiting=1)
row = [1] * 2000
raw = ('{"input_ids": %s, "attention_mask": %s}' % ([row] * 400, [row] * 400)).replace(" ", "").encode()
assert len(raw) > 1 << 20  # parsed in the parsing process
asyncio.run(bodies._parse(Kind.VALUES, raw))
print(bodies._process._processes and list(bodies._process._processes)[0], flush=True)
sys.stdin.read()
"""


def test_the_parsing_process_leaves_with_a_killed_server(tmp_path):
    # A server killed outright (SIGKILL, a crash point) cannot shut its parsing process down: the
    # process watches the server's pid (common.job.lifeline) and leaves on its own.
    import signal
    import subprocess
    import sys

    from critic_adapters.common.tests.torchrun import worker_env

    host = subprocess.Popen([sys.executable, "-c", PARSER_HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=worker_env())
    parser = int(host.stdout.readline())
    assert os.path.exists(f"/proc/{parser}")
    os.kill(host.pid, signal.SIGKILL)
    host.wait(60)
    deadline = time.monotonic() + 60
    while os.path.exists(f"/proc/{parser}") and time.monotonic() < deadline:
        time.sleep(0.2)
    gone = not os.path.exists(f"/proc/{parser}") or open(f"/proc/{parser}/stat").read().split(")")[1].split()[0] == "Z"
    assert gone, f"the parsing process {parser} outlived its server by 60 s"


if __name__ == "__main__":
    run_pytest(__file__)
