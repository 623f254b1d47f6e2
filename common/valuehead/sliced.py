"""A critic checkpoint read one slice at a time: what load_critic would load, without loading it.

An engine whose ranks each keep a part of the critic (an FSDP shard, a tensor- or pipeline-parallel
partition) asks here for exactly those parts: `open_sliced` decides everything load_critic decides
(format, head, the key checks, the report) from config.json and the tensor headers alone, and
`SlicedCritic.read(name, rows)` reads a row range of one critic tensor from its safetensors file with
plain file reads (no mapping of the file: the pages read are not kept in the process). No rank
then ever holds more than its part plus one tensor in flight.

The checkpoint's key names are mapped to the critic's by transformers' own renaming
(`get_model_conversion_mapping` + `rename_source_key`, with the detected format's key_mapping),
so the names are the ones `from_pretrained` would give. Whatever needs more than a renaming —
.bin files, a weight converter transformers applies (fused MoE experts), an adapter to merge,
keys that are missing, unexpected or of another shape — is answered with a reason instead, and
the caller loads the whole critic with load_critic (which gives the authoritative error, if any).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct

import torch

from ._quiet import quiet_transformers
from .attention import select_attn_implementation
from .config import DECLARED_HEAD, critic_class, critic_head, install_value_head
from .errors import CriticLoadError
from .experts import describe_experts
from .load import LoadReport, _allowed_missing, check_head_change, head_tensors, plan_load
from ..learning.hl_gauss import describe, support_of

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


@dataclasses.dataclass(frozen=True, slots=True)
class _Stored:
    """Where one tensor's bytes are: file, byte offset of its data, shape, dtype."""

    file: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _data_locations(path: str) -> dict[str, _Stored]:
    """Every tensor of one .safetensors file (the header was validated by index_checkpoint)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    out = {}
    for key, entry in header.items():
        if entry["dtype"] not in _DTYPES:
            raise CriticLoadError(f"{path}: tensor {key} has dtype {entry['dtype']}, which a critic cannot be "
                                  f"loaded from")
        out[key] = _Stored(path, 8 + header_len + entry["data_offsets"][0], tuple(entry["shape"]),
                           _DTYPES[entry["dtype"]])
    return out


def read_rows(stored: _Stored, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of dim 0 of a stored tensor (contiguous bytes: one read)."""
    row = math.prod(stored.shape[1:]) * stored.dtype.itemsize
    nbytes = (stop - start) * row
    out = torch.empty((stop - start, *stored.shape[1:]), dtype=stored.dtype)
    if nbytes:
        buffer = out.view(-1).view(torch.uint8) if out.dim() else out.view(1).view(torch.uint8)
        with open(stored.file, "rb", buffering=0) as f:
            f.seek(stored.offset + start * row)
            done = f.readinto(memoryview(buffer.numpy()))
        if done != nbytes:
            raise CriticLoadError(f"{stored.file}: expected {nbytes} bytes at offset {stored.offset + start * row}, "
                                  f"read {done}; the file changed while it was being read")
    return out


@dataclasses.dataclass
class SlicedCritic:
    """The critic load_critic would build from `path`, readable by tensor and row range."""

    report: LoadReport
    config: object
    """The critic's config (critic_config applied), as load_critic's model.config."""
    shapes: dict[str, tuple[int, ...]]
    """Every critic parameter (and persistent buffer) by name: its full shape."""
    dtypes: dict[str, torch.dtype]
    """... and the dtype `read` gives it."""
    dtype: torch.dtype
    _stored: dict[str, _Stored]
    _head: dict[str, torch.Tensor]
    _checked: frozenset[str]

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Critic tensor `name` (rows [start, stop) of its dim 0 when `rows` is given) in its dtype
        in the critic (`dtypes`). 1-D tensors, the embeddings and the head are refused when they hold NaN/inf,
        as load_critic refuses them."""
        if name in self._head:
            tensor = self._head[name]
            tensor = tensor if rows is None else tensor[rows[0]:rows[1]]
        else:
            stored = self._stored[name]
            start, stop = rows if rows is not None else (0, stored.shape[0] if stored.shape else 1)
            tensor = read_rows(stored, start, stop) if stored.shape else read_rows(stored, 0, 1).reshape(())
        tensor = tensor.to(self.dtypes.get(name, self.dtype)) if tensor.is_floating_point() else tensor
        if name in self._checked:
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise CriticLoadError(f"{self.report.path}: tensor {name} holds {bad} NaN/inf value(s); the checkpoint "
                                      f"is corrupt (or diverged in training): use an earlier or re-exported one")
        return tensor.contiguous()


def meta_critic(config, dtype: torch.dtype, attn: str | None = None) -> torch.nn.Module:
    """The critic load_critic builds for `config` (a critic config), with no storage: its names,
    shapes and module tree."""
    cls = critic_class(config)
    with torch.device("meta"), quiet_transformers():
        return install_value_head(cls._from_config(config, attn_implementation=attn, dtype=dtype))


def _critic_names(index, model, key_mapping: dict[str, str]) -> tuple[dict[str, str], str | None]:
    """({critic name: checkpoint key} as from_pretrained renames them, None) or ({}, why not)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    transforms = get_model_conversion_mapping(model, key_mapping or None)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta_state = model.state_dict()
    names: dict[str, str] = {}
    for key in index.tensors:
        name, converter = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_state)
        if converter is not None:
            return {}, f"transformers converts {key} ({converter}), not only renames it"
        if name in names:
            return {}, f"{key} and {names[name]} both map to {name}"
        names[name] = key
    return names, None


