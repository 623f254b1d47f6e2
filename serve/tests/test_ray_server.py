"""The service with its ranks as Ray actors (--ray, a RayCriticGroup driven by the server's process): values of
concurrent clients equal to the in-process critic at the version they name, an update and its retry applied
once, SIGTERM exits 0."""

from __future__ import annotations

import random
import signal
import threading


from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.serve.client import CriticClient
from critic_adapters.serve.tests.service import Server, assert_values, call, random_rows, reference_critic, write_tokens


def test_ray_group_behind_the_server(tmp_path):
    user, admin = write_tokens(tmp_path)
    server = Server(tmp_path, "--ray")
    try:
        reference = reference_critic(str(tmp_path / "run" / "embedded-qwen2"))
        answers = []

        def client(index: int):
            rng, service = random.Random(index), CriticClient(server.url, user, timeout_s=300)
            for _ in range(3):
                ids, mask = random_rows(rng, rng.randint(1, 3))
                answers.append((ids, mask, *service.values(ids, mask)))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(answers) == 24
        for ids, mask, values, version in answers:
            assert version == 0
            assert_values(values, reference(ids, mask), mask, "values through the Ray group")

        update = {"request_id": "r1", "input_ids": [[3, 4, 5, 6, 7]], "attention_mask": [[1] * 5],
                  "response_mask": [[0, 0, 1, 1, 1]], "old_values": [[0.0] * 5], "returns": [[0, 0, 1.0, 1.0, 1.0]]}
        status, first, _ = call(server.url, "/v1/update", update, token=user)
        assert status == 200 and first["version"] == 1, first
        status, again, headers = call(server.url, "/v1/update", update, token=user)
        assert again == first and headers["X-Critic-Replayed"] == "true"
        assert call(server.url, "/v1/version", token=user)[1]["version"] == 1
        server.process.send_signal(signal.SIGTERM)
        assert server.wait() == 0, server.output()
        assert "stopped at version 1" in server.output()
    except BaseException:
        if server.process.poll() is None:
            server.process.kill()
        print(server.output())
        raise


if __name__ == "__main__":
    run_pytest(__file__)
