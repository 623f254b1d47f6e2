"""AReaL's RPC wire format (areal.infra.rpc.serialization, areal 1.0.4), read and written by our own code.

AReaL's client (PPOCriticControllerV2) sends `{"args": [...], "kwargs": {...}}`, each value encoded by
its serialize_value: JSON scalars, lists and dicts as they are, and typed objects
`{"type": TAG, ...}`. We read the tags that carry data (tensor, ndarray, torch_dtype) and refuse, by
name, every tag that makes AReaL's own reader import or unpickle what the payload names (dataclass,
enum, tokenizer, processor, ray_object_ref) or decode an image (pil_image): this reader never imports
a module a request names. A tensor's base64 length is checked against its shape and dtype before a
byte is decoded.

  {"type": "tensor", "data": <base64 of the C-order little-endian bytes>, "shape": [..], "dtype": "torch.<name>"}
     bfloat16 travels as float32 bytes under dtype "torch.bfloat16" (AReaL upcasts it to dump it);
     data null is a meta tensor (no values): refused.
  {"type": "ndarray", "data": <base64>, "shape": [..], "dtype": <numpy dtype.str, e.g. "<f4", "|b1">}
  {"type": "torch_dtype", "value": "torch.float32"}

Answers are written the same way (encode): tensors as "tensor" payloads, float32 little-endian.
"""

from __future__ import annotations

import base64
import binascii
import math

import numpy
import torch

from .schema import RequestError

MAX_ELEMENTS = 1 << 34
"""A shape bound (before the body-size limit bounds the bytes): its product fits every index type."""

# dtype name -> (torch dtype, bytes per element on the wire, little-endian numpy dtype of those bytes)
TENSOR_DTYPES = {
    "torch.float32": (torch.float32, 4, "<f4"),
    "torch.float64": (torch.float64, 8, "<f8"),
    "torch.float16": (torch.float16, 2, "<f2"),
    "torch.bfloat16": (torch.bfloat16, 4, "<f4"),  # float32 bytes on the wire
    "torch.int64": (torch.int64, 8, "<i8"),
    "torch.int32": (torch.int32, 4, "<i4"),
    "torch.int16": (torch.int16, 2, "<i2"),
    "torch.int8": (torch.int8, 1, "|i1"),
    "torch.uint8": (torch.uint8, 1, "|u1"),
    "torch.bool": (torch.bool, 1, "|b1"),
}
NDARRAY_DTYPES = {name: (dtype, numpy.dtype(name).itemsize, name) for name, dtype in (
    ("<f4", torch.float32), ("<f8", torch.float64), ("<f2", torch.float16), ("<i8", torch.int64), ("<i4", torch.int32),
    ("<i2", torch.int16), ("|i1", torch.int8), ("|u1", torch.uint8), ("|b1", torch.bool))}
"""numpy dtype.str (what AReaL's ndarray payload names) -> the same triple as TENSOR_DTYPES'."""

RTENSOR = "areal.infra.rpc.rtensor.RTensor"
REFUSED = {
    "dataclass": "a dataclass payload names a module to import ({class_path}); this service never imports what a "
                 "request names: send tensors, lists, numbers and strings",
    "enum": "an enum payload names a module to import ({class_path}); this service never imports what a request "
            "names",
    "tokenizer": "a tokenizer payload: the critic service has its own tokenizer and loads none from a request",
    "processor": "a processor payload: the critic service loads none from a request",
    "ray_object_ref": "a Ray object reference is a pickle: this service unpickles nothing from a request; send the "
                      "tensors inline",
    "pil_image": "an image payload: send a vision critic's images as the processor's tensors (pixel_values, "
                 "image_grid_thw)",
}
RTENSOR_REFUSED = ("an AReaL RTensor reference (shard {shard}): this service does not fetch shards from other "
                   "hosts; send the tensors inline: localize the batch first (areal.infra.rpc.rtensor.RTensor."
                   "localize), or run AReaL's rollout without the RPC tensor store, so that serialize_value writes "
                   "{{\"type\": \"tensor\", \"data\": ...}} payloads")