def open_sliced(path: str, *, torch_dtype: torch.dtype = torch.float32, attn_implementation: str | None = None,
                trust_remote_code: bool = False, head_prefix: str | None = None, fresh_head: bool = False,
                head_init_seed: int = 0, adapter_path: str | None = None,
                value_head=DECLARED_HEAD, init_from_scalar_head: bool = False) -> SlicedCritic | str:
    """The critic load_critic(path, same arguments) would build, as a SlicedCritic; or a sentence
    saying why it has to be loaded whole (then load it with load_critic). A checkpoint load_critic
    refuses for its head raises the same CriticLoadError here."""
    path = os.fspath(path)
    if adapter_path is not None:
        return "an adapter is merged into the whole weights"
    plan = plan_load(path, head_prefix=head_prefix, trust_remote_code=trust_remote_code, value_head=value_head)
    config, index, detection, head_attr = plan.config, plan.index, plan.detection, plan.head
    check_head_change(path, plan, fresh_head, init_from_scalar_head)
    if not all(name.endswith(".safetensors") for name in index.weight_files):
        return f"its weights are not safetensors ({', '.join(index.weight_files)})"
    new_head = fresh_head or plan.head_changes
    detection_before = detection
    if new_head:
        detection = dataclasses.replace(detection, head_file=None)
    attn = select_attn_implementation(critic_class(config), attn_implementation)
    model = meta_critic(config, torch_dtype, attn)
    key_mapping = detection.key_mapping(head_attr, include_head=not new_head)
    names, why = _critic_names(index, model, key_mapping)
    if why:
        return why
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    # The same key accounting as load_critic's (transformers' loading info, then _check_loading_info).
    mismatched = {name for name in set(shapes) & set(names) if index.tensors[names[name]].shape != shapes[name]}
    head_keys = {f"{head_attr}.weight", f"{head_attr}.bias"}
    if plan.head_changes:  # a stored head of the other kind is not loaded: reported unexpected
        mismatched -= head_keys
    if mismatched:
        return f"tensor shapes differ from the critic's: {sorted(mismatched)[:3]}"
    missing = sorted(set(shapes) - set(names))
    unexpected = sorted(set(names) - set(shapes) | {n for n in head_keys & set(names)
                                                    if index.tensors[names[n]].shape != shapes[n]})
    if set(missing) - _allowed_missing(detection, head_attr, new_head):
        return f"the checkpoint lacks {missing[:3]}"
    if not new_head and set(unexpected) - plan.projections:
        return f"the checkpoint holds tensors the critic does not use: {unexpected[:3]}"
    locations: dict[str, _Stored] = {}
    for file in index.weight_files:
        locations.update(_data_locations(os.path.join(path, file)))
    stored = {name: locations[key] for name, key in names.items() if name in shapes and name not in unexpected}

    score = critic_head(model)
    head, (head_state, bias_state) = head_tensors(
        head_attr, tuple(score.weight.shape), config, path, index, detection, fresh_head=fresh_head,
        head_changes=plan.head_changes, scalar_source=detection_before if plan.head_changes and init_from_scalar_head
        else None, head_init_seed=head_init_seed)
    embeddings = next(name for name, p in model.named_parameters() if p is model.get_input_embeddings().weight)
    checked = frozenset(name for name in shapes if len(shapes[name]) <= 1 or name == embeddings or name in head_keys)
    report = LoadReport(
        path=path, format=detection.format, description=detection.description, storage=detection.storage,
        family=config.model_type, critic_class=type(model).__name__, head=head_state,
        head_source=[] if head_state == "initialized" else detection.head_keys, bias=bias_state,
        attn_implementation=attn, dtype=str(torch_dtype).removeprefix("torch."),
        missing_keys=missing, unexpected_keys=unexpected, value_head=describe(support_of(config)),
        experts=describe_experts(config))
    dtypes = {name: t.dtype for name, t in model.state_dict().items()}
    return SlicedCritic(report, config, shapes, dtypes, torch_dtype, stored, head, checked)
