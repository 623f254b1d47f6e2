"""Request bodies read and turned into checked requests off the event loop, a bounded number at once.

/v1/health and every other request are answered while a body is parsed. A body of a rollout row or a
few (up to ON_THE_LOOP_BYTES) is parsed on the event loop: a fraction of a millisecond, less than a
hand-off to a thread costs (bench/serve.py: batched requests/s at 32 clients fell by a fifth with every
body on a thread). A larger one (up to INLINE_BYTES) is parsed on a worker thread, and a larger one
still in a parsing process (spawned on the first such body, kept): Python's JSON parser and torch's
list-to-tensor conversion hold the interpreter's lock for as long as they run (about 1.8 s for a
60 MB body, measured), which no thread can share. At most `max_parsing` bodies are read or parsed at
once; up to `max_waiting` more wait for a turn, and more than that are answered 429 with Retry-After.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os

from . import schema
from .batcher import Kind

ON_THE_LOOP_BYTES = 16 << 10
"""Bodies up to this size are parsed on the event loop (a row's values request is about 1 KiB)."""
INLINE_BYTES = 1 << 20
"""Bodies up to this size are parsed on a thread (at most a few milliseconds under the lock)."""


class Busy(Exception):
    """More bodies than the server reads at once are waiting (429)."""


class ParserGone(Exception):
    """The parsing process died (out of memory on a large body, killed): 503, the next body starts another."""


def parse(kind: Kind, raw: bytes, limits: schema.Limits, critic_config):
    """The checked request of a route's body (RequestError: the 4xx naming the field and the rule)."""
    if kind in (Kind.SAVE, Kind.OFFLOAD, Kind.ONLOAD) and not raw.strip():
        return None
    body = schema.parse_json(raw)
    if kind in (Kind.AREAL_VALUES, Kind.AREAL_UPDATE):
        from . import areal

        return (areal.values_request if kind is Kind.AREAL_VALUES else areal.update_request)(body, limits)
    if kind is Kind.VALUES:
        return schema.values_request(body, limits, critic_config)
    if kind is Kind.UPDATE:
        return schema.update_request(body, limits, critic_config)
    if kind is Kind.SAVE:
        return schema.path_request(body) if body else None
    if kind is Kind.LOAD:
        return schema.path_request(body)
    schema.empty_request(body)
    return None


_PROCESS_ARGS: tuple = ()


def _start_process(limits, critic_config, server_pid: int) -> None:
    global _PROCESS_ARGS
    import torch

    from ..common.job.lifeline import exit_when_gone

    exit_when_gone(server_pid)  # a server killed outright (SIGKILL, a crash) would leave it behind for good
    torch.set_num_threads(1)
    _PROCESS_ARGS = (limits, critic_config)


def _parse_in_process(kind: Kind, raw: bytes):
    return parse(kind, raw, *_PROCESS_ARGS)


class Bodies:
    def __init__(self, *, limits: schema.Limits, critic_config, max_body_bytes: int, max_parsing: int,
                 max_waiting: int):
        self.limits, self.critic_config, self.max_body_bytes = limits, critic_config, max_body_bytes
        self.max_waiting = max_waiting
        self._turns = asyncio.Semaphore(max_parsing)
        self._waiting = 0
        self._threads = concurrent.futures.ThreadPoolExecutor(max_parsing, thread_name_prefix="critic-parse")
        self._process: concurrent.futures.ProcessPoolExecutor | None = None

    async def read(self, request, kind: Kind):
        """The checked request of `request`'s body: Busy (429) past max_waiting, RequestError (4xx)."""
        if self._turns.locked() and self._waiting >= self.max_waiting:
            raise Busy(f"{self._waiting} requests wait for their bodies to be read (the server's --max-queue)")
        self._waiting += 1
        try:
            await self._turns.acquire()
        finally:
            self._waiting -= 1
        try:
            raw = await self._receive(request)
            return await self._parse(kind, raw)
        finally:
            self._turns.release()

    async def _receive(self, request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise schema.RequestError("body", f"{declared} bytes; at most {self.max_body_bytes} (--max-body-bytes)", 413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise schema.RequestError("body", f"more than {self.max_body_bytes} bytes (--max-body-bytes)", 413)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _parse(self, kind: Kind, raw: bytes):
        if len(raw) <= ON_THE_LOOP_BYTES:
            return parse(kind, raw, self.limits, self.critic_config)
        loop = asyncio.get_running_loop()
        if len(raw) <= INLINE_BYTES:
            return await loop.run_in_executor(self._threads, parse, kind, raw, self.limits, self.critic_config)
        if self._process is None:
            self._process = concurrent.futures.ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn"), initializer=_start_process,
                initargs=(self.limits, self.critic_config, os.getpid()))
        process = self._process
        try:
            return await asyncio.wrap_future(process.submit(_parse_in_process, kind, raw))
        except concurrent.futures.process.BrokenProcessPool:
            if self._process is process:
                self._process = None
                process.shutdown(wait=False, cancel_futures=True)
            raise ParserGone(f"the process parsing a {len(raw)}-byte body died (out of memory?); retry, or send "
                             f"smaller requests") from None

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._process is not None:
            self._process.shutdown(wait=False, cancel_futures=True)
            self._process = None
