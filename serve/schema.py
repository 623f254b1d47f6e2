"""The request bodies of the critic service, checked before anything runs.

A body is JSON: nested lists, one inner list per row, every row right-padded to one length. Each
check names the field and the rule it broke (RequestError -> a 4xx whose JSON body says so), so a
client in any language can fix its request; nothing is queued, let alone applied, until the whole
body has passed. Tensors come out on the CPU, as the engines take them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re

import numpy
import torch

MAX_REQUEST_ID = 200
"""Characters of a request_id (it is kept in the ledger and the journal)."""
MAX_DEPTH = 32
"""Nesting of a JSON body: rows of numbers are 3 levels deep, a vision row's pixels a few more."""


class RequestError(ValueError):
    """A request the service refuses: HTTP `status`, the `field` at fault and the `rule` it broke."""

    def __init__(self, field: str, rule: str, status: int = 422):
        super().__init__(f"{field}: {rule}")
        self.field, self.rule, self.status = field, rule, status

    def body(self) -> dict:
        return {"error": {"status": self.status, "message": str(self), "field": self.field, "rule": self.rule}}

    def __reduce__(self):  # raised in a parsing process (serve/bodies.py), re-raised in the server's
        return type(self), (self.field, self.rule, self.status)


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """What the model and the service accept in one request."""

    vocab_size: int
    max_positions: int | None
    max_rows: int = 256
    max_tokens: int = 65536
    """Rows x padded length of one request."""
    areal_minibatches: int = 4
    """Optimizer steps of one AReaL update request (--areal-minibatches: AReaL's ppo_n_minibatches; serve/areal.py)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ValuesRequest:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    multi_modal_inputs: tuple | None = None

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())


@dataclasses.dataclass(frozen=True, slots=True)
class UpdateRequest:
    request_id: str
    digest: str
    """sha256 of the update's content: a retry under the same id must carry the same update."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    old_values: torch.Tensor
    returns: torch.Tensor
    value_mask: torch.Tensor | None = None
    multi_modal_inputs: tuple | None = None
    minibatches: int = 1
    """Optimizer steps the update takes, one per mini-batch of its rows (serve/updates.py's
    minibatch_groups: AReaL's grouping); one update, one version, whatever the count."""

    def to_json(self) -> dict:
        """The body this request came from (what the journal keeps to apply it again)."""
        out = {"request_id": self.request_id}
        if self.minibatches != 1:
            out["minibatches"] = self.minibatches
        for name in _UPDATE_FIELDS:
            tensor = getattr(self, name)
            if tensor is not None:
                out[name] = tensor.tolist()
        if self.multi_modal_inputs is not None:
            out["multi_modal_inputs"] = [{k: v.tolist() for k, v in row.items()} or None
                                         for row in self.multi_modal_inputs]
        return out


_UPDATE_FIELDS = ("input_ids", "attention_mask", "response_mask", "old_values", "returns", "value_mask")


def parse_json(raw: bytes) -> dict:
    depth = nesting_depth(raw)
    if depth > MAX_DEPTH:
        raise RequestError("body", f"JSON nested {depth} levels deep; at most {MAX_DEPTH}", 400)
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RequestError("body", f"not valid JSON ({err})", 400) from None
    if not isinstance(body, dict):
        raise RequestError("body", f"a JSON object is expected, got {type(body).__name__}", 400)
    return body


_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # unrolled: linear, no backtracking on long strings


