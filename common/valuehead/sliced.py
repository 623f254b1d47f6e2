"""A critic checkpoint read one slice at a time: what load_critic would load, without loading it.

An engine whose ranks each keep a part of the critic (an FSDP shard, a tensor- or pipeline-parallel
partition) asks here for exactly those parts: `open_sliced` decides everything load_critic decides
(format, head, the key checks, the report) from config.json and the tensor headers alone, and
`SlicedCritic.read(name, rows)` reads a row range of one critic tensor from its safetensors file with
plain file reads (no mapping of the file: the pages read are not kept in the process). No rank
then ever holds more than its part plus one tensor in flight.

The checkpoint's key names are mapped to the critic's by transformers' own renaming
(`get_model_conversion_mapping` + `rename_source_key`, with the detected format's key_mapping),
so the names are the ones `from_pretrained` would give. transformers 5 stacks a MoE layer's
per-expert tensors into one [experts, ...] tensor (a weight converter): those are read expert by
expert (a row range of the fused tensor is a range of experts). Whatever needs more — .bin
files, another weight converter, an adapter to merge, keys that are missing, unexpected or of
another shape — is answered with a reason instead, and the caller loads the whole critic with
load_critic (which gives the authoritative error, if any).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct

import torch

from ._quiet import quiet_transformers
from .attention import per_tower, select_attn_implementation
from .checkpoint_files import tensor_bytes
from .config import DECLARED_HEAD, build_critic, critic_class, critic_head
from .errors import CriticLoadError
from .experts import describe_experts
from .load import LoadReport, _allowed_missing, check_head_change, count_nonfinite, head_tensors, plan_load
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
            done = f.readinto(tensor_bytes(buffer))
        if done != nbytes:
            raise CriticLoadError(f"{stored.file}: expected {nbytes} bytes at offset {stored.offset + start * row}, "
                                  f"read {done}; the file changed while it was being read")
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class _StackedExperts:
    """A critic tensor transformers fuses from per-expert checkpoint tensors (a MoE layer's
    `mlp.experts.gate_up_proj` [experts, gate + up rows, H] and `down_proj` [experts, H, ffn]):
    parts[k][e] is part k (gate, up) of expert e. Rows of dim 0 are experts."""

    parts: tuple[tuple[_Stored, ...], ...]

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.parts[0][0].shape
        return (len(self.parts[0]), sum(part[0].shape[0] for part in self.parts), *first[1:])

    def read(self, start: int, stop: int) -> torch.Tensor:
        """Experts [start, stop): each expert's parts read whole and concatenated, then stacked."""
        experts = [torch.cat([read_rows(part[e], 0, part[e].shape[0]) for part in self.parts])
                   for e in range(start, stop)]
        return torch.stack(experts) if experts else torch.empty((0, *self.shape[1:]), dtype=self.parts[0][0].dtype)


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
    _stored: dict[str, "_Stored | _StackedExperts"]
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
            if isinstance(stored, _StackedExperts):
                tensor = stored.read(start, stop)
            else:
                tensor = read_rows(stored, start, stop) if stored.shape else read_rows(stored, 0, 1).reshape(())
        tensor = tensor.to(self.dtypes.get(name, self.dtype)) if tensor.is_floating_point() else tensor
        if name in self._checked:
            bad = count_nonfinite(tensor)
            if bad:
                raise CriticLoadError(f"{self.report.path}: tensor {name} holds {bad} NaN/inf value(s); the checkpoint "
                                      f"is corrupt (or diverged in training): use an earlier or re-exported one")
        return tensor.contiguous()


def meta_critic(config, dtype: torch.dtype, attn: str | None = None) -> torch.nn.Module:
    """The critic load_critic builds for `config` (a critic config), with no storage: its names,
    shapes and module tree."""
    with torch.device("meta"), quiet_transformers():
        return build_critic(config, dtype=dtype, attn_implementation=per_tower(config, attn))


