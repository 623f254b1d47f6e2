"""Benchmark the critic service: requests/s and p50 / p99 latency against concurrency, batched against
one engine call per request, and the HTTP layer against a direct compute_values, in one run.

  python -m critic_adapters.bench.serve [--nproc 2] [--concurrency 1,8,32,64] [--requests 192]
                                        [--model embedded:qwen2] [--out FILE.json]
  bazel run //bench:serve -- ...

Each values request is one rollout row of 16 to 128 tokens (random, seeded), as a rollout worker asks
for its trajectory's values. For each mode (the server batching requests into engine calls, then the
same server with --no-batching) a server is started (python -m critic_adapters.serve, --nproc ranks,
loopback) and, at each concurrency C, C client threads of this process send `requests` requests in all
(standard-library HTTP, keep-alive off, as curl would). Then the HTTP layer: a one-rank server's p50
latency at one client against the same rows' engine.compute_values in this process (one rank, the same
config). Printed last: `batching at 32 clients: <ratio>x` (requests/s batched over one call per request).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time

if __package__ in (None, ""):  # run as a file: this checkout as the package critic_adapters
    import as_a_file  # noqa: F401  (bench/as_a_file.py)


def _rows(count: int, seed: int, vocab: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        length = rng.randint(16, 128)
        out.append(([rng.randrange(vocab) for _ in range(length)], [1] * length))
    return out


class _Server:
    def __init__(self, workdir: str, nproc: int, model: str, run: str, *flags: str):
        self.token = secrets.token_urlsafe(24)
        token_file = os.path.join(workdir, "token")
        with open(token_file, "w") as f:
            f.write(self.token)
        cmd = [sys.executable, "-m", "critic_adapters.serve", "--nproc", str(nproc), "--port", "0",
               "--token-file", token_file, "--save-every", "0", f"engine.model.path={model}",
               f"trainer.run_dir={os.path.join(workdir, run)}", *flags]
        self.run_dir = os.path.join(workdir, run)
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
        lines = []
        for line in self.process.stdout:
            lines.append(line)
            found = re.search(r"serving on (http://\S+)", line)
            if found:
                self.url = found.group(1)
                break
        else:
            raise RuntimeError("the server did not start:\n" + "".join(lines))
        threading.Thread(target=lambda: [None for _ in self.process.stdout], daemon=True).start()

    def stop(self) -> None:
        import signal

        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=300)


def _load(url: str, token: str, rows: list, concurrency: int) -> dict:
    """`concurrency` threads sending every row as its own values request; requests/s and latency."""
    from critic_adapters.serve.client import CriticClient

    client = CriticClient(url, token, timeout_s=600)
    latencies, errors, lock = [], [], threading.Lock()
    work = list(enumerate(rows))

    def worker():
        while True:
            with lock:
                if not work:
                    return
                _, (ids, mask) = work.pop()
            start = time.perf_counter()
            try:
                client.values([ids], [mask])
            except Exception as err:  # noqa: BLE001 - counted
                errors.append(repr(err))
                continue
            with lock:
                latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    latencies.sort()
    return {"clients": concurrency, "requests": len(rows), "requests_per_s": len(rows) / wall,
            "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]}


def _direct(run_dir: str, rows: list, repeats: int = 3) -> float:
    """Median seconds of engine.compute_values on one row, one rank, in this process (the served config)."""
    import dataclasses

    import torch

    from critic_adapters.common.engine.config import load_train_config
    from critic_adapters.common.engine.registry import build_engine
    from critic_adapters.common.parallel.distributed import init_distributed, shutdown

    config = load_train_config([os.path.join(run_dir, "config.yaml")], [])
    model = config.engine.model.path
    if model.startswith("embedded:"):
        model = os.path.join(run_dir, f"embedded-{model.removeprefix('embedded:')}")
    engine_config = dataclasses.replace(config.engine, model=dataclasses.replace(config.engine.model, path=model))
    engine = build_engine(config.backend, engine_config, init_distributed())
    times = []
    try:
        for ids, mask in rows[: max(8, len(rows) // 8)] * repeats:
            start = time.perf_counter()
            engine.compute_values(torch.tensor([ids]), torch.tensor([mask]))
            times.append(time.perf_counter() - start)
    finally:
        engine.close()
        shutdown()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="server ranks (default 2)")
    parser.add_argument("--concurrency", default="1,8,32,64", help="client counts (default 1,8,32,64)")
    parser.add_argument("--requests", type=int, default=192, help="requests at each concurrency (default 192)")
    parser.add_argument("--model", default="embedded:qwen2", help="engine.model.path (default embedded:qwen2)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    results = {"nproc": args.nproc, "model": args.model, "requests": args.requests, "modes": {}}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as workdir:
        rows = _rows(args.requests, seed=0, vocab=1000)
        for mode, flags in (("batched", ()), ("one call per request", ("--no-batching",))):
            server = _Server(workdir, args.nproc, args.model, mode.replace(" ", "-"), *flags)
            try:
                _load(server.url, server.token, rows[:8], 1)  # warm-up
                results["modes"][mode] = [_load(server.url, server.token, rows, c) for c in levels]
            finally:
                server.stop()
            for row in results["modes"][mode]:
                print(f"{mode:>22}  {row['clients']:3d} clients: {row['requests_per_s']:7.1f} req/s, "
                      f"p50 {row['p50_ms']:7.1f} ms, p99 {row['p99_ms']:7.1f} ms", flush=True)
        one = _Server(workdir, 1, args.model, "one-rank")
        try:
            _load(one.url, one.token, rows[:8], 1)
            http = _load(one.url, one.token, rows[: max(8, len(rows) // 8)] * 3, 1)
        finally:
            one.stop()
        direct_s = _direct(one.run_dir, rows)
    results["http_layer"] = {"server_p50_ms": http["p50_ms"], "direct_compute_values_ms": 1000 * direct_s,
                             "ratio": http["p50_ms"] / (1000 * direct_s)}
    print(f"HTTP layer at one rank, one client: p50 {http['p50_ms']:.1f} ms against a direct compute_values of "
          f"{1000 * direct_s:.1f} ms ({results['http_layer']['ratio']:.2f}x)")
    batched = {row["clients"]: row["requests_per_s"] for row in results["modes"]["batched"]}
    single = {row["clients"]: row["requests_per_s"] for row in results["modes"]["one call per request"]}
    for clients in levels:
        results.setdefault("batching_speedup", {})[str(clients)] = batched[clients] / single[clients]
    if 32 in batched:
        print(f"batching at 32 clients: {batched[32] / single[32]:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
