"""The HTTP door: FastAPI routes over the engine thread (serve/batcher.py). It owns only what a door
owns: auth, the body's size and schema, backpressure, and turning each outcome into a status.

  POST /v1/values   {input_ids, attention_mask[, multi_modal_inputs]} -> {values, version}
  POST /v1/update   {request_id, input_ids, attention_mask, response_mask, old_values, returns[,
                     value_mask, multi_modal_inputs]} -> {request_id, version, metrics} (a retry: the
                     first answer again, with the header X-Critic-Replayed: true)
  GET  /v1/version  -> {version};  GET /v1/health (no token) -> 200 while it answers values, else 503
  GET  /metrics     Prometheus text
  admin: POST /v1/save {path?} | /v1/load {path} | /v1/offload | /v1/onload

Statuses: 400 not JSON; 401 no or wrong token; 403 the user token on an admin route; 404/405 no such
route; 409 a request_id reused for a different update; 413 a body or request too large; 422 a field
that breaks its rule (the body names the field and the rule); 429 the queue is full (Retry-After);
503 offloaded or shutting down; 500 the engine failed (its message; the weights as they were).
"""

from __future__ import annotations

import asyncio
import hmac
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from . import schema
from .batcher import Batcher, QueueFull, Stopped
from .ledger import Conflict

ROUTES = ("/v1/values", "/v1/update", "/v1/version", "/v1/health", "/metrics", "/v1/save", "/v1/load",
          "/v1/offload", "/v1/onload")
RETRY_AFTER_S = 1


class _Refused(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None, field: str | None = None):
        super().__init__(message)
        self.status, self.message, self.headers, self.field = status, message, headers or {}, field


def _json_error(status: int, message: str, field: str | None = None, headers: dict | None = None) -> JSONResponse:
    error = {"status": status, "message": message}
    if field is not None:
        error["field"] = field
    return JSONResponse({"error": error}, status_code=status, headers=headers)


class _Counted:
    """ASGI middleware: every answer counted by route and status, with its latency (metrics.request)."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope["path"] if scope["path"] in ROUTES else "other"
            self.metrics.request(route, status[0], time.perf_counter() - start)


def build_app(batcher: Batcher, *, limits: schema.Limits, critic_config, user_token: str, admin_token: str | None,
              max_body_bytes: int, metrics) -> FastAPI:
    app = FastAPI(title="critic-adapters critic service", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Counted, metrics=metrics)
    state = {"offloaded": False}

    def authorise(request: Request, *, admin: bool) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise _Refused(401, "missing token: send Authorization: Bearer <token>", {"WWW-Authenticate": "Bearer"})
        given = token.strip().encode()
        is_admin = admin_token is not None and hmac.compare_digest(given, admin_token.encode())
        is_user = hmac.compare_digest(given, user_token.encode())
        if not (is_admin or is_user):
            raise _Refused(401, "wrong token", {"WWW-Authenticate": "Bearer"})
        if admin and not is_admin:
            raise _Refused(403, "this route needs the admin token" + ("" if admin_token else
                           " (the server was started without --admin-token-file: admin routes are off)"))

    async def read_json(request: Request, *, empty_ok: bool = False) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise schema.RequestError("body", f"{declared} bytes; at most {max_body_bytes} (--max-body-bytes)", 413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise schema.RequestError("body", f"more than {max_body_bytes} bytes (--max-body-bytes)", 413)
            chunks.append(chunk)
        raw = b"".join(chunks)
        if not raw.strip() and empty_ok:
            return {}
        return schema.parse_json(raw)

    async def engine(kind: str, payload, *, arrived: bool = False):
        """Queue work for the engine thread and wait for its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def resolve(result, error):  # on the engine thread
            def settle():
                if future.done():  # the caller went away
                    return
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)
            loop.call_soon_threadsafe(settle)

        try:
            batcher.submit(kind, payload, resolve, arrived=arrived)
        except QueueFull as err:
            raise _Refused(429, f"{err}; retry after {RETRY_AFTER_S} s", {"Retry-After": str(RETRY_AFTER_S)})
        except Stopped as err:
            raise _Refused(503, str(err))
        # shield: a caller that disconnects leaves the work to finish (an update is applied once, answered
        # to its retry from the ledger); only the answer is dropped.
        try:
            return await asyncio.shield(future)
        except Conflict:
            raise
        except ValueError as err:  # the engine's own refusal of the input: it checks before touching the weights
            raise _Refused(422, str(err)) from None
        except Exception as err:  # noqa: BLE001 - the engine failed (on every rank together): its message
            raise _Refused(500, f"{type(err).__name__}: {err}") from None

    def not_offloaded() -> None:
        if state["offloaded"]:
            raise _Refused(503, "the critic is offloaded; an admin POST /v1/onload brings it back",
                           {"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(_Refused)
    async def refused(_, err: _Refused):
        return _json_error(err.status, err.message, err.field, err.headers)

    @app.exception_handler(schema.RequestError)
    async def bad_request(_, err: schema.RequestError):
        return JSONResponse({"error": {**err.body()["error"], "message": str(err)}}, status_code=err.status)

    @app.exception_handler(Conflict)
    async def conflict(_, err: Conflict):
        return _json_error(409, str(err), "request_id")

    @app.post("/v1/values")
    async def values(request: Request):
        authorise(request, admin=False)
        not_offloaded()
        batcher.arriving(+1)  # a values call being packed waits for this one while it is read and checked
        try:
            body = await read_json(request)
            parsed = schema.values_request(body, limits, critic_config)
        except BaseException:
            batcher.arriving(-1)
            raise
        result, version = await engine("values", parsed, arrived=True)
        return {"values": result.tolist(), "version": version}

    @app.post("/v1/update")
    async def update(request: Request):
        authorise(request, admin=False)
        not_offloaded()
        body = await read_json(request)
        parsed = schema.update_request(body, limits, critic_config)
        answer, replayed = await engine("update", parsed)
        # A retry gets the first answer as it was; the header says it was not applied again.
        return JSONResponse(answer, headers={"X-Critic-Replayed": "true"} if replayed else None)

    @app.get("/v1/version")
    async def version(request: Request):
        authorise(request, admin=False)
        return {"version": batcher.version}

    @app.get("/v1/health")
    async def health():
        if state["offloaded"]:
            return JSONResponse({"status": "offloaded", "version": batcher.version}, status_code=503)
        return {"status": "ok", "version": batcher.version}

    @app.get("/metrics")
    async def prometheus(request: Request):
        authorise(request, admin=False)
        return PlainTextResponse(metrics.text(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/save")
    async def save(request: Request):
        authorise(request, admin=True)
        body = await read_json(request, empty_ok=True)
        path = schema.path_request(body) if body else None
        return await engine("save", path)

    @app.post("/v1/load")
    async def load(request: Request):
        authorise(request, admin=True)
        path = schema.path_request(await read_json(request))
        return await engine("load", path)

    @app.post("/v1/offload")
    async def offload(request: Request):
        authorise(request, admin=True)
        answer = await engine("offload", None)
        state["offloaded"] = True
        return answer

    @app.post("/v1/onload")
    async def onload(request: Request):
        authorise(request, admin=True)
        answer = await engine("onload", None)
        state["offloaded"] = False
        return answer

    @app.exception_handler(404)
    async def not_found(request: Request, _):
        return _json_error(404, f"no route {request.method} {request.url.path}; the routes are {', '.join(ROUTES)}")

    return app
