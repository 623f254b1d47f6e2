"""AReaL's critic protocol (areal 1.0.4's training service, PPOCriticControllerV2) mapped onto the service.

AReaL sends `{"args": [...], "kwargs": {...}}` (serve/areal_wire.py reads it) and reads `{"status":
"success", "result": ...}`. What differs from our own routes, and where it is mapped:

  alignment  AReaL's value at position t is the head's output at token t (the state after it), and its
             old values, returns and loss_mask are per position too; ours are per token, the value of
             token t being the output at t - 1. compute_values answers the engine's per-position values
             as they are; an update's per-position fields become per-token ones in one place:
             positions_to_tokens.
  loss       AReaL's ppo_critic_loss_fn: max(1/2 (v - R)^2, 1/2 (clip(v, v_old +- eps) - R)^2) summed over
             loss_mask and divided by its count over the mini-batch: our value loss with
             engine.loss.clip_range = AReaL's critic.eps_clip and agg_mode token-mean.
  steps      one update request is ppo_n_minibatches optimizer steps (--areal-minibatches; AReaL's
             default 4), the rows grouped as AReaL groups them (minibatch_groups), applied and journaled
             as one update: one version.
  ids        AReaL's update carries no id: the service names it by its content (areal-<digest>), so it is
             journaled and replayed after a crash like any update, and the same update sent again is
             answered from the ledger rather than applied twice.
"""

from __future__ import annotations

import torch
from fastapi import Request
from fastapi.responses import JSONResponse

from ..common.learning.loss import shift_to_tokens
from . import areal_wire
from .schema import (Limits, RequestError, UpdateRequest, ValuesRequest, make_update, refusing_the_unexpected,
                     update_digest)

UPDATE_KEYS = ("input_ids", "attention_mask", "values", "returns", "loss_mask")


def success(result) -> dict:
    """AReaL's answer envelope."""
    return {"status": "success", "result": areal_wire.encode(result)}


def positions_to_tokens(per_position: torch.Tensor) -> torch.Tensor:
    """AReaL's per-position field [B, T] (entry t belongs to the state after token t) as ours per token
    (entry t belongs to token t, whose value is read at t - 1): shifted right by one, entry 0 empty."""
    return shift_to_tokens(per_position)


def _trajectories(body, route: str) -> list[dict]:
    """The trajectory dicts of a compute_values / update call (args [list], or kwargs {"data": list}), the
    whole envelope decoded first: a payload this service refuses is refused wherever it sits."""
    if not isinstance(body, dict) or set(body) - {"args", "kwargs"}:
        raise RequestError("body", f"{route} takes AReaL's envelope {{\"args\": [...], \"kwargs\": {{...}}}}", 400)
    args, kwargs = body.get("args") or [], body.get("kwargs") or {}
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise RequestError("body", "args must be a list and kwargs an object")
    args, kwargs = areal_wire.decode(args, "args"), areal_wire.decode(kwargs, "kwargs")
    batch, field = (args[0], "args[0]") if args else (kwargs.get("data"), "kwargs.data")
    if not isinstance(batch, list) or not batch or not all(isinstance(item, dict) for item in batch):
        raise RequestError(field, "a non-empty list of trajectory dicts (AReaL's list[dict[str, Tensor]]) is expected")
    return batch


def _rows(trajectory: dict, key: str, field: str, shape=None) -> torch.Tensor:
    tensor = trajectory.get(key)
    if not isinstance(tensor, torch.Tensor):
        raise RequestError(f"{field}.{key}", "required: a tensor payload of [rows, positions]")
    if tensor.dim() != 2 or 0 in tensor.shape:
        raise RequestError(f"{field}.{key}", f"shape {list(tensor.shape)}: a non-empty [rows, positions] tensor is "
                                             f"expected")
    if shape is not None and tuple(tensor.shape) != shape:
        raise RequestError(f"{field}.{key}", f"shape {list(tensor.shape)} differs from input_ids' {list(shape)}")
    return tensor