def nesting_depth(raw: bytes) -> int:
    """How deep the brackets of a JSON text nest (outside strings), without parsing it: the parser
    recurses once a level, so a body of 200,000 '[' must be refused before it."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    steps = numpy.frombuffer(brackets, dtype=numpy.uint8)
    # "[" 0x5B and "{" 0x7B open; "]" 0x5D and "}" 0x7D close
    return int(numpy.cumsum(numpy.where((steps & 0x04) == 0, 1, -1), dtype=numpy.int64).max())


def _rows(body: dict, field: str, *, required: bool = True, shape: tuple[int, int] | None = None) -> list | None:
    """body[field] as a rectangular list of lists (checked: a list of rows, every row a list of the same
    length, and `shape` when given)."""
    value = body.get(field)
    if value is None:
        if required:
            raise RequestError(field, "required: a list of rows, each a list of numbers")
        return None
    if not isinstance(value, list) or not value:
        raise RequestError(field, "must be a non-empty list of rows")
    width = None
    for index, row in enumerate(value):
        if not isinstance(row, list):
            raise RequestError(field, f"row {index} is a {type(row).__name__}, not a list")
        if width is None:
            width = len(row)
        elif len(row) != width:
            raise RequestError(field, f"ragged rows: row 0 has {width} entries, row {index} has {len(row)}; "
                                      f"right-pad every row to one length (attention_mask 0 on the padding)")
    if width == 0:
        raise RequestError(field, "rows are empty")
    if shape is not None and (len(value), width) != shape:
        raise RequestError(field, f"shape [{len(value)}, {width}] differs from input_ids' [{shape[0]}, {shape[1]}]")
    return value


def _tensor(rows: list, field: str, dtype: torch.dtype) -> torch.Tensor:
    try:
        tensor = torch.tensor(rows, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise RequestError(field, "every entry must be a number") from None
    if tensor.dim() != 2:
        raise RequestError(field, f"rows of numbers are expected, got {tensor.dim()} levels of lists")
    if dtype == torch.float32:
        bad = ~torch.isfinite(tensor)
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            raise RequestError(field, f"entry [{row}, {col}] is {tensor[row, col].item()}: values must be finite")
        return tensor.to(torch.float32)
    if not bool((tensor == tensor.round()).all()):
        raise RequestError(field, "entries must be integers")
    return tensor.to(dtype)


def _mask(body: dict, field: str, shape, *, required: bool = True) -> torch.Tensor | None:
    rows = _rows(body, field, required=required, shape=shape)
    if rows is None:
        return None
    mask = _tensor(rows, field, torch.long)
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise RequestError(field, "entries must be 0 or 1")
    return mask


def _tokens(body: dict, limits: Limits) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = _tensor(_rows(body, "input_ids"), "input_ids", torch.long)
    rows, width = input_ids.shape
    if rows > limits.max_rows:
        raise RequestError("input_ids", f"{rows} rows; at most {limits.max_rows} per request (split it)", 413)
    if rows * width > limits.max_tokens:
        raise RequestError("input_ids", f"{rows} x {width} = {rows * width} padded tokens; at most "
                                        f"{limits.max_tokens} per request (split it)", 413)
    if limits.max_positions is not None and width > limits.max_positions:
        raise RequestError("input_ids", f"rows of {width} tokens; the model takes at most {limits.max_positions}")
    outside = (input_ids < 0) | (input_ids >= limits.vocab_size)
    if bool(outside.any()):
        row, col = (int(i) for i in outside.nonzero()[0])
        raise RequestError("input_ids", f"id {int(input_ids[row, col])} at [{row}, {col}] is outside the vocabulary "
                                        f"[0, {limits.vocab_size})")
    attention_mask = _mask(body, "attention_mask", (rows, width))
    if bool((attention_mask.sum(1) == 0).any()):
        raise RequestError("attention_mask", f"row {int((attention_mask.sum(1) == 0).nonzero()[0])} has no token")
    return input_ids, attention_mask


def _images(body: dict, input_ids: torch.Tensor, attention_mask: torch.Tensor, critic_config) -> tuple | None:
    """multi_modal_inputs, one dict of the processor's tensors (nested lists) or null per row, checked
    against the rows' placeholders as the engines check them (a text critic refuses images; a vision
    critic refuses placeholders without pixels)."""
    from ..common.valuehead.multimodal import as_rows, check_rows

    value = body.get("multi_modal_inputs")
    try:
        if value is not None and not isinstance(value, list):
            raise ValueError("must be a list with one object (or null) per row")
        rows = as_rows(value, input_ids.shape[0])
        if critic_config is not None:
            check_rows(critic_config, input_ids, attention_mask, rows)
    except (ValueError, TypeError, RuntimeError) as err:
        raise RequestError("multi_modal_inputs", str(err)) from None
    return rows


def _unknown(body: dict, allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise RequestError(unknown[0], f"unknown field; the route takes {', '.join(allowed)}")


def refusing_the_unexpected(parse):
    """A body that breaks a check this module did not foresee is still the caller's: a 422, never a 500."""
    import functools

    @functools.wraps(parse)
    def checked(body, *args, **kwargs):
        try:
            return parse(body, *args, **kwargs)
        except RequestError:
            raise
        except (TypeError, ValueError, RuntimeError, IndexError, KeyError, OverflowError) as err:
            raise RequestError("body", f"cannot be read as this route's request ({type(err).__name__}: {err})") from None
    return checked


