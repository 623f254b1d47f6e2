"""What the service's tests share: a server process on loopback, raw HTTP calls, the in-process critic."""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import torch

STARTUP_S = 600  # a bound for a stuck server, not a timing assumption


def write_tokens(tmp) -> tuple[str, str]:
    """user.token and admin.token in `tmp`; returns (user, admin)."""
    for name in ("user", "admin"):
        (tmp / f"{name}.token").write_text(secrets.token_urlsafe(24) + "\n")
    return (tmp / "user.token").read_text().strip(), (tmp / "admin.token").read_text().strip()


class Server:
    """python -m critic_adapters.serve in a session of its own; its output collected by a thread."""

    def __init__(self, tmp, *flags, env: dict | None = None):
        self.tmp, self.flags = tmp, flags
        self.lines: list[str] = []
        self.ready = threading.Event()
        # Not a torchrun worker, whatever an in-process engine of another test left in the environment.
        environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                         "MASTER_ADDR", "MASTER_PORT")}
        environment.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        cmd = [sys.executable, "-m", "critic_adapters.serve", "--nproc", "2", "--port", "0",
               "--token-file", str(tmp / "user.token"), "--admin-token-file", str(tmp / "admin.token"),
               "--max-rows", "64", "--max-body-bytes", str(1 << 20), "--save-every", "0",
               f"trainer.run_dir={tmp / 'run'}", *flags]
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment,
                                        cwd=tmp, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self.ready.wait(STARTUP_S) or self.process.poll() is not None:
            self.process.kill()
            raise AssertionError("the server did not start:\n" + "".join(self.lines))
        self.url = re.search(r"serving on (http://\S+)", "".join(self.lines)).group(1)

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)
            if "serving on http://" in line:
                self.ready.set()
        self.ready.set()

    def wait(self, timeout: float = 300) -> int:
        """The exit code, once the process has ended and its output is all read."""
        code = self.process.wait(timeout=timeout)
        self._reader.join(timeout)
        return code

    def output(self) -> str:
        return "".join(self.lines)

    def rank_pid(self, rank: int) -> int:
        """The pid of a torchrun worker of this server (its RANK; a forked worker's name, its /proc
        environment being the launcher's: common.job.launcher._forked_worker)."""
        import psutil

        for child in psutil.Process(self.process.pid).children(recursive=True):
            try:
                if "critic_adapters.serve" in " ".join(child.cmdline()) and (
                        child.environ().get("RANK") == str(rank) or child.name() == f"rank-{rank}"):
                    return child.pid
            except psutil.NoSuchProcess:
                continue
        raise AssertionError(f"no rank {rank} among the server's processes")

    def kill(self) -> None:
        """SIGKILL every process of the server (its session), and wait until they are gone."""
        import psutil

        workers = psutil.Process(self.process.pid).children(recursive=True) if self.process.poll() is None else []
        try:
            os.killpg(self.process.pid, 9)
        except ProcessLookupError:  # it had ended
            pass
        self.wait()
        psutil.wait_procs(workers, timeout=120)


def call(url: str, path: str, body=None, token: str | None = None, raw: bytes | None = None, method=None):
    """(status, JSON body, headers) of one request, whatever its status."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            text = response.read().decode()
            return response.status, (json.loads(text) if text.startswith("{") else text), response.headers
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}"), err.headers


def random_rows(rng: random.Random, count: int, vocab: int = 1000) -> tuple[list, list]:
    """`count` rows of random lengths, right-padded to the longest."""
    lengths = [rng.randint(3, 40) for _ in range(count)]
    width = max(lengths)
    ids = [[rng.randrange(vocab) for _ in range(n)] + [0] * (width - n) for n in lengths]
    mask = [[1] * n + [0] * (width - n) for n in lengths]
    return ids, mask


def update_body(request_id: str, seed: int) -> dict:
    """An update of 4 random rows (responses from position 2, random returns), as a client sends it."""
    rng = random.Random(seed)
    ids, mask = random_rows(rng, 4)
    response = [[int(0 < t < sum(row) and t >= 2) for t in range(len(row))] for row in mask]
    returns = [[rng.uniform(-1, 1) * r for r in row] for row in response]
    zeros = [[0.0] * len(row) for row in mask]
    return {"request_id": request_id, "input_ids": ids, "attention_mask": mask, "response_mask": response,
            "old_values": zeros, "returns": returns}


def reference_critic(model_dir: str):
    from critic_adapters.common.valuehead import compute_values, load_critic

    model, _ = load_critic(model_dir)
    return lambda ids, mask: compute_values(model, torch.tensor(ids), torch.tensor(mask)).detach()


def assert_values(answer: list, expected: torch.Tensor, mask: list, what: str) -> None:
    got, mask = torch.tensor(answer), torch.tensor(mask).bool()
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    diff = float((got - expected).abs()[mask].max())
    assert diff <= 1e-5, f"{what}: values differ from the in-process critic by {diff}"


