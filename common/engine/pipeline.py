"""The one pipeline every backend runs to build its critic, in this order:

  1. load      common.valuehead.load_critic: any critic format, the head checks, the load report
               (the HL-Gauss head, engine.loss.kind=hl_gauss, is built here: the head's shape is
               part of the checkpoint format, config.critic_value_head);
  2. transform engine_transforms(config), applied in order by common.engine.transforms.apply_transforms:
               engine.transforms (freezing, a host's own), then LoRA (engine.lora.rank > 0);
  3. parallelise the backend's own: FSDP2 over the mesh's shard group (fsdp: backends/fsdp/
               sharded_load.py; VeOmni: its parallelize), or megatron's module, which follows the
               transforms (convert.follow_frozen, LoRA as megatron adapters);
  4. optimize  over the trainable parameters only (common.engine.transforms.trainable_parameters).

With several shard ranks (fsdp and VeOmni alike), every rank builds the tree with its parameters on
the meta device, applies the transforms and parallelises it; stage 1 then reads from the checkpoint
only the rows of each rank's shards (common.valuehead.sliced: load_critic's decisions from the
headers, the rows by plain file reads). A checkpoint that cannot be read by slices (.bin weights,
transformers' weight converters, an adapter to merge) or transforms that add tensors (LoRA) run
stages 1 and 2 on the shard group's first rank (`load_on_first_rank`), which sends every other rank
its shards tensor by tensor (common.parallel.shard_state.broadcast_state_into). megatron reads its
partitions the same way (backends/megatron/convert.py).

At export the transforms run backwards (common.engine.transforms.export_state_dict): the HF export is the
plain critic whatever the pipeline added. This module decides the transform stage's order; it may
import common's transform implementations (transforms, lora) and the layers below the engine.
"""

from __future__ import annotations

import contextlib

from collections.abc import Callable

import torch

from ..parallel.distributed import broadcast_object, sendable_error
from ..parallel.host_memory import large_allocations_returned
from ..parallel.shard_state import broadcast_state_into, fill_from_reader
from .transforms import apply_transforms


def engine_transforms(config) -> list:
    """The transforms an engine with EngineConfig `config` applies, in order: engine.transforms,
    then LoRA when engine.lora.rank > 0 (names or ModelTransforms, for apply_transforms)."""
    items = list(config.transforms)
    if config.lora.rank:
        from .lora import lora_transform

        items.append(lora_transform(config.lora))
    return items


def load_on_first_rank(path: str, *, group, rank: int, dtype: torch.dtype, attn_implementation: str | None,
                       load_kwargs: dict, transform: Callable[[torch.nn.Module], torch.nn.Module]):
    """(the transformed critic's full state — parameters and buffers, non-persistent ones too — on
    the group's first rank, None elsewhere; load_critic's report, on every rank). Stages 1 and 2 of
    the pipeline for a sharded build. A load the first rank refuses raises that error on every rank
    (the others would otherwise wait in the next collective)."""
    from ..valuehead import load_critic

    full_state = report = error = None
    if rank == 0:
        try:
            loaded, report = load_critic(path, torch_dtype=dtype, attn_implementation=attn_implementation,
                                         **load_kwargs)
            loaded = transform(loaded)
            full_state = dict(loaded.named_parameters(remove_duplicate=False))
            full_state.update(loaded.named_buffers(remove_duplicate=False))  # rotary inv_freq: not in a state dict
            del loaded
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            error = sendable_error(err)
    report, error = broadcast_object((report, error), group=group)
    if error is not None:
        raise error
    return full_state, report


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside have their parameters on the meta device (no storage) and their buffers
    real: rotary frequencies and other buffers no checkpoint holds are computed as in a plain
    build. Each parameter is moved as it is registered, before the module's init writes it."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


@large_allocations_returned()
def build_sharded(path: str, *, shard_group, shard_rank: int, device: torch.device, dtype: torch.dtype,
                  attn_implementation: str | None, load_kwargs: dict, transforms: list,
                  build_tree: Callable[[object], torch.nn.Module],
                  parallelize: Callable[[torch.nn.Module], torch.nn.Module], cpu_offload: bool = False):
    """(the critic, load_critic's report): the pipeline's load, transform and parallelise stages for
    an engine whose parameters are sharded over `shard_group` (fsdp, VeOmni). Every rank builds the
    critic's module tree (`build_tree(report)`: parameters on meta, buffers real), applies the
    transforms, parallelises it and materialises its shards on `device` (its parameters on the CPU
    when `cpu_offload`: `parallelize` applied FSDP2's CPUOffloadPolicy, which keeps the shards in
    host memory and refuses them anywhere else; the buffers stay on `device`, as torchtitan does); then

      - every rank reads from the checkpoint only the rows of its shards (common.valuehead.sliced),
        when the checkpoint allows it and every tensor of the transformed tree is one of the
        critic's (freezing keeps the names; LoRA's new tensors do not);
      - otherwise the group's first rank loads and transforms the whole critic
        (load_on_first_rank) and every rank receives its part tensor by tensor.

    Either way no rank but (in the second case) the first holds more than its shards plus one tensor
    in flight."""
    from ..valuehead.sliced import open_sliced

    sliced = open_sliced(path, torch_dtype=dtype, attn_implementation=attn_implementation, **load_kwargs)
    transform = lambda critic: apply_transforms(critic, transforms)  # noqa: E731
    if isinstance(sliced, str):  # read whole: the first rank's load decides the report (and any error)
        full_state, report = load_on_first_rank(path, group=shard_group, rank=shard_rank, dtype=dtype,
                                                attn_implementation=attn_implementation, load_kwargs=load_kwargs,
                                                transform=transform)
    else:
        full_state, report = None, sliced.report
    tree = transform(build_tree(report))
    # Buffers no checkpoint holds (rotary frequencies), as the tree computed them: to_empty drops them.
    persistent = set(tree.state_dict())
    buffers = {name: b.detach().clone() for name, b in tree.named_buffers(remove_duplicate=False)
               if name not in persistent and not b.is_meta}
    names = {name for name, _ in tree.named_parameters(remove_duplicate=False)}
    names |= {name for name, _ in tree.named_buffers(remove_duplicate=False)} - set(buffers)
    model = parallelize(tree)
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        _materialise(model, device, parameters_on_cpu=cpu_offload)
    if not isinstance(sliced, str) and names <= set(sliced.shapes):
        unfilled = sorted(set(sliced.shapes) - names)
        if unfilled:  # as broadcast_state_into: a tensor the module lacks is an error, never dropped
            raise ValueError(f"the critic's tree has no {unfilled[:5]}, which the checkpoint's critic has: the "
                             f"backend built a different model")
        fill_from_reader(model, sliced.read, buffers, group=shard_group)
        return model, report
    if not isinstance(sliced, str):  # the transforms added tensors (LoRA): their values come from the first rank
        full_state, _ = load_on_first_rank(path, group=shard_group, rank=shard_rank, dtype=dtype,
                                           attn_implementation=attn_implementation, load_kwargs=load_kwargs,
                                           transform=transform)
    broadcast_state_into(model, full_state, group=shard_group, device=device)
    del full_state
    return model, report


def _materialise(model: torch.nn.Module, device: torch.device, *, parameters_on_cpu: bool) -> None:
    """Give a (parallelised) meta tree storage, uninitialised: on `device`, or with
    `parameters_on_cpu` its parameters on the CPU and its buffers on `device`."""
    model.to_empty(device="cpu" if parameters_on_cpu else device)
    if parameters_on_cpu and torch.device(device).type != "cpu":
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(device)
