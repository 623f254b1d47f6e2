"""The critic service through the real server on loopback, 2 torchrun ranks (python -m critic_adapters.serve):
auth; 32 concurrent clients x 5 values requests of rows of different lengths, each answer equal to the
in-process critic (load_critic + compute_values, whose values equal a one-rank engine's) at the version
it names; malformed requests answered 4xx with nothing changed; an update and its retries applied
once; Prometheus metrics; the guide's curl and client examples; SIGTERM saves and exits 0. (Crashes,
restarts and the other faults: test_faults.py.)"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading


from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.serve.client import CriticClient
from critic_adapters.serve.tests.service import (Server, assert_values, call, random_rows, reference_critic, update_body,
                                                write_tokens)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GUIDE = os.path.join(REPO, "docs", "SERVE.md")


class _DeclaredSize(int):
    """A body that declares this many bytes: the server refuses it from its headers, unread (a client that
    went on sending would meet a closed connection, as with any server that refuses early)."""


def _declared_size_call(url: str, path: str, size: int, token: str):
    import http.client
    import urllib.parse

    where = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=300)
    try:
        connection.putrequest("POST", path)
        for name, value in (("Authorization", f"Bearer {token}"), ("Content-Type", "application/json"),
                            ("Content-Length", str(size))):
            connection.putheader(name, value)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, json.loads(response.read()), response.headers
    finally:
        connection.close()


def _malformed(good_values: dict, good_update: dict) -> list[tuple[str, str, object, int]]:
    """(what, route, body (bytes: sent raw), expected status): every rule the schema has, and more."""
    v, u = good_values, good_update
    ids, mask = v["input_ids"], v["attention_mask"]
    width = len(ids[0])

    def with_(base, **changes):
        return {**json.loads(json.dumps(base)), **changes}

    def at(rows, row, col, value):
        rows = json.loads(json.dumps(rows))
        rows[row][col] = value
        return rows

    cases = [
        ("not JSON", "/v1/values", b"{input_ids: [[1]]", 400),
        ("a JSON array", "/v1/values", b"[[1, 2]]", 400),
        ("no input_ids", "/v1/values", {"attention_mask": mask}, 422),
        ("no attention_mask", "/v1/values", {"input_ids": ids}, 422),
        ("ragged rows", "/v1/values", with_(v, input_ids=[ids[0], ids[1][:-1]]), 422),
        ("mask shape differs", "/v1/values", with_(v, attention_mask=[row[:-1] for row in mask]), 422),
        ("id outside the vocabulary", "/v1/values", with_(v, input_ids=at(ids, 0, 0, 10 ** 9)), 422),
        ("negative id", "/v1/values", with_(v, input_ids=at(ids, 0, 0, -1)), 422),
        ("fractional id", "/v1/values", with_(v, input_ids=at(ids, 0, 0, 1.5)), 422),
        ("string id", "/v1/values", with_(v, input_ids=at(ids, 0, 0, "a")), 422),
        ("mask not 0/1", "/v1/values", with_(v, attention_mask=at(mask, 0, 0, 2)), 422),
        ("a row with no token", "/v1/values", with_(v, attention_mask=[[0] * width, mask[1]]), 422),
        ("unknown field", "/v1/values", with_(v, labels=ids), 422),
        ("no rows", "/v1/values", with_(v, input_ids=[], attention_mask=[]), 422),
        ("input_ids a string", "/v1/values", with_(v, input_ids="1 2 3"), 422),
        ("rows of lists", "/v1/values", with_(v, input_ids=[[[1, 2]] * width] * len(ids)), 422),
        ("null entries", "/v1/values", with_(v, attention_mask=at(mask, 0, 0, None)), 422),
        ("the body null", "/v1/values", b"null", 400),
        ("too many rows", "/v1/values", {"input_ids": [[1, 2]] * 65, "attention_mask": [[1, 1]] * 65}, 413),
        ("body over the size limit", "/v1/values", _DeclaredSize(2 << 20), 413),
        ("longer than the model's positions", "/v1/values", {"input_ids": [[1] * 513], "attention_mask": [[1] * 513]}, 422),
        ("images for a text critic", "/v1/values", with_(v, multi_modal_inputs=[{"pixel_values": [[0.0]]}, None]), 422),
        ("no request_id", "/v1/update", {k: x for k, x in u.items() if k != "request_id"}, 422),
        ("request_id a number", "/v1/update", with_(u, request_id=7), 422),
        ("response token outside attention", "/v1/update",
         with_(u, response_mask=at(u["response_mask"], 0, len(u["input_ids"][0]) - 1, 1),
               attention_mask=at(u["attention_mask"], 0, len(u["input_ids"][0]) - 1, 0)), 422),
        ("response at position 0", "/v1/update", with_(u, response_mask=at(u["response_mask"], 0, 0, 1)), 422),
        ("NaN return", "/v1/update", json.dumps(with_(u, returns=at(u["returns"], 0, 2, float("nan")))).encode(), 422),
        ("infinite old value", "/v1/update",
         json.dumps(with_(u, old_values=at(u["old_values"], 0, 2, float("inf")))).encode(), 422),
        ("returns shape differs", "/v1/update", with_(u, returns=u["returns"][:-1]), 422),
        ("value_mask outside response_mask", "/v1/update", with_(u, value_mask=at(
            [[0] * len(r) for r in u["response_mask"]], 0, 0, 1)), 422),
        ("no response token", "/v1/update", with_(u, response_mask=[[0] * len(r) for r in u["response_mask"]]), 422),
        ("admin load without a path", "/v1/load", {}, 422),
    ]
    return cases


def test_service_end_to_end(tmp_path):
    user, admin = write_tokens(tmp_path)
    server = Server(tmp_path, "--save-on-exit")
    url = server.url
    try:
        # -- auth ------------------------------------------------------------------------------------
        probe = {"input_ids": [[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]], "attention_mask": [[1] * 5, [1, 1, 1, 0, 0]]}
        assert call(url, "/v1/health")[0] == 200
        status, body, headers = call(url, "/v1/values", probe)
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer", body
        assert call(url, "/v1/values", probe, token="not-the-token")[0] == 401
        assert call(url, "/v1/version", token=admin[:-1])[0] == 401
        for route in ("/v1/save", "/v1/offload", "/v1/onload"):
            assert call(url, route, {}, token=user)[0] == 403, route
        assert call(url, "/metrics")[0] == 401

        # -- 32 concurrent clients x 5 requests, each answer = the in-process critic ------------------
        reference = reference_critic(str(tmp_path / "run" / "embedded-qwen2"))
        answers, failures = [], []

        def client(index: int):
            rng = random.Random(index)
            service = CriticClient(url, user, timeout_s=300)
            for _ in range(5):
                ids, mask = random_rows(rng, rng.randint(1, 3))
                try:
                    values, version = service.values(ids, mask)
                    answers.append((ids, mask, values, version))
                except Exception as err:  # noqa: BLE001 - collected, asserted below
                    failures.append(repr(err))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not failures, failures[:3]
        assert len(answers) == 160
        for ids, mask, values, version in answers:
            assert version == 0
            assert_values(values, reference(ids, mask), mask, "a concurrent client's answer")
        metrics = call(url, "/metrics", token=user)[1]
        calls = int(re.search(r"^critic_engine_call_requests_count (\d+)$", metrics, re.M).group(1))
        assert calls < 160, f"160 values requests took {calls} engine calls: nothing was batched"
        assert 'critic_requests_total{route="/v1/values",status="200"} 160' in metrics

        # -- malformed requests: each 4xx naming its field, nothing changed ----------------------------
        before = call(url, "/v1/values", probe, token=user)[1]
        good_update = update_body("u1", seed=1)
        for what, route, bad, expected in _malformed(probe, good_update):
            token = admin if route == "/v1/load" else user
            if isinstance(bad, _DeclaredSize):
                status, body, _ = _declared_size_call(url, route, bad, token)
            elif isinstance(bad, bytes):
                status, body, _ = call(url, route, raw=bad, token=token)
            else:
                status, body, _ = call(url, route, bad, token=token)
            assert status == expected, f"{what}: {status} {body}"
            assert body["error"].get("field") or body["error"].get("message"), f"{what}: {body}"
        after = call(url, "/v1/values", probe, token=user)[1]
        assert after == before and after["version"] == 0, "a malformed request changed the critic"
        assert call(url, "/v1/health")[0] == 200

        # -- an update, its retries: applied once ------------------------------------------------------
        service = CriticClient(url, user)
        first = service.update(**{k: x for k, x in good_update.items()})
        assert first["version"] == 1 and first["request_id"] == "u1"
        status, again, headers = call(url, "/v1/update", good_update, token=user)
        assert status == 200 and again == first and headers["X-Critic-Replayed"] == "true"
        assert service.version() == 1
        other = update_body("u1", seed=2)
        status, body, _ = call(url, "/v1/update", other, token=user)
        assert status == 409 and body["error"]["field"] == "request_id", body
        # The values after it are the critic's after that update: its export, loaded in this process.
        status, saved, _ = call(url, "/v1/save", {}, token=admin)
        assert status == 200 and saved["version"] == 1
        second = service.update(**update_body("u2", seed=3))
        assert second["version"] == 2
        probe_at_2 = call(url, "/v1/values", probe, token=user)[1]
        assert probe_at_2["version"] == 2 and probe_at_2["values"] != before["values"]

        # -- the guide's curl and Python client examples run as written ----------------------------------
        _run_guide_curl(url, tmp_path / "user.token")
        _run_guide_python(url, tmp_path / "user.token")

        # -- SIGTERM: stop accepting, finish, save, exit 0 -----------------------------------------------
        os.kill(server.process.pid, signal.SIGTERM)
        assert server.wait() == 0, server.output()
        stopping = server.output().split("stopping:")[-1]
        assert "checkpoint saved" in stopping and "stopped at version 3" in stopping, server.output()
        assert (tmp_path / "run" / "checkpoints" / "step_000003").is_dir()  # the guide's update was the third
    except BaseException:
        if server.process.poll() is None:
            os.killpg(server.process.pid, signal.SIGKILL)
        print(server.output())
        raise


def _guide_block(language: str, marker: str) -> str:
    with open(GUIDE) as f:
        text = f.read()
    blocks = re.findall(rf"```{language}\n(.*?)```", text, re.S)
    chosen = [block for block in blocks if marker in block]
    assert chosen, f"docs/SERVE.md has no {language} block with {marker!r}"
    return chosen[0]


def _run_guide_curl(url: str, token_file) -> None:
    """The guide's curl block (the one with /v1/values), with its URL and token file set."""
    script = _guide_block("bash", "curl")
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "CRITIC_URL": url, "TOKEN_FILE": str(token_file)})
    assert result.returncode == 0, result.stderr
    answers = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert answers and all("values" in a or "version" in a for a in answers), result.stdout


def _run_guide_python(url: str, token_file) -> None:
    script = _guide_block("python", "CriticClient")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "CRITIC_URL": url, "TOKEN_FILE": str(token_file)})
    assert result.returncode == 0, result.stderr
    assert "version" in result.stdout, result.stdout


if __name__ == "__main__":
    run_pytest(__file__)