def _tokens(trajectory: dict, field: str, limits: Limits) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask (int64), checked: ids in the vocabulary, a right-padded mask (AReaL
    keeps the first attention_mask.sum() tokens of a row), a token in every row."""
    if "multi_modal_input" in trajectory or "multi_modal_inputs" in trajectory:
        raise RequestError(f"{field}.multi_modal_input", "images over AReaL's routes are not served; send a vision "
                                                         "critic's rows to POST /v1/values with multi_modal_inputs")
    input_ids = _rows(trajectory, "input_ids", field)
    if input_ids.is_floating_point():
        raise RequestError(f"{field}.input_ids", f"{input_ids.dtype}: token ids are integers")
    input_ids = input_ids.long()
    mask = _rows(trajectory, "attention_mask", field, tuple(input_ids.shape))
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise RequestError(f"{field}.attention_mask", "entries must be 0 or 1")
    mask = mask.long()
    lengths = mask.sum(1)
    if bool((lengths == 0).any()):
        raise RequestError(f"{field}.attention_mask", f"row {int((lengths == 0).nonzero()[0])} has no token")
    prefix = torch.arange(mask.shape[1]) < lengths[:, None]
    if not torch.equal(mask.bool(), prefix):
        row = int((mask.bool() != prefix).any(1).nonzero()[0])
        raise RequestError(f"{field}.attention_mask", f"row {row} is not right-padded (AReaL's rows are: its tokens "
                                                      f"first, then padding)")
    outside = (input_ids < 0) | (input_ids >= limits.vocab_size)
    if bool((outside & mask.bool()).any()):
        row, col = (int(i) for i in (outside & mask.bool()).nonzero()[0])
        raise RequestError(f"{field}.input_ids", f"id {int(input_ids[row, col])} at [{row}, {col}] is outside the "
                                                 f"vocabulary [0, {limits.vocab_size})")
    return input_ids.masked_fill(~mask.bool(), 0), mask


def _stack(tensors: list[torch.Tensor], width: int) -> torch.Tensor:
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors])


def _check_size(rows: int, width: int, limits: Limits, field: str) -> None:
    if rows > limits.max_rows:
        raise RequestError(field, f"{rows} rows; at most {limits.max_rows} per request (the server's --max-rows)", 413)
    if rows * width > limits.max_tokens:
        raise RequestError(field, f"{rows} x {width} = {rows * width} padded tokens; at most {limits.max_tokens} per "
                                  f"request", 413)
    if limits.max_positions is not None and width > limits.max_positions:
        raise RequestError(field, f"rows of {width} positions; the model takes at most {limits.max_positions}")


@refusing_the_unexpected
def values_request(body, limits: Limits) -> tuple[ValuesRequest, list[tuple[int, int]]]:
    """compute_values' rows as one values request (right-padded to the widest), and each trajectory's
    (rows, positions) to cut its answer back out."""
    trajectories = _trajectories(body, "/ppo/critic/compute_values")
    ids, masks = zip(*(_tokens(t, f"args[0][{i}]", limits) for i, t in enumerate(trajectories)))
    width = max(t.shape[1] for t in ids)
    _check_size(sum(t.shape[0] for t in ids), width, limits, "args[0]")
    return ValuesRequest(_stack(list(ids), width), _stack(list(masks), width)), [tuple(t.shape) for t in ids]


def split_values(values: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Each trajectory's [rows, positions] of the engine's per-position values (padding 0.0, as AReaL's)."""
    out, start = [], 0
    for rows, width in shapes:
        out.append(values[start:start + rows, :width].clone())
        start += rows
    return out


