"""The HTTP door: FastAPI routes over the engine thread (serve/batcher.py). It owns only what a door
owns: auth, bodies (read and parsed off the event loop: serve/bodies.py), backpressure, and turning
each outcome into a status.

  POST /v1/values   {input_ids, attention_mask[, multi_modal_inputs]} -> {values, version}
  POST /v1/update   {request_id, input_ids, attention_mask, response_mask, old_values, returns[,
                     value_mask, multi_modal_inputs, minibatches]} -> {request_id, version, metrics} (a retry: the
                     first answer again, with the header X-Critic-Replayed: true)
  GET  /v1/version  -> {version};  GET /v1/health (no token) -> 200 while it answers values, else 503
  GET  /metrics     Prometheus text
  admin: POST /v1/save {path?} | /v1/load {path} | /v1/offload | /v1/onload
  AReaL's gateway routes (its PPOCriticControllerV2 drives the critic): serve/areal.py, docs/AREAL.md

Statuses: 400 not JSON (or nested too deep); 401 no or wrong token; 403 the user token on an admin
route; 404 no such route, 405 not its method; 409 a request_id reused for a different update, or a save
over a directory the service did not write; 413 a body or request too large; 422 a field that breaks
its rule; 429 the queue is full (Retry-After); 503 offloaded, shutting down, or failed (a rank gone:
the service stops); 507 the disk is full; 500 the engine failed (the rank's message), or a bug of ours.
Every 4xx / 5xx body is {"error": {"status", "message"[, "field", "rule"]}}.
"""

from __future__ import annotations

import asyncio
import hmac
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException

from . import areal, schema
from .batcher import Batcher, Kind, Offloaded, QueueFull, Stopped
from .bodies import Bodies, Busy, ParserGone
from .ledger import Conflict
from .updates import ServiceBroken

ROUTES = ("/v1/values", "/v1/update", "/v1/version", "/v1/health", "/metrics", "/v1/save", "/v1/load",
          "/v1/offload", "/v1/onload", *areal.ROUTES)
RETRY_AFTER_S = 1


class _Refused(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def error_response(status: int, message: str, *, field: str | None = None, rule: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    """Every refusal and failure, in one shape."""
    error = {"status": status, "message": message}
    if field is not None:
        error.update(field=field, rule=rule)
    return JSONResponse({"error": error}, status_code=status, headers=headers)


def _status_of(err: Exception) -> _Refused:
    """The answer to an error the engine thread or the parser raised."""
    from ..common.storage.checkpoints import caused_by_full_disk

    retry = {"Retry-After": str(RETRY_AFTER_S)}
    if isinstance(err, QueueFull | Busy):
        return _Refused(429, f"{err}; retry after {RETRY_AFTER_S} s", retry)
    if isinstance(err, Offloaded | ParserGone):
        return _Refused(503, str(err), retry)
    if isinstance(err, Stopped | ServiceBroken):
        return _Refused(503, str(err))
    if isinstance(err, OSError) and caused_by_full_disk(err):
        return _Refused(507, f"the disk is full: {err}")
    if isinstance(err, ValueError):  # the engine's own refusal of the input: it checks before touching the weights
        return _Refused(422, str(err))
    return _Refused(500, f"the engine failed: {type(err).__name__}: {err}")


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


def build_app(batcher: Batcher, bodies: Bodies, *, user_token: str, admin_token: str | None, metrics) -> FastAPI:
    app = FastAPI(title="critic-adapters critic service", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Counted, metrics=metrics)

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

    async def body_of(request: Request, kind: Kind):
        try:
            return await bodies.read(request, kind)
        except (Busy, ParserGone) as err:
            raise _status_of(err) from None

    async def engine(kind: Kind, payload, *, arrived: bool = False):
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
        except (QueueFull, Stopped, ServiceBroken) as err:
            raise _status_of(err) from None
        # shield: a caller that disconnects leaves the work to finish (an update is applied once, answered
        # to its retry from the ledger); only the answer is dropped.
        try:
            return await asyncio.shield(future)
        except (Conflict, schema.RequestError):
            raise
        except Exception as err:  # noqa: BLE001 - every other outcome is a status (_status_of)
            raise _status_of(err) from None

    def not_offloaded() -> None:
        if batcher.offloaded:
            raise _status_of(Offloaded("the critic is offloaded; an admin POST /v1/onload brings it back"))

    @app.exception_handler(_Refused)
    async def refused(_, err: _Refused):
        return error_response(err.status, err.message, headers=err.headers)

    @app.exception_handler(schema.RequestError)
    async def bad_request(_, err: schema.RequestError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(Conflict)
    async def conflict(_, err: Conflict):
        return error_response(409, str(err), field="request_id", rule="one request_id per update")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        if err.status_code == 404:
            message = (f"no route {request.method} {request.url.path}; the routes are {', '.join(ROUTES[:9])} and "
                       f"AReaL's ({', '.join(areal.ROUTES)})")
        elif err.status_code == 405:
            message = f"{request.url.path} does not take {request.method}; it takes {err.headers.get('Allow')}"
        else:
            message = str(err.detail)
        return error_response(err.status_code, message, headers=err.headers)

    @app.exception_handler(Exception)
    async def bug(_, err: Exception):
        return error_response(500, f"internal error (a bug of the service, not of the request): "
                                   f"{type(err).__name__}: {err}")

    @app.post("/v1/values")
    async def values(request: Request):
        authorise(request, admin=False)
        not_offloaded()
        batcher.arriving(+1)  # a values call being packed waits for this one while it is read and checked
        try:
            parsed = await body_of(request, Kind.VALUES)
        except BaseException:
            batcher.arriving(-1)
            raise
        result, version = await engine(Kind.VALUES, parsed, arrived=True)
        return {"values": result.tolist(), "version": version}

    @app.post("/v1/update")
    async def update(request: Request):
        authorise(request, admin=False)
        not_offloaded()
        parsed = await body_of(request, Kind.UPDATE)
        answer, replayed = await engine(Kind.UPDATE, parsed)
        # A retry gets the first answer as it was; the header says it was not applied again.
        return JSONResponse(answer, headers={"X-Critic-Replayed": "true"} if replayed else None)

    @app.get("/v1/version")
    async def version(request: Request):
        authorise(request, admin=False)
        return {"version": batcher.version}

    @app.get("/v1/health")
    async def health():
        status, body = batcher.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def prometheus(request: Request):
        authorise(request, admin=False)
        return PlainTextResponse(metrics.text(), media_type="text/plain; version=0.0.4")

    def admin_route(route: str, kind: Kind):
        @app.post(route, name=kind.value)
        async def admin(request: Request):
            authorise(request, admin=True)
            return await engine(kind, await body_of(request, kind))

    for route, kind in (("/v1/save", Kind.SAVE), ("/v1/load", Kind.LOAD), ("/v1/offload", Kind.OFFLOAD),
                        ("/v1/onload", Kind.ONLOAD)):
        admin_route(route, kind)
    areal.add_routes(app, authorise=authorise, body_of=body_of, engine=engine, not_offloaded=not_offloaded,
                     batcher=batcher, kinds=Kind)
    return app
