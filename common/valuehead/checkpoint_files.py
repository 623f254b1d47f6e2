"""Find a checkpoint's weight files and read tensor names and shapes without loading the tensors.

Format detection and `inspect` only need names and shapes; reading headers keeps them instant on a
70B checkpoint, and validating each header against the file size catches empty and truncated
files before anything is built.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import os
import pickle
import struct

import torch

from .errors import CriticLoadError

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_SINGLE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
# Sidecar value heads written next to a base model (LLaMA-Factory / ROLL trl mode).
SIDECAR_FILES = ("value_head.safetensors", "value_head.bin")
_SAFETENSORS_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
                         "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a memoryview, for file reads and writes in place.

    Not `memoryview(tensor.numpy())`: numpy marks the tensor's storage non-resizable for good, and a
    parameter's storage must stay resizable (offload frees it by resizing it to 0 bytes; a storage
    that cannot be resized would have to be re-pointed, which cuts the gradient hooks a library such
    as megatron's DDP holds). The view is valid while `tensor` lives."""
    assert tensor.device.type == "cpu" and tensor.is_contiguous(), "tensor_bytes takes a contiguous CPU tensor"
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B") if nbytes else memoryview(b"")


@dataclasses.dataclass(frozen=True, slots=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str
    file: str


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointIndex:
    """Every tensor of a checkpoint directory: name -> shape/dtype/file, plus how it is stored."""

    directory: str
    tensors: dict[str, TensorInfo]
    weight_files: tuple[str, ...]
    sharded: bool
    sidecar: str | None
    sidecar_tensors: dict[str, TensorInfo]


def read_safetensors_header(path: str) -> dict[str, TensorInfo]:
    """Names, shapes and dtypes of a .safetensors file, checked against the file's size."""
    size = os.path.getsize(path)
    fix = "re-export or re-download it"
    if size < 8:
        raise CriticLoadError(f"{path} is empty or truncated ({size} bytes); {fix}")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8:
            raise CriticLoadError(
                f"{path} is truncated: its header claims {header_len} bytes but the file has "
                f"{size - 8} after the length field; {fix}"
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CriticLoadError(f"{path} has a corrupt safetensors header ({err}); {fix}") from err
    header.pop("__metadata__", None)
    data_end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if 8 + header_len + data_end != size:
        raise CriticLoadError(
            f"{path} is truncated or padded: tensors need {8 + header_len + data_end} bytes, the "
            f"file has {size}; {fix}"
        )
    for key, entry in header.items():
        begin, end = entry["data_offsets"]
        itemsize = _SAFETENSORS_ITEMSIZE.get(entry["dtype"])
        if itemsize is not None and math.prod(entry["shape"]) * itemsize != end - begin:
            raise CriticLoadError(
                f"{path}: the header says tensor {key} is {entry['dtype']} of shape {entry['shape']} "
                f"({math.prod(entry['shape']) * itemsize} bytes), but its data holds {end - begin} bytes; "
                f"the file is corrupt: {fix}"
            )
    name = os.path.basename(path)
    return {
        key: TensorInfo(shape=tuple(entry["shape"]), dtype=entry["dtype"], file=name)
        for key, entry in header.items()
    }


def read_bin_header(path: str) -> dict[str, TensorInfo]:
    """Names and shapes of a torch .bin state dict, loaded onto `meta` with weights_only=True."""
    try:
        state = torch.load(path, map_location="meta", weights_only=True, mmap=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as err:
        raise CriticLoadError(f"{path} cannot be read as a weights-only torch file ({err})") from err
    name = os.path.basename(path)
    return {key: TensorInfo(tuple(t.shape), str(t.dtype), name) for key, t in state.items()}


def _read_any(path: str) -> dict[str, TensorInfo]:
    return read_safetensors_header(path) if path.endswith(".safetensors") else read_bin_header(path)


def index_checkpoint(directory: str) -> CheckpointIndex:
    """Read every tensor name/shape of a Hugging Face style checkpoint directory."""
    if not os.path.isdir(directory):
        raise CriticLoadError(f"checkpoint path {directory!r} is not a directory")

    def has(name: str) -> bool:
        return os.path.isfile(os.path.join(directory, name))

    if has(SAFETENSORS_INDEX) or has(BIN_INDEX):
        index_name = SAFETENSORS_INDEX if has(SAFETENSORS_INDEX) else BIN_INDEX
        with open(os.path.join(directory, index_name)) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = tuple(sorted(set(weight_map.values())))
        missing = [name for name in files if not has(name)]
        if missing:
            raise CriticLoadError(f"{directory}/{index_name} names shard files that are missing: {missing}")
        sharded = True
    elif has(SAFETENSORS_SINGLE):
        files, sharded = (SAFETENSORS_SINGLE,), False
    elif has(BIN_SINGLE):
        files, sharded = (BIN_SINGLE,), False
    else:
        raise CriticLoadError(
            f"{directory} holds no weights: expected {SAFETENSORS_SINGLE}, {SAFETENSORS_INDEX}, "
            f"{BIN_SINGLE} or {BIN_INDEX}"
        )

    tensors: dict[str, TensorInfo] = {}
    for name in files:
        tensors.update(_read_any(os.path.join(directory, name)))

    sidecar = next((name for name in SIDECAR_FILES if has(name)), None)
    sidecar_tensors = _read_any(os.path.join(directory, sidecar)) if sidecar else {}
    return CheckpointIndex(directory, tensors, files, sharded, sidecar, sidecar_tensors)


def load_tensors(directory: str, file: str, keys: list[str]) -> dict[str, torch.Tensor]:
    """Load only `keys` from one weight file (safetensors lazily; .bin weights-only)."""
    path = os.path.join(directory, file)
    if file.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            return {key: f.get_tensor(key) for key in keys}
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return {key: state[key] for key in keys}