@refusing_the_unexpected
def update_request(body, limits: Limits) -> UpdateRequest:
    """An update call as one service update of limits.areal_minibatches optimizer steps, its per-position
    fields per token (positions_to_tokens), named by its content (areal-<digest>: the same update sent
    again is answered from the ledger, not applied twice). RequestError when a field is missing or
    misshapen, when loss_mask marks a row's last position (the state after its last token: no token of
    ours carries it; AReaL's own advantage step never marks it), or when there are fewer rows than
    mini-batches (AReaL refuses that too)."""
    minibatches = limits.areal_minibatches
    trajectories = _trajectories(body, "/ppo/critic/update")
    parts = {key: [] for key in UPDATE_KEYS}
    for index, trajectory in enumerate(trajectories):
        field = f"args[0][{index}]"
        input_ids, mask = _tokens(trajectory, field, limits)
        shape = tuple(input_ids.shape)
        loss_mask = _rows(trajectory, "loss_mask", field, shape)
        if not bool(((loss_mask == 0) | (loss_mask == 1)).all()):
            raise RequestError(f"{field}.loss_mask", "entries must be 0 or 1")
        loss_mask = loss_mask.long()
        if bool((loss_mask.bool() & ~mask.bool()).any()):
            raise RequestError(f"{field}.loss_mask", "marks a position outside attention_mask")
        last = loss_mask.gather(1, (mask.sum(1) - 1)[:, None]).squeeze(1)
        if bool(last.any()):
            raise RequestError(f"{field}.loss_mask", f"row {int(last.nonzero()[0])} marks its last position: the state "
                                                     f"after its last token has no next token to be the value of "
                                                     f"(AReaL's compute_advantages rolls loss_mask left by one, so it "
                                                     f"never marks it)")
        fields = []
        for name in ("values", "returns"):
            tensor = _rows(trajectory, name, field, shape).float()
            bad = ~torch.isfinite(tensor) & loss_mask.bool()
            if bool(bad.any()):
                row, col = (int(i) for i in bad.nonzero()[0])
                raise RequestError(f"{field}.{name}", f"entry [{row}, {col}] is {tensor[row, col].item()}: values "
                                                      f"must be finite")
            fields.append(torch.where(loss_mask.bool(), tensor, 0.0))  # what the loss never reads: 0
        for key, tensor in zip(UPDATE_KEYS, (input_ids, mask, *fields, loss_mask)):
            parts[key].append(tensor)
    width = max(t.shape[1] for t in parts["input_ids"])
    input_ids, mask, values, returns, loss_mask = (_stack(parts[key], width) for key in UPDATE_KEYS)
    _check_size(input_ids.shape[0], width, limits, "args[0]")
    if input_ids.shape[0] < minibatches:
        raise RequestError("args[0]", f"{input_ids.shape[0]} rows for {minibatches} mini-batches (the server's "
                                      f"--areal-minibatches, AReaL's ppo_n_minibatches): send at least as many rows")
    if not bool(loss_mask.any()):
        raise RequestError("args[0]", "loss_mask marks no position: an update needs positions to learn from")
    tokens = [positions_to_tokens(tensor) for tensor in (loss_mask, values, returns)]
    digest = update_digest(input_ids, mask, tokens[0], tokens[1], tokens[2], tokens[0], minibatches=minibatches)
    return make_update(f"areal-{digest[:32]}", input_ids, mask, *tokens, minibatches=minibatches)


ROUTES = ("/health", "/ppo/critic/compute_values", "/ppo/critic/update", "/set_version", "/get_version", "/train",
          "/eval", "/step_lr_scheduler", "/clear_batches", "/config_perf_tracer", "/save_perf_tracer",
          "/export_stats", "/get_device_stats", "/offload", "/onload", "/save", "/load")
ACCEPTED = ("/train", "/eval", "/step_lr_scheduler", "/clear_batches", "/config_perf_tracer", "/save_perf_tracer")
"""Calls AReaL's trainer makes that have nothing to do here, answered success without reading their body:
the engine sets its own train / eval mode per call, steps its LR schedule with every optimizer step,
and keeps no batches or tracer of AReaL's."""
DEVICE_STATS = "areal.api.io_struct.DeviceRuntimeInfo"
"""The dataclass AReaL's trainer expects from get_device_stats (it calls .log on it): named in our answer
for AReaL's reader to import on its side; this service imports nothing a request names."""


