"""AdamW with bf16 moments beside fp32 parameters: the one-pass CPU kernel (adamw_bf16.c, compiled on
first use) and the three-pass step it replaces.

torch's fused AdamW takes moments only in the parameters' dtype, so bf16 moments beside fp32
parameters otherwise cost three passes (upcast, the fp32 kernel, round back: 52 bytes moved an
element against fp32 AdamW's 28). adamw_bf16.c does it in one (20 bytes) with torch's arithmetic.

The C file is compiled once per machine and compiler with the system's C compiler ($CC, else cc)
into the cache ($CRITIC_ADAPTERS_CACHE, else ~/.cache/critic-adapters, else the temp directory),
then checked against torch's own step on a few thousand elements before it is used. Without a
compiler, or if either step fails, the optimizer keeps the three-pass step and says why
(kernel().why; the run's `optimizer:` line). CRITIC_ADAPTERS_ADAMW_KERNEL=0 turns the kernel off.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from typing import Callable

import torch

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "adamw_bf16.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-pthread")
SWITCH = "CRITIC_ADAPTERS_ADAMW_KERNEL"
PIECE = 1 << 18  # elements per piece of the three-pass CPU step (1 MiB of fp32 per temporary)


@dataclasses.dataclass(frozen=True)
class Kernel:
    step: Callable | None
    """step(params, grads, exp_avgs, exp_avg_sqs, steps, lr=, beta1=, beta2=, weight_decay=, eps=):
    one AdamW step, in place, on contiguous CPU tensors (fp32 params and grads, bf16 moments)."""
    why: str

    def __str__(self) -> str:
        return f"{'one-pass C kernel' if self.step else 'three passes'} ({self.why})"


def applies(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> bool:
    """Whether these local tensors are the kernel's kind."""
    return (param.device.type == "cpu" and param.dtype == grad.dtype == torch.float32
            and exp_avg.dtype == exp_avg_sq.dtype == torch.bfloat16
            and all(t.is_contiguous() for t in (param, grad, exp_avg, exp_avg_sq)))


def _cache_dir() -> str:
    for root in (os.environ.get("CRITIC_ADAPTERS_CACHE"), os.path.expanduser("~/.cache/critic-adapters"),
                 os.path.join(tempfile.gettempdir(), f"critic-adapters-{os.getuid()}")):
        if not root:
            continue
        path = os.path.join(root, "kernels")
        try:
            os.makedirs(path, exist_ok=True)
        except OSError:
            continue
        if os.access(path, os.W_OK):
            return path
    raise OSError("no writable cache directory (set CRITIC_ADAPTERS_CACHE)")


