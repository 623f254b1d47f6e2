"""The service's Prometheus metrics, written in the text exposition format (version 0.0.4).

requests by route and status, latency by route, the queue's depth, and what each engine call took
(rows, tokens, requests packed into it). Updated from the event loop and the engine thread alike,
under one lock.
"""

from __future__ import annotations

import bisect
import threading

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)


class _Histogram:
    def __init__(self, buckets: tuple):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.buckets, value)
        if index < len(self.counts):
            self.counts[index] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        sep = "," if labels else ""
        for bound, count in zip(self.buckets, self.counts):
            running += count
            out.append(f'{name}_bucket{{{labels}{sep}le="{bound:g}"}} {running}')
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        braces = f"{{{labels}}}" if labels else ""
        out += [f"{name}_sum{braces} {self.sum:.6f}", f"{name}_count{braces} {self.count}"]
        return out


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.latency: dict[str, _Histogram] = {}
        self.batch = {kind: _Histogram(SIZE_BUCKETS) for kind in ("rows", "tokens", "requests")}
        self.queue_depth = 0
        self.version = 0
        self.replayed_updates = 0
        self.checkpoint_failures = 0

    def request(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[(route, status)] = self.requests.get((route, status), 0) + 1
            self.latency.setdefault(route, _Histogram(LATENCY_BUCKETS)).observe(seconds)

    def engine_call(self, rows: int, tokens: int, requests: int) -> None:
        with self._lock:
            self.batch["rows"].observe(rows)
            self.batch["tokens"].observe(tokens)
            self.batch["requests"].observe(requests)

    def set(self, **values) -> None:
        with self._lock:
            for name, value in values.items():
                setattr(self, name, value)

    def text(self) -> str:
        with self._lock:
            out = ["# HELP critic_requests_total HTTP requests answered, by route and status.",
                   "# TYPE critic_requests_total counter"]
            out += [f'critic_requests_total{{route="{route}",status="{status}"}} {count}'
                    for (route, status), count in sorted(self.requests.items())]
            out += ["# HELP critic_request_seconds Time from a request's arrival to its answer, by route.",
                    "# TYPE critic_request_seconds histogram"]
            for route, histogram in sorted(self.latency.items()):
                out += histogram.lines("critic_request_seconds", f'route="{route}"')
            for kind, histogram in self.batch.items():
                name = f"critic_engine_call_{kind}"
                out += [f"# HELP {name} {kind.capitalize()} in one engine values call (dynamic batching).",
                        f"# TYPE {name} histogram", *histogram.lines(name, "")]
            out += ["# HELP critic_queue_depth Requests waiting for the engine.", "# TYPE critic_queue_depth gauge",
                    f"critic_queue_depth {self.queue_depth}",
                    "# HELP critic_version The service's version: updates applied (one per update request).", "# TYPE critic_version gauge",
                    f"critic_version {self.version}",
                    "# HELP critic_update_retries_total Updates answered from the ledger (a retry, not applied again).",
                    "# TYPE critic_update_retries_total counter", f"critic_update_retries_total {self.replayed_updates}",
                    "# HELP critic_checkpoint_failures_total Checkpoints after an update that failed (the journal "
                    "kept the updates).", "# TYPE critic_checkpoint_failures_total counter",
                    f"critic_checkpoint_failures_total {self.checkpoint_failures}"]
            return "\n".join(out) + "\n"
