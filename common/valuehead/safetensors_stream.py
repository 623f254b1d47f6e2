"""Write a state dict as (sharded) safetensors one tensor at a time, in any order.

A safetensors file is an 8-byte header length, a JSON header naming each tensor's dtype, shape and
byte range, then the bytes. All of it follows from names, shapes and dtypes, so the files can be
laid out before any tensor exists, and each tensor written into its place as it arrives (gathered
from shards, converted from megatron's layout) and dropped: the writer never holds more than the
tensor it is given. Files are named as transformers names them: `model.safetensors` when everything
fits in `max_shard_size`, else `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Iterable

import torch

from .checkpoint_files import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, tensor_bytes

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
"""Bytes of tensor data per file (transformers' save_pretrained default is 5 GB too)."""
_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


_UNITS = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10,
          "TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3, "T": 10**12, "G": 10**9, "M": 10**6, "K": 10**3,
          "B": 1}
SIZE_FORMS = ("bytes as an int (100000), or a number with a unit: B, KB, MB, GB, TB (powers of 1000; K, M, G, T "
              "the same) or KiB, MiB, GiB, TiB (powers of 1024), like '5GB', '500MB', '2G', '1.5GiB'")


def parse_size(size: int | str, *, key: str = "max_shard_size") -> int:
    """Bytes (> 0) from an int, a string of digits, or a size as transformers' max_shard_size takes it
    ('5GB', '500MB', '2GiB'), also with a one-letter unit ('2G': 2 * 10**9), in any letter case. `key`
    names the setting in the ValueError for anything else."""
    count = size if type(size) is int else None  # (not a bool or a float)
    if isinstance(size, str):
        text = size.strip().upper().replace(" ", "")
        unit = next((u for u in _UNITS if text.endswith(u)), "")  # longest first: "GIB" before "B"
        try:
            count = float(text[: len(text) - len(unit)]) * _UNITS.get(unit, 1)
        except ValueError:
            count = None
    if count is None or not 1 <= count < float("inf"):
        raise ValueError(f"{key}={size!r}: give {SIZE_FORMS}")
    return int(count)


def plan_shards(specs: list[TensorSpec], max_shard_size: int) -> list[list[TensorSpec]]:
    """Tensors in order, cut into files of at most max_shard_size data bytes (a larger tensor has
    a file of its own)."""
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        if shards[-1] and used + spec.nbytes > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += spec.nbytes
    return shards


class StreamingSafetensorsWriter:
    """Lay out `specs` into files under `directory`, then take each tensor with write(name, tensor)."""

    def __init__(self, directory: str, specs: list[TensorSpec], *, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE):
        unknown = [f"{s.name} ({s.dtype})" for s in specs if s.dtype not in _CODES]
        if unknown:
            raise ValueError(f"cannot write {unknown[:3]} as safetensors: no safetensors dtype")
        shards = plan_shards(specs, parse_size(max_shard_size))
        count = len(shards)
        self.files = [SAFETENSORS_SINGLE] if count == 1 else \
            [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]
        self._where: dict[str, tuple[str, int, TensorSpec]] = {}
        self._pending = {s.name for s in specs}
        self._rows: dict[str, int] = {}  # rows written so far of tensors written by rows
        self.directory = directory
        for file, shard in zip(self.files, shards):
            header, offset = {}, 0
            for spec in shard:
                header[spec.name] = {"dtype": _CODES[spec.dtype], "shape": list(spec.shape),
                                     "data_offsets": [offset, offset + spec.nbytes]}
                offset += spec.nbytes
            header["__metadata__"] = {"format": "pt"}
            encoded = json.dumps(header, separators=(",", ":")).encode()
            encoded += b" " * (-len(encoded) % 8)  # data starts 8-aligned, as safetensors writes it
            path = os.path.join(directory, file)
            with open(path, "wb") as f:
                f.write(struct.pack("<Q", len(encoded)))
                f.write(encoded)
                f.truncate(8 + len(encoded) + offset)
            start = 8 + len(encoded)
            for spec in shard:
                self._where[spec.name] = (path, start + header[spec.name]["data_offsets"][0], spec)
        if count > 1:
            total = sum(s.nbytes for s in specs)
            index = {"metadata": {"total_size": total},
                     "weight_map": {s.name: file for file, shard in zip(self.files, shards) for s in shard}}
            with open(os.path.join(directory, SAFETENSORS_INDEX), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
                f.write("\n")

    def write(self, name: str, tensor: torch.Tensor, first_row: int | None = None) -> None:
        """Write tensor `name` whole, or (first_row given) rows [first_row, first_row + len) of it:
        a tensor gathered from row shards is written shard by shard, never whole in memory."""
        if name not in self._where:
            raise ValueError(f"{name} is not one of the tensors this export was laid out for")
        if name not in self._pending:
            raise ValueError(f"{name} was written twice")
        path, offset, spec = self._where[name]
        whole = first_row is None
        rows = tensor.shape[0] if tensor.dim() else 1
        expected = spec.shape if whole else (rows, *spec.shape[1:])
        if tuple(tensor.shape) != tuple(expected) or tensor.dtype != spec.dtype or (
                not whole and (not spec.shape or not 0 <= first_row <= first_row + rows <= spec.shape[0])):
            where = "" if whole else f" rows {first_row}..{first_row + rows}"
            raise ValueError(f"{name}: laid out as {spec.dtype} {list(spec.shape)}, given {tensor.dtype} "
                             f"{list(tensor.shape)}{where}")
        row_bytes = math.prod(spec.shape[1:]) * spec.dtype.itemsize
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        with open(path, "r+b") as f:
            f.seek(offset + (0 if whole else first_row * row_bytes))
            f.write(tensor_bytes(data))
        total = spec.shape[0] if spec.shape else 1
        done = self._rows.get(name, 0) + (total if whole else rows)
        if done > total:
            raise ValueError(f"{name}: more rows written than it has ({done} of {total})")
        if done == total:
            self._pending.discard(name)
            self._rows.pop(name, None)
        else:
            self._rows[name] = done

    def close(self) -> None:
        """Check that every tensor laid out was written (every row of those written by rows)."""
        if self._pending:
            raise ValueError(f"the export is missing {len(self._pending)} tensors (e.g. {sorted(self._pending)[:3]})")


def write_streaming(directory: str, specs: list[TensorSpec], tensors: Iterable[tuple], *,
                    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> list[str]:
    """Write `tensors` laid out by `specs`: (name, tensor) pairs, or (name, rows, first_row) for
    a tensor that arrives by row blocks (its shards), each dropped once written; returns the files
    written. `tensors` is always run to its end, even after an error (the error is
    raised then): ranks that produce it together (each tensor gathered from shards) finish together."""
    error = None
    try:
        writer = StreamingSafetensorsWriter(directory, specs, max_shard_size=max_shard_size)
    except Exception as err:  # noqa: BLE001 - raised once the other ranks are done
        error, writer = err, None
    for item in tensors:
        if error is None:
            try:
                writer.write(*item)
            except Exception as err:  # noqa: BLE001 - as above
                error = err
        del item
    if error is None:
        writer.close()
        return writer.files
    raise error