def add_routes(app, *, authorise, body_of, engine, not_offloaded, batcher, kinds) -> None:
    """AReaL's gateway routes on the service's app (build_app's closures: authorise(request, admin=),
    body_of(request, kind), engine(kind, payload, arrived=), not_offloaded(); `kinds`: serve.batcher.Kind)."""
    @app.get("/health")
    async def health():
        status, body = batcher.health()
        return JSONResponse({**body, "status": "ok" if status == 200 else body["status"]}, status_code=status)

    @app.post("/ppo/critic/compute_values")
    async def compute_values(request: Request):
        authorise(request, admin=False)
        not_offloaded()
        batcher.arriving(+1)  # as /v1/values: a values call being packed waits for this one
        try:
            values_request, shapes = await body_of(request, kinds.AREAL_VALUES)
        except BaseException:
            batcher.arriving(-1)
            raise
        values, _ = await engine(kinds.VALUES, values_request, arrived=True)
        return success(split_values(values, shapes))

    @app.post("/ppo/critic/update")
    async def update(request: Request):
        authorise(request, admin=False)
        not_offloaded()
        answer, replayed = await engine(kinds.UPDATE, await body_of(request, kinds.AREAL_UPDATE))
        return JSONResponse(success(None), headers={"X-Critic-Replayed": "true"} if replayed else None)

    @app.post("/set_version")
    async def set_version(request: Request):
        authorise(request, admin=False)
        body = areal_wire.decode(await _json(request))
        version = (body.get("args") or [None])[0] if isinstance(body, dict) else None
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise RequestError("args[0]", "set_version takes one non-negative integer: {\"args\": [7], \"kwargs\": {}}")
        await engine(kinds.SET_VERSION, version)
        return success(None)

    @app.get("/get_version")
    async def get_version(request: Request):
        authorise(request, admin=False)
        return success(batcher.version)

    def accepted(route: str):
        @app.post(route, name=route.strip("/"))
        async def nothing_to_do(request: Request):
            authorise(request, admin=False)
            return success(None)

    for route in ACCEPTED:
        accepted(route)

    @app.get("/export_stats")
    async def export_stats(request: Request):
        authorise(request, admin=False)
        return success({f"ppo_critic/{name}": value for name, value in batcher.updates.last_metrics.items()
                        if value is not None})

    @app.post("/get_device_stats")
    async def device_stats(request: Request):
        authorise(request, admin=False)
        return {"status": "success", "result": _device_stats()}

    def admin(route: str, kind):
        @app.post(route, name=f"areal_{route.strip('/')}")
        async def offload_or_onload(request: Request):
            authorise(request, admin=True)  # AReaL's gateway sends its admin key on these two
            await engine(kind, None)
            return success(None)

    admin("/offload", kinds.OFFLOAD)
    admin("/onload", kinds.ONLOAD)

    def not_served(route: str):
        @app.post(route, name=f"areal_{route.strip('/')}")
        async def refused(request: Request):
            authorise(request, admin=False)
            raise RequestError("body", f"AReaL's {route} is not served: its SaveLoadMeta names a path on AReaL's "
                                       f"side and travels as a dataclass; this service checkpoints itself (every "
                                       f"--save-every updates and at exit with --save-on-exit) and an admin saves or "
                                       f"loads with POST /v1/save / /v1/load (docs/AREAL.md)", 501)

    not_served("/save")
    not_served("/load")


async def _json(request) -> dict:
    from .schema import parse_json

    raw = await request.body()
    if len(raw) > 1 << 16:
        raise RequestError("body", f"{len(raw)} bytes for a route that takes a number", 413)
    return parse_json(raw or b"{}")


def _device_stats() -> dict:
    """AReaL's DeviceRuntimeInfo payload (GB): the first CUDA device's memory, else zeros."""
    import torch

    fields = dict(mem_allocated=0.0, mem_reserved=0.0, mem_used=0.0, mem_total=0.0)
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        fields = dict(mem_allocated=torch.cuda.memory_allocated() / 2**30, mem_reserved=torch.cuda.memory_reserved() / 2**30,
                      mem_used=(total - free) / 2**30, mem_total=total / 2**30)
    return {"type": "dataclass", "class_path": DEVICE_STATS, "data": {**fields, "unit": "GB"}}