def _cpu_flags() -> str:
    # -march=native builds for this CPU: a cache shared between machines keeps one build per CPU kind.
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def compile_library(compiler: str) -> str:
    """The shared library's path, compiled now unless the cache holds it. Ranks compiling at once each
    write their own temporary file and rename it into place (atomic): no rank loads a partial one."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(FLAGS).encode(), platform.machine().encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    cache = _cache_dir()
    library = os.path.join(cache, f"adamw_bf16-{key}.so")
    if os.path.exists(library):
        return library
    fd, partial = tempfile.mkstemp(dir=cache, prefix=f"adamw_bf16-{key}.", suffix=".partial")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", partial, SOURCE, "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            raise RuntimeError(f"{compiler} failed: {lines[-1] if lines else f'exit {done.returncode}'}")
        os.replace(partial, library)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return library


def _bind(library: str) -> Callable:
    lib = ctypes.CDLL(library)
    function = lib.critic_adamw_bf16_step
    pointers = ctypes.POINTER(ctypes.c_void_p)
    function.argtypes = [ctypes.c_int, pointers, pointers, pointers, pointers, ctypes.POINTER(ctypes.c_int64),
                         ctypes.POINTER(ctypes.c_double)] + [ctypes.c_double] * 5 + [ctypes.c_int]
    function.restype = ctypes.c_int

    def step(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, weight_decay, eps):
        count = len(params)
        if count == 0:
            return
        address = lambda tensors: (ctypes.c_void_p * count)(*[t.data_ptr() for t in tensors])  # noqa: E731
        numels = (ctypes.c_int64 * count)(*[t.numel() for t in params])
        step_counts = (ctypes.c_double * count)(*[float(s) for s in steps])
        # ctypes lets go of the GIL for the call; the kernel uses torch's intra-op thread count.
        if function(count, address(params), address(grads), address(exp_avgs), address(exp_avg_sqs), numels,
                    step_counts, lr, beta1, beta2, weight_decay, eps, torch.get_num_threads()) != 0:
            raise MemoryError("the bf16-moment AdamW kernel could not allocate its task list")

    return step


def three_pass_step(param, grad, exp_avg, exp_avg_sq, step: torch.Tensor, hyper: dict, scratch: dict) -> None:
    """The step without the kernel (on CUDA; on CPU where the kernel is not built): the moments upcast,
    torch's fused fp32 AdamW kernel on them, the moments rounded back. `hyper`: lr, beta1, beta2,
    weight_decay, eps. On CPU a piece of the tensor at a time, its moments upcast into two buffers
    reused for every piece of the step (`scratch`, kept by the caller for the step): the temporaries
    stay in cache and nothing is allocated per piece (a fresh pair per piece was 1.9x fp32 AdamW's
    step, this 1.56x). On CUDA whole tensors: fewer launches."""
    hyper = dict(hyper, amsgrad=False, maximize=False)
    flat = param.device.type == "cpu" and all(t.is_contiguous() for t in (param, grad, exp_avg, exp_avg_sq))
    pieces = range(0, param.numel(), PIECE) if flat else (None,)
    if flat:
        key, need = (param.device, param.dtype), min(PIECE, param.numel())
        if key not in scratch or scratch[key][0].numel() < need:
            scratch[key] = [torch.empty(need, dtype=param.dtype, device=param.device) for _ in range(2)]
        m_buffer, v_buffer = scratch[key]
    for start in pieces:
        where = slice(start, start + PIECE)
        piece = (lambda t: t.view(-1)[where]) if flat else (lambda t: t)  # noqa: E731
        m_low, v_low = piece(exp_avg), piece(exp_avg_sq)
        if flat:
            m, v = m_buffer[:m_low.numel()].copy_(m_low), v_buffer[:v_low.numel()].copy_(v_low)
        else:
            m, v = m_low.to(param.dtype), v_low.to(param.dtype)
        torch._fused_adamw_([piece(param)], [piece(grad).to(param.dtype)], [m], [v], [], [step], **hyper)
        m_low.copy_(m)
        v_low.copy_(v)


def agrees_with_torch(step: Callable) -> str:
    """'' when the kernel's step equals the three-pass step on random tensors (both lerp forms, a
    length that is no multiple of any vector width, weight decay, steps 1 and 7), else what differs.
    Moments within one bf16 rounding and parameters within 2 fp32 roundings: the kernel matches torch's
    own build exactly where its fma contraction is the one written in adamw_bf16.c."""
    generator = torch.Generator().manual_seed(0)
    n = 4099
    for beta1, count in ((0.9, 1.0), (0.3, 7.0)):
        hyper = dict(lr=1e-3, beta1=beta1, beta2=0.999, weight_decay=0.1, eps=1e-8)
        param = torch.randn(n, generator=generator)
        grad = torch.randn(n, generator=generator) * 1e-2
        m = (torch.randn(n, generator=generator) * 1e-3).bfloat16()
        v = (torch.rand(n, generator=generator) * 1e-5).bfloat16()
        ours = [param.clone(), grad, m.clone(), v.clone()]
        theirs = [param.clone(), grad, m.clone(), v.clone()]
        step(*[[t] for t in ours], [count], **hyper)
        three_pass_step(*theirs, torch.tensor(count), hyper, {})
        compared = (("exp_avg", ours[2], theirs[2], 2 ** -7), ("exp_avg_sq", ours[3], theirs[3], 2 ** -7),
                    ("param", ours[0], theirs[0], 2 ** -22))
        for name, a, b, tolerance in compared:
            a, b = a.float(), b.float()
            worst = ((a - b).abs() / b.abs().clamp_min(1e-30)).max().item()
            if not worst <= tolerance:
                return f"{name} differs from torch's step by {worst:.3g} (relative) at beta1={beta1}"
    return ""


@functools.cache
def kernel() -> Kernel:
    """The kernel for this process, compiled, loaded and checked once (the reason when it is not used)."""
    if os.environ.get(SWITCH, "1") == "0":
        return Kernel(None, f"{SWITCH}=0")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return Kernel(None, "no C compiler to build common/engine/adamw_bf16.c (install gcc, or set CC)")
    try:
        step = _bind(compile_library(compiler))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        return Kernel(None, f"common/engine/adamw_bf16.c did not build: {error}")
    difference = agrees_with_torch(step)
    if difference:
        return Kernel(None, f"the compiled kernel was not used: {difference}")
    return Kernel(step, f"built by {os.path.basename(compiler)}, checked against torch's step")