def decode(value, field: str = "body"):
    """A decoded AReaL value: tensors as torch tensors (CPU), lists, dicts, scalars; RequestError (4xx)
    naming the field path and the rule for anything else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [decode(item, f"{field}[{index}]") for index, item in enumerate(value)]
    if not isinstance(value, dict):
        raise RequestError(field, f"a {type(value).__name__} is not a JSON value")
    kind = value.get("type")
    if kind == "tensor":
        return _array(value, field, "a tensor", TENSOR_DTYPES)
    if kind == "ndarray":
        return _array(value, field, "an ndarray", NDARRAY_DTYPES, " (little-endian numbers or booleans)")
    if kind == "torch_dtype":
        name = value.get("value")
        if name not in TENSOR_DTYPES or set(value) != {"type", "value"}:
            raise RequestError(field, f"torch_dtype {name!r}: one of {', '.join(TENSOR_DTYPES)} is expected")
        return TENSOR_DTYPES[name][0]
    if kind == "dataclass" and value.get("class_path") == RTENSOR:
        shard = (value.get("data") or {}).get("shard") if isinstance(value.get("data"), dict) else None
        shard_id = ((shard or {}).get("data") or {}).get("shard_id") if isinstance(shard, dict) else None
        raise RequestError(field, RTENSOR_REFUSED.format(shard=str(shard_id)[:80]))
    if kind in REFUSED:
        raise RequestError(field, REFUSED[kind].format(class_path=str(value.get("class_path"))[:200]))
    return {key: decode(item, f"{field}.{key}") for key, item in value.items()}


def _shape(value: dict, field: str) -> list[int]:
    shape = value.get("shape")
    if not isinstance(shape, list) or not all(isinstance(size, int) and not isinstance(size, bool) and size >= 0
                                              for size in shape):
        raise RequestError(f"{field}.shape", "a list of non-negative integers is expected")
    if math.prod(shape) > MAX_ELEMENTS:
        raise RequestError(f"{field}.shape", f"{shape} holds more than {MAX_ELEMENTS} elements")
    return shape


def _bytes(value: dict, field: str, expected: int) -> bytes:
    """The payload's data, decoded once its base64 length is the one `expected` bytes take."""
    data = value.get("data")
    if data is None:
        raise RequestError(f"{field}.data", "null: a meta tensor has no values (send the tensor itself)")
    if not isinstance(data, str):
        raise RequestError(f"{field}.data", "a base64 string is expected")
    length = 4 * math.ceil(expected / 3)
    if len(data) != length:
        raise RequestError(f"{field}.data", f"{len(data)} base64 characters; shape {value.get('shape')} of "
                                            f"{value.get('dtype')} takes {expected} bytes, {length} characters")
    try:  # validate: characters outside the base64 alphabet are an error, not skipped
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as err:
        raise RequestError(f"{field}.data", f"not base64 ({err})") from None
    if len(raw) != expected:
        raise RequestError(f"{field}.data", f"{len(raw)} bytes decoded; {expected} expected")
    return raw


def _array(value: dict, field: str, what: str, dtypes: dict, note: str = "") -> torch.Tensor:
    """A "tensor" or "ndarray" payload: its dtype one of `dtypes` (name -> torch dtype, bytes per element,
    numpy dtype of the bytes), its data as many bytes as shape x dtype takes."""
    unknown = sorted(set(value) - {"type", "data", "shape", "dtype"})
    if unknown:
        raise RequestError(f"{field}.{unknown[0]}", f"unknown key of {what} payload (type, data, shape, dtype)")
    name = value.get("dtype")
    if name not in dtypes:
        raise RequestError(f"{field}.dtype", f"{name!r}: one of {', '.join(dtypes)} is expected{note}")
    dtype, width, wire = dtypes[name]
    shape = _shape(value, field)
    raw = _bytes(value, field, math.prod(shape) * width)
    return torch.from_numpy(numpy.frombuffer(raw, dtype=wire).copy()).reshape(shape).to(dtype)


def encode(value):
    """`value` as AReaL's deserialize_value reads it: tensors as float32 (or their integer / bool dtype)
    "tensor" payloads, lists and dicts recursively, scalars as they are."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        if tensor.is_floating_point():
            tensor = tensor.to(torch.float32)
        name = str(tensor.dtype)
        if name not in TENSOR_DTYPES:
            raise TypeError(f"no AReaL wire form for a {name} tensor")
        raw = tensor.numpy().astype(TENSOR_DTYPES[name][2], copy=False).tobytes()
        return {"type": "tensor", "data": base64.b64encode(raw).decode("ascii"), "shape": list(tensor.shape),
                "dtype": name}
    if isinstance(value, (list, tuple)):
        return [encode(item) for item in value]
    if isinstance(value, dict):
        return {str(key): encode(item) for key, item in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"no AReaL wire form for {type(value).__name__}")