def _expert_stack(converter) -> list[re.Pattern] | None:
    """The source patterns (as regexes capturing the expert index) of a weight converter that
    stacks per-expert tensors (MergeModulelist(dim=0)), then concatenates its parts (Concatenate(dim=1),
    gate and up): what transformers 5 does to every MoE family's experts. None for any other converter."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations or ())
    stacks = ops[:1] and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
    concatenates = ops[1:] == [] or (len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim == 1)
    patterns = list(converter.source_patterns)
    if not (stacks and concatenates) or not all(p.count("*") == 1 for p in patterns):
        return None
    return [re.compile(re.escape(p).replace(r"\*", r"(\d+)") + "$") for p in patterns]


def _critic_names(index, model, key_mapping: dict[str, str]
                  ) -> tuple[dict[str, str], dict[str, dict[tuple[int, int], str]], str | None]:
    """({critic name: checkpoint key} as from_pretrained renames them, {fused critic name: {(part,
    expert): checkpoint key}} for experts transformers stacks, None), or ({}, {}, why not)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    transforms = get_model_conversion_mapping(model, key_mapping or None)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta_state = model.state_dict()
    names: dict[str, str] = {}
    fused: dict[str, dict[tuple[int, int], str]] = {}
    stacks = {id(c): _expert_stack(c) for c in converters}
    for key in index.tensors:
        # (the source pattern of the converter that matched, if one did)
        name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_state)
        if pattern is not None:
            converter = next(c for c in converters if pattern in c.source_patterns)
            part = list(converter.source_patterns).index(pattern)
            regexes = stacks[id(converter)]
            match = regexes[part].search(key) if regexes else None
            if match is None:
                return {}, {}, f"transformers converts {key} ({pattern} -> {converter.target_patterns}), not only " \
                               f"renames it"
            fused.setdefault(name, {})[(part, int(match.group(1)))] = key
            continue
        if name in names:
            return {}, {}, f"{key} and {names[name]} both map to {name}"
        names[name] = key
    return names, fused, None


def _stacked(parts: dict[tuple[int, int], str], locations: dict[str, _Stored]) -> _StackedExperts | str:
    """The fused tensor's per-expert pieces in order, or why they do not make a whole one."""
    count = 1 + max(e for _, e in parts)
    part_count = 1 + max(k for k, _ in parts)
    if len(parts) != count * part_count:
        return f"the checkpoint's experts are incomplete ({sorted(parts)[:3]}...)"
    stacked = _StackedExperts(tuple(tuple(locations[parts[(k, e)]] for e in range(count)) for k in range(part_count)))
    if any(len({s.shape for s in part}) != 1 for part in stacked.parts):
        return "the checkpoint's experts differ in shape"
    return stacked


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
    attn = select_attn_implementation(critic_class(config), attn_implementation, torch_dtype)
    model = meta_critic(config, torch_dtype, attn)
    key_mapping = detection.key_mapping(head_attr, include_head=not new_head)
    names, fused, why = _critic_names(index, model, key_mapping)
    if why:
        return why
    locations: dict[str, _Stored] = {}
    for file in index.weight_files:
        locations.update(_data_locations(os.path.join(path, file)))
    experts = {name: _stacked(parts, locations) for name, parts in fused.items()}
    broken = [why for why in experts.values() if isinstance(why, str)]
    if broken:
        return broken[0]
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    # The same key accounting as load_critic's (transformers' loading info, then _check_loading_info).
    mismatched = {name for name in set(shapes) & set(names) if index.tensors[names[name]].shape != shapes[name]}
    mismatched |= {name for name, stack in experts.items() if name in shapes and stack.shape != shapes[name]}
    names.update({name: next(iter(parts.values())) for name, parts in fused.items()})  # (for the key accounting)
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
    stored = {name: experts[name] if name in experts else locations[key] for name, key in names.items()
              if name in shapes and name not in unexpected}

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
