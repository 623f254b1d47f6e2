"""CPU compatibility for megatron-core 0.16.1: every shim this backend needs when CUDA is absent.

megatron-core assumes CUDA in a handful of places (measured in shared/notes/megatron-feasibility.md).
`enable_cpu_shims()` patches them (`disable_cpu_shims()` puts every original back when the last
engine using them closes), and `cuda_to_cpu()` is a context manager for the code paths
that allocate with `device="cuda"` (optimizer construction and step, the pipeline schedules).
Both do nothing when CUDA is available (on GPU this backend runs plain megatron-core), but for one
name megatron's MoE router needs whenever TransformerEngine is absent (_without_te_shims).
Two contexts around checkpointing apply on every device and sit at the end: adam_step_kept (a load
fault with torch's Adam, which a GPU without TransformerEngine or Apex runs too) and
library_deprecations_quiet (the load's FutureWarnings about torch APIs megatron-core itself calls).
(Saves no longer go through megatron's own writer, whose results queue started a multiprocessing
Manager: checkpoint._streaming_strategy.)

The shims, and why each exists (in megatron-core 0.16.1):
  1. RNG tracker: `model_parallel_cuda_manual_seed` uses torch.cuda RNG states, and every attention
     forward forks the tracker. `_CpuRNGStatesTracker` keeps CPU
     generator states under the same names and seeds.
  2. `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()`.
  3. `GlobalMemoryBuffer.get_tensor` allocates on `torch.cuda.current_device()`.
  4. `torch.cuda.current_device()` is used as a device by DDP buffers and the sequence-parallel
     gather/scatter: it returns cpu here.
  5. `torch.cuda.synchronize` / `empty_cache` become no-ops.
  6. `clip_grad_by_total_norm_fp32` asserts `torch.cuda.FloatTensor` grads: a
     device-neutral replacement, installed where optimizer.py imported it by name.
  7. The CUDA RNG-state save/restore of activation recompute become no-ops; the CPU
     state and the tracker states are still saved and restored.
  8. The tensor-parallel linears advise setting CUDA_DEVICE_MAX_CONNECTIONS=1 (a CUDA stream
     setting) once per process: marked as already given while the shims are installed.
  9. MoE's all-to-all token dispatcher (MoEAlltoAllTokenDispatcher) makes a CUDA side stream when
     the first one is built, and copies its split sizes to the host on it: a stand-in stream
     object, and the copies made in place (the same host values, numpy splits included).
 10. `cuda_to_cpu()`: a TorchFunctionMode rewriting device="cuda" (and `.cuda()`, `.to("cuda")`,
     `pin_memory`, `pin_memory=True`) to cpu, for FP32Optimizer and the schedules (there, context
     parallelism's rotary slicing, get_pos_emb_on_this_cp_rank, builds a pinned CUDA index).
 11. Inside `cuda_to_cpu()` too: a CPU tensor's `.type()` names its CUDA type ('torch.FloatTensor'
     reads 'torch.cuda.FloatTensor'). megatron's optimizers sort their parameters by these strings
     (DistributedOptimizer and Float16OptimizerWithFloat16Params refuse any other: "Wrapped
     parameters must be one of torch.cuda.FloatTensor, ..."), so the distributed optimizer and
     bf16 run on CPU as on GPU. `.type(dtype)` (a conversion) is left alone.
 12. megatron-core 0.19's gradient sync (_ParamAndGradBucketGroup.start_grad_sync) asks
     `torch.cuda.current_stream()` for CUDA-graph events to wait for: a stand-in stream (none on CPU).
"""

from __future__ import annotations

import contextlib
import re
import warnings

import torch
from torch.overrides import TorchFunctionMode

_USERS = 0  # engines that enabled the shims and have not closed yet
_ORIGINALS: list[tuple[object, str, object]] = []


def cpu_mode() -> bool:
    """True when the shims apply: no CUDA."""
    return not torch.cuda.is_available()


class _CpuRNGStatesTracker:
    """megatron's CudaRNGStatesTracker interface over CPU generator states."""

    def __init__(self):
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


def is_cpu_tracker(tracker) -> bool:
    return isinstance(tracker, _CpuRNGStatesTracker)