@refusing_the_unexpected
def values_request(body: dict, limits: Limits, critic_config=None) -> ValuesRequest:
    _unknown(body, ("input_ids", "attention_mask", "multi_modal_inputs"))
    input_ids, attention_mask = _tokens(body, limits)
    return ValuesRequest(input_ids, attention_mask, _images(body, input_ids, attention_mask, critic_config))


@refusing_the_unexpected
def update_request(body: dict, limits: Limits, critic_config=None) -> UpdateRequest:
    _unknown(body, ("request_id", *_UPDATE_FIELDS, "multi_modal_inputs", "minibatches"))
    request_id = body.get("request_id")
    if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID:
        raise RequestError("request_id", f"required: a non-empty string of at most {MAX_REQUEST_ID} characters, "
                                         f"unique per update (a retry sends the same one)")
    input_ids, attention_mask = _tokens(body, limits)
    shape = tuple(input_ids.shape)
    response_mask = _mask(body, "response_mask", shape)
    if bool((response_mask.bool() & ~attention_mask.bool()).any()):
        row, col = (int(i) for i in (response_mask.bool() & ~attention_mask.bool()).nonzero()[0])
        raise RequestError("response_mask", f"[{row}, {col}] marks a token outside attention_mask")
    if bool(response_mask[:, 0].any()):
        raise RequestError("response_mask", "marks position 0: a response token needs a token before it")
    if not bool(response_mask.any()):
        raise RequestError("response_mask", "marks no token: an update needs response tokens to learn from")
    value_mask = _mask(body, "value_mask", shape, required=False)
    if value_mask is not None and bool((value_mask.bool() & ~response_mask.bool()).any()):
        raise RequestError("value_mask", "marks a token outside response_mask (it must be a subset of it)")
    old_values = _tensor(_rows(body, "old_values", shape=shape), "old_values", torch.float32)
    returns = _tensor(_rows(body, "returns", shape=shape), "returns", torch.float32)
    images = _images(body, input_ids, attention_mask, critic_config)
    minibatches = body.get("minibatches", 1)
    if not isinstance(minibatches, int) or isinstance(minibatches, bool) or not 1 <= minibatches <= shape[0]:
        raise RequestError("minibatches", f"an integer from 1 to the {shape[0]} rows: the update's optimizer steps, "
                                          f"one per mini-batch of its rows")
    return make_update(request_id, input_ids, attention_mask, response_mask, old_values, returns, value_mask, images,
                       minibatches)


def make_update(request_id: str, input_ids, attention_mask, response_mask, old_values, returns, value_mask=None,
                images=None, minibatches: int = 1) -> UpdateRequest:
    """An UpdateRequest of checked tensors, with the digest of its meaning (update_digest)."""
    digest = update_digest(input_ids, attention_mask, response_mask, old_values, returns,
                           response_mask if value_mask is None else value_mask, images=images, minibatches=minibatches)
    return UpdateRequest(request_id, digest, input_ids, attention_mask, response_mask, old_values, returns,
                         value_mask, images, minibatches)


def update_digest(*tensors: torch.Tensor, images: tuple | None = None, minibatches: int = 1) -> str:
    """sha256 of an update by its meaning: each field's shape, dtype and values as the engine takes them
    (so 1 and 1.0, 0.1 written in any number of digits, an absent value_mask and one equal to
    response_mask, are the same update), not by the bytes a client's serialiser wrote; its step count
    when it takes more than one."""
    digest = hashlib.sha256()
    if minibatches != 1:
        digest.update(f"minibatches={minibatches};".encode())

    def add(tensor: torch.Tensor) -> None:
        digest.update(f"{tuple(tensor.shape)}{tensor.dtype};".encode())
        digest.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())

    for tensor in tensors:
        add(tensor)
    for row in images or ():
        digest.update(b"|row")
        for key in sorted(row):
            digest.update(key.encode())
            add(row[key])
    return digest.hexdigest()


def finite_or_none(value: float) -> float | None:
    """A metric as JSON can carry it (NaN and infinities are not JSON)."""
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def empty_request(body: dict) -> None:
    """A route that takes no fields: {} (or no body at all)."""
    if body:
        raise RequestError(sorted(body)[0], "unknown field; the route takes no fields (send {} or nothing)")


def path_request(body: dict) -> str:
    path = body.get("path")
    if not isinstance(path, str) or not path:
        raise RequestError("path", "required: a directory path (on the server's machine)")
    _unknown(body, ("path",))
    return path