def seed_model_parallel_rng(seed: int) -> None:
    """The CPU stand-in for `tensor_parallel.model_parallel_cuda_manual_seed` (same names and seeds)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    tracker = _CpuRNGStatesTracker()
    tracker.add(mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME,
                seed + 2718 + parallel_state.get_tensor_model_parallel_rank())
    tracker.add(mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME,
                seed + 1024 + 100 * parallel_state.get_expert_model_parallel_rank()
                + parallel_state.get_expert_tensor_parallel_rank())
    mp_random._CUDA_RNG_STATE_TRACKER = tracker
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _rope_get_emb(self, max_seq_len: int, offset: int = 0):
    """RotaryEmbedding.get_emb without the move of inv_freq to the current CUDA device."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]  # (s, 1, 1, d)


def _buffer_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
    required = 1
    for size in tensor_shape:
        required *= size
    key = (name, dtype)
    if self.buffer.get(key) is None or self.buffer[key].numel() < required:
        self.buffer[key] = torch.empty(required, dtype=dtype, requires_grad=False)
    return self.buffer[key][0:required].view(*tensor_shape)


def _clip_grad_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """clip_grad_by_total_norm_fp32 without its CUDA type assertion (same coefficient)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        torch._foreach_mul_(grads, coeff)


# megatron-core's import-time notices that it uses its own code where Apex / Transformer Engine
# are absent (the configuration this backend runs on CPU, and on GPU without them).
_FALLBACK_NOTICES = (r"Transformer Engine and Apex are not installed", r"Apex is not installed")


@contextlib.contextmanager
def fallback_warnings_off():
    """Around the first import of megatron-core's modules: its Apex / TE fallback UserWarnings off
    (only those; the warning filters are restored after the block)."""
    with warnings.catch_warnings():
        for notice in _FALLBACK_NOTICES:
            warnings.filterwarnings("ignore", message=notice, category=UserWarning)
        yield


# megatron-core 0.16.1's notices while it trains, harmless and repeated every step: torch deprecates
# the collectives its DDP buffers, distributed optimizer and MoE dispatch call, and its optimizer
# reads `.grad` of the distributed optimizer's shard views (never populated, as it expects).
_STEP_NOTICES = ((FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"),
                 (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed"))


@contextlib.contextmanager
def step_notices_off():
    """Around our calls into megatron's schedule and optimizer: those notices off (only those; the
    warning filters are restored after the block, nothing process-wide)."""
    with warnings.catch_warnings():
        for category, notice in _STEP_NOTICES:
            warnings.filterwarnings("ignore", message=notice, category=category)
        yield


_DTOH_FIELDS = (("input_splits", True), ("output_splits", True), ("output_splits_tp", True),
                ("num_out_tokens", False), ("num_global_tokens_per_local_expert", False))


def _dispatcher_to_host(self, point: str, tokens_per_expert=None):
    """MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize without CUDA streams: at the copy
    point, the split sizes become numpy arrays as on GPU (the rest stay host tensors); nothing to
    wait for at the sync point."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name, as_numpy in _DTOH_FIELDS:
            value = getattr(self, name, None)
            if as_numpy and torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


class _NoStream:
    """Where megatron keeps its CUDA side stream (never used on CPU: _dispatcher_to_host), and the
    current stream megatron-core 0.19's gradient sync asks for (shim 12): on CPU there is no CUDA
    graph replay whose event it could wait for."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


_ABSENT = object()  # an attribute the shim adds (removed again on disable)


def _without_te_shims() -> list[tuple[object, str, object]]:
    """Installed whenever TransformerEngine is absent (CPU, or a GPU without it): megatron-core
    0.16.1's MoE router gating (moe_utils.RouterGatingLinearFunction) tests `te_general_gemm is not
    None`, a name it defines only when TE imports (NameError otherwise); None takes its plain matmul."""
    from megatron.core.transformer.moe import moe_utils

    return [] if hasattr(moe_utils, "te_general_gemm") else [(moe_utils, "te_general_gemm", None)]


def _shims() -> list[tuple[object, str, object]]:
    """(owner, attribute, replacement) of shims 2-9, and those of _without_te_shims."""
    if not cpu_mode():
        return _without_te_shims()
    from megatron.core import utils as mcore_utils
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer
    from megatron.core.tensor_parallel import layers as mp_layers
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    return _without_te_shims() + [
        (MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", _NoStream()),
        (MoEAlltoAllTokenDispatcher, "_maybe_dtoh_and_synchronize", _dispatcher_to_host),
        (rotary_pos_embedding.RotaryEmbedding, "get_emb", _rope_get_emb),
        (mcore_utils.GlobalMemoryBuffer, "get_tensor", _buffer_get_tensor),
        (torch.cuda, "current_device", lambda: torch.device("cpu")),
        (torch.cuda, "current_stream", lambda *args, **kwargs: _NoStream()),
        (torch.cuda, "synchronize", lambda *args, **kwargs: None),
        (torch.cuda, "empty_cache", lambda: None),
        (clip_grads, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm),
        (mcore_optimizer, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm),
        (mp_random, "_get_cuda_rng_state", lambda *args, **kwargs: None),
        (mp_random, "_set_cuda_rng_state", lambda *args, **kwargs: None),
        (mp_layers.linear_with_grad_accumulation_and_async_allreduce, "warned", True),
    ]


def enable_cpu_shims() -> None:
    """Install shims 2-9 (with CUDA only those for an absent TransformerEngine). Call before building
    the model; every call needs its disable_cpu_shims() (engines alive at once share one installation)."""
    global _USERS
    _USERS += 1
    if _USERS > 1:
        return
    for owner, name, replacement in _shims():
        _ORIGINALS.append((owner, name, getattr(owner, name, _ABSENT)))
        setattr(owner, name, replacement)


def disable_cpu_shims() -> None:
    """Undo enable_cpu_shims once the last engine that enabled them is closed: every patched
    function is the original again."""
    global _USERS
    if _USERS == 0:
        return
    _USERS -= 1
    if _USERS:
        return
    while _ORIGINALS:
        owner, name, original = _ORIGINALS.pop()
        if original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to cpu for every torch function called inside it, and names a
    CPU tensor's type as its CUDA one (shim 11)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # the type string, no conversion
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")
        if kwargs.get("pin_memory"):  # pinned memory needs CUDA (get_pos_emb_on_this_cp_rank's index)
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to:
            args = tuple(torch.device("cpu") if i and _is_cuda(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


def cuda_to_cpu():
    """Context in which megatron's `device="cuda"` allocations land on cpu (nothing with CUDA)."""
    return _CudaToCpu() if cpu_mode() else contextlib.nullcontext()


@contextlib.contextmanager
def adam_step_kept():
    """Around a DistributedOptimizer's load_state_dict when its inner optimizer is torch's Adam (no
    TransformerEngine or Apex: on CPU, and on a GPU without them): the step count stays out of the
    per-parameter copies.

    megatron-core 0.16.1's load sets torch's Adam "step" state from the checkpoint's param groups,
    one tensor shared by every parameter (torch's Adam then adds 1 to it once per parameter and
    step), then DistributedOptimizer._set_main_param_and_optimizer_states copies every state key of
    a parameter from the checkpoint's tensors, which hold no "step" (KeyError 'step' on every load
    in model space). The original runs with "step" set aside, and each parameter gets its own copy
    of it back. Undone after the block."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        yield
        return
    cls = distrib_optimizer.DistributedOptimizer
    original = cls._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            original(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step.clone()

    cls._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        cls._set_main_param_and_optimizer_states = original


# What megatron-core 0.16.1's dist_checkpointing load says about torch's own deprecations (its torch
# strategy calls torch.distributed.checkpoint.load_state_dict and builds ShardedTensors): nothing a
# user can act on, printed on every load. Only these two, only inside the load.
_LIBRARY_DEPRECATIONS = ("`load_state_dict` is deprecated and will be removed in future versions",
                         "Please use DTensor instead and we are deprecating ShardedTensor")


@contextlib.contextmanager
def library_deprecations_quiet():
    """Around dist_checkpointing.load: megatron-core's own FutureWarnings about torch APIs it uses
    (_LIBRARY_DEPRECATIONS) are not shown; every other warning is. The filters are restored after."""
    with warnings.catch_warnings():
        for message in _LIBRARY_DEPRECATIONS:
            warnings.filterwarnings("ignore", message=re.escape(message), category=FutureWarning)
        yield
