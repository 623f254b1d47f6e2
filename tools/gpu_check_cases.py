"""The checks tools/gpu-check runs (tools/gpu_check.py has the list, the limits and how to run it).

Each check is `check(run, numbers)`: it records what it measured in `numbers` (a gpu_check.Numbers:
at_most / require hold a number to its limit) and raises only for what stops it (Skip: it
cannot run here, with the reason). `Run` holds what the checks share: the process's DistContext,
the reference critic and batch, and check 1's engine and numbers (checks 2-5, 7 and 9 use them).
Everything goes through the project's public API (build_engine, EngineConfig, load_critic,
compute_values, common.parallel.kernels) and the benchmarks' model and batch makers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import json
import os
import shutil
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from critic_adapters.bench.critic_update import MODEL, make_batch
from critic_adapters.bench.offload import save_model
from critic_adapters.common.engine import RolloutBatch
from critic_adapters.common.engine.config import BatchingConfig, EngineConfig, ModelConfig, OptimConfig
from critic_adapters.common.engine.registry import build_engine, model_critic_config
from critic_adapters.common.parallel import kernels
from critic_adapters.common.parallel.distributed import DistContext, init_distributed, shutdown

TINY = dict(MODEL, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=192)  # MODEL's layout (GQA, the 32k vocabulary make_batch draws from), tiny
LR = 1e-3  # large enough that 5 updates visibly lower the loss
GIB = 1 << 30
PACKAGES = ("torch", "transformers", "megatron-core", "veomni", "huggingface-hub", "tokenizers", "safetensors",
            "regex", "packaging", "numpy", "triton", "peft", "accelerate", "psutil", "einops")


class Skip(Exception):
    """Raised by a check that cannot run here; its message is the reason."""


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _maxdiff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs()[mask.bool()].max())


def _maxerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _rel(a: float, b: float) -> float:
    return abs(a / b - 1.0) if b else abs(a)


def _timed(fn):
    _sync()
    start = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - start


class Run:
    """What the checks share: the device, the process group, the reference critic, its batch, and
    check 1's results. The process group, critic and batch are made by the first check that needs
    them, so a failure there is that check's (and the next one's, which tries again)."""

    def __init__(self, *, cpu: bool, workdir: str):
        self.cpu = cpu
        self.workdir = workdir
        self.host = DistContext(0, 1, 0, torch.device("cpu"))  # the same engine on CPU, in this process
        self.model_spec = TINY if cpu else MODEL
        self.micro_batch_tokens = 1024 if cpu else 4096
        self.reference: dict | None = None
        """Check 1's fp32 engine on the device: values before, metrics of, and values after one update."""
        self.engine = None  # check 1's engine on the device, kept for check 5
        self._engines: list = []  # built by the check in progress: end_check() closes them

    @functools.cached_property
    def dist(self) -> DistContext:
        return init_distributed()

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @functools.cached_property
    def model_dir(self) -> str:
        return save_model(os.path.join(self.workdir, "critic"), self.model_spec)

    @functools.cached_property
    def batch(self) -> RolloutBatch:
        return make_batch(4 if self.cpu else 16)  # prompts 16-48, responses 16-448 tokens, padded

    def config(self, **overrides) -> EngineConfig:
        """fp32 unless a case asks for bf16 (engine.mixed_precision=auto would be bf16 on the GPU)."""
        return EngineConfig(model=ModelConfig(path=self.model_dir), optim=OptimConfig(lr=LR),
                            batching=BatchingConfig(micro_batch_tokens=self.micro_batch_tokens),
                            **{"mixed_precision": "none", **overrides})

    def build(self, backend: str, config: EngineConfig | None = None, dist: DistContext | None = None):
        engine = build_engine(backend, config or self.config(), dist or self.dist)
        self._engines.append(engine)
        return engine

    def close_engine(self, engine) -> None:
        """Close it now, to free its memory before the check goes on."""
        self._engines.remove(engine)
        engine.close()

    def end_check(self) -> None:
        """After every check, passed or not: close the engines it built (but check 1's, kept)."""
        for engine in reversed(self._engines):
            if engine is not self.engine:
                with contextlib.suppress(Exception):  # a half-failed engine: the check recorded why
                    engine.close()
        self._engines = [self.engine] if self.engine is not None else []

    def values(self, engine) -> torch.Tensor:
        return engine.compute_values(self.batch.input_ids, self.batch.attention_mask)

    def needs_reference(self) -> dict:
        if self.reference is None:
            raise Skip("needs check 1's fp32 reference (fsdp_fp32_parity did not finish)")
        return self.reference

    def close(self) -> None:
        self.engine = None
        self.end_check()
        shutdown()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _unmet_requirements(dist_name: str) -> list[str]:
    """The Requires-Dist lines (no extras) of an installed distribution that this environment does not meet."""
    from packaging.requirements import Requirement

    unmet = []
    for text in importlib.metadata.requires(dist_name) or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        have = _version(req.name)
        if have is None or not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{text} (have {have})")
    return unmet


# --- 0 ---------------------------------------------------------------------------------------------

def env(run: Run, n) -> None:
    n["versions"] = {name: _version(name) for name in PACKAGES}
    n["transformers_from"] = os.path.dirname(importlib.import_module("transformers").__file__)
    n["transformers_unmet"] = _unmet_requirements("transformers")
    n["device"] = str(run.device)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        n.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                 memory_gib=round(props.total_memory / GIB, 1), cuda=torch.version.cuda,
                 cudnn=torch.backends.cudnn.version(), nccl=str(torch.cuda.nccl.version()))
        matmul = torch.backends.cuda.matmul
        n["fp32_matmul"] = getattr(matmul, "fp32_precision", None) or f"allow_tf32={matmul.allow_tf32}"
    imports = {}
    for backend in ("fsdp", "megatron", "veomni"):
        module = f"critic_adapters.backends.{backend}.engine"
        try:
            _, seconds = _timed(lambda: importlib.import_module(module))
            imports[backend] = f"ok in {seconds:.1f} s"
        except Exception as err:  # noqa: BLE001 - recorded; the backend's own check fails with it again
            imports[backend] = f"{type(err).__name__}: {err}"[:500]
    n["imports"] = imports
    have = kernels.installed()
    n["installed"] = dataclasses.asdict(have)
    try:
        from torch.nn.attention.varlen import varlen_attn

        n["varlen_attn_signature"] = str(inspect.signature(varlen_attn))
    except ImportError as err:
        n["varlen_attn_signature"] = f"none: {err}"
    n["attention"] = {f"{name} {'packed' if packed else 'padded'}": str(kernels.attention(
        compute_dtype=dtype, packed=packed, have=have)) for name, dtype in (("fp32", torch.float32),
                                                                          ("bf16", torch.bfloat16))
        for packed in (True, False)}
    n["megatron_spec"] = {name: str(kernels.megatron_spec(compute_dtype=dtype, packed=True, context=1, have=have))
                          for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    n["veomni_ops"] = str(kernels.veomni_ops(have=have))
    n.require("imports_ok", all(v.startswith("ok") for v in imports.values()), "every backend imports")
    n.require("transformers_requirements_met", not n["transformers_unmet"], "transformers' requirements are met")
    if not run.cpu:
        n.require("cuda", torch.cuda.is_available() and run.device.type == "cuda", "the run is on a GPU")


# --- 1 ---------------------------------------------------------------------------------------------

def fsdp_fp32_parity(run: Run, n) -> None:
    batch, mask = run.batch, run.batch.attention_mask
    device = run.build("fsdp")
    other = run.build("fsdp", dist=run.host)  # on GPU: CPU; on CPU: a second CPU engine
    n["compared"] = f"{run.device.type} vs cpu"
    n["kernels"] = device.load_report.kernels
    v_dev, v_cpu = run.values(device), run.values(other)
    n.at_most("values_max_diff", _maxdiff(v_dev, v_cpu, mask), 1e-4)
    m_dev, seconds = _timed(lambda: device.update(batch))
    m_cpu = other.update(batch)
    n["update_s"] = round(seconds, 3)
    n.at_most("loss_diff", abs(m_dev["value_loss"] - m_cpu["value_loss"]), 1e-5 * max(1.0, abs(m_cpu["value_loss"])))
    n.at_most("grad_norm_rel_diff", _rel(m_dev["grad_norm"], m_cpu["grad_norm"]), 1e-3)
    after = run.values(device)
    n.at_most("values_after_max_diff", _maxdiff(after, run.values(other), mask), 1e-3)
    n["value_loss"], n["grad_norm"] = m_dev["value_loss"], m_dev["grad_norm"]
    run.close_engine(other)
    run.engine = device
    run.reference = {"values": v_dev, "metrics": m_dev, "after": after}


# --- 2 ---------------------------------------------------------------------------------------------

def fsdp_bf16(run: Run, n) -> None:
    ref, mask = run.needs_reference(), run.batch.attention_mask
    engine = run.build("fsdp", run.config(mixed_precision="bf16"))
    n["kernels"] = engine.load_report.kernels
    values = run.values(engine)
    # The engine contract: forward_backward's values and loss come back detached on the CPU, float32.
    pieces, loss = engine.forward_backward(run.batch.input_ids, run.batch.attention_mask, lambda v: v.sum() * 0.0)
    engine.zero_grad()
    n["forward_backward_returns"] = [f"{t.device.type} {t.dtype}" for t in (pieces, loss)]
    n.require("forward_backward_on_cpu", n["forward_backward_returns"] == ["cpu torch.float32"] * 2,
              "forward_backward returns float32 CPU tensors")
    n["values_dtype"] = str(values.dtype)
    n.at_most("values_diff_vs_fp32", _maxdiff(values, ref["values"], mask), 0.05, above=0.0)
    losses = [engine.update(run.batch)["value_loss"] for _ in range(5)]
    n["losses"] = losses
    n.at_most("first_loss_diff_vs_fp32", abs(losses[0] - ref["metrics"]["value_loss"]),
              0.05 * max(1.0, abs(ref["metrics"]["value_loss"])))
    n.require("loss_falls", losses[-1] < losses[0], "the last of 5 updates' losses is below the first")
    run.close_engine(engine)


# --- 3, 4 ------------------------------------------------------------------------------------------

def _round_trips(run: Run, n, engine, config: EngineConfig, backend: str, export_tol: float) -> None:
    """Offload/onload bit-equal; a checkpoint loaded into a second engine: equal values, then equal
    after one more update on both; the HF export loaded with load_critic on the device."""
    from critic_adapters.common.valuehead import compute_values, load_critic

    batch, mask = run.batch, run.batch.attention_mask
    before = run.values(engine)
    engine.offload()
    n["resident_bytes_offloaded"] = sum(engine.resident_bytes().values())
    engine.onload()
    n.require("offload_onload_bit_equal", torch.equal(run.values(engine), before), "values bit-equal after onload")
    n.require("nothing_resident_when_offloaded", n["resident_bytes_offloaded"] == 0, "resident_bytes() all 0")

    checkpoint = os.path.join(run.workdir, f"{backend}-checkpoint")
    engine.save_checkpoint(checkpoint, {"step": 1})
    second = run.build(backend, config)
    extra = second.load_checkpoint(checkpoint)
    n.require("checkpoint_values_bit_equal", torch.equal(run.values(second), before), "values bit-equal after load")
    n["checkpoint_extra_state"] = extra
    one, two = engine.update(batch), second.update(batch)
    n["checkpoint_next_losses"] = [one["value_loss"], two["value_loss"]]
    n["checkpoint_next_grad_norms"] = [one["grad_norm"], two["grad_norm"]]
    n.at_most("checkpoint_next_values_max_diff", _maxdiff(run.values(engine), run.values(second), mask), 0.0)
    n.require("checkpoint_next_loss_equal", one["value_loss"] == two["value_loss"],
              "the next update's loss equal on the saved and the loaded engine")
    run.close_engine(second)
    shutil.rmtree(checkpoint, ignore_errors=True)

    export = os.path.join(run.workdir, f"{backend}-export")
    engine.export_hf(export)
    model, report = load_critic(export)
    model.to(run.device).eval()
    with torch.no_grad():
        loaded = compute_values(model, batch.input_ids.to(run.device), mask.to(run.device)).cpu()
    n["export_format"] = report.format
    n.at_most("export_values_max_diff", _maxdiff(loaded, run.values(engine), mask), export_tol)
    del model
    shutil.rmtree(export, ignore_errors=True)


def _megatron(run: Run, n, mixed_precision: str) -> None:
    ref, batch, mask = run.needs_reference(), run.batch, run.batch.attention_mask
    config = run.config(mixed_precision=mixed_precision)
    engine = run.build("megatron", config)
    parts = getattr(engine.optimizer, "chained_optimizers", None) or [engine.optimizer]  # megatron's wrapper
    n["optimizer"] = f"{type(engine.optimizer).__name__}: {', '.join(type(p).__name__ for p in parts)}"
    n["kernels"] = engine.load_report.kernels
    values = run.values(engine)
    metrics = engine.update(batch)
    bf16 = mixed_precision == "bf16"
    if bf16:
        n.at_most("values_diff_vs_fsdp_fp32", _maxdiff(values, ref["values"], mask), 0.05, above=0.0)
        losses = [metrics["value_loss"]] + [engine.update(batch)["value_loss"] for _ in range(4)]
        n["losses"] = losses
        n.require("loss_falls", losses[-1] < losses[0], "the last of 5 updates' losses is below the first")
    else:
        n.at_most("values_diff_vs_fsdp", _maxdiff(values, ref["values"], mask), 1e-4)
        n.at_most("loss_diff_vs_fsdp", abs(metrics["value_loss"] - ref["metrics"]["value_loss"]), 1e-5)
        n.at_most("grad_norm_rel_diff_vs_fsdp", _rel(metrics["grad_norm"], ref["metrics"]["grad_norm"]), 1e-3)
        n.at_most("values_after_diff_vs_fsdp", _maxdiff(run.values(engine), ref["after"], mask), 1e-3)
    _round_trips(run, n, engine, config, "megatron", 0.05 if bf16 else 1e-4)
    run.close_engine(engine)


def megatron_fp32(run: Run, n) -> None:
    _megatron(run, n, "none")


def megatron_bf16(run: Run, n) -> None:
    _megatron(run, n, "bf16")


# --- 5 ---------------------------------------------------------------------------------------------

def _memory() -> dict:
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(), "free": free}


def offload_memory(run: Run, n) -> None:
    run.needs_reference()
    engine = run.engine
    before_values = run.values(engine)
    moved = sum(engine.resident_bytes().values())
    n["bytes"] = moved
    n["parts"] = engine.resident_bytes()
    rounds = []
    for _ in range(2):  # the second offload reuses the first one's pinned host buffers
        at_start = _memory()
        _, off_s = _timed(engine.offload)
        offloaded = _memory()
        resident = sum(engine.resident_bytes().values())
        _, on_s = _timed(engine.onload)
        rounds.append({"offload_s": round(off_s, 4), "onload_s": round(on_s, 4),
                       "s_per_gib": round((off_s + on_s) / (moved / GIB), 3), "resident_offloaded": resident,
                       "before": at_start, "offloaded": offloaded, "onloaded": _memory()})
    n["rounds"] = rounds
    n.require("values_bit_equal", torch.equal(run.values(engine), before_values), "values bit-equal after two cycles")
    n.require("nothing_resident", all(r["resident_offloaded"] == 0 for r in rounds), "resident_bytes() 0 when offloaded")
    if torch.cuda.is_available():
        first = rounds[0]
        n.at_most("allocated_kept_fraction", (first["offloaded"]["allocated"] - first["before"]["allocated"] + moved)
                  / moved, 0.1)  # allocated fell by (almost) every byte moved
        n.at_most("free_not_gained_fraction", 1 - (first["offloaded"]["free"] - first["before"]["free"]) / moved,
                  0.1)  # other processes see the memory (the cache was emptied)
        if hasattr(torch.cuda, "host_memory_stats"):  # pinned host memory (torch's caching host allocator)
            n["host_memory"] = dict(torch.cuda.host_memory_stats())
    else:
        n["cuda_memory"] = "not measured: no CUDA (resident_bytes() counts the engine's storages)"


# --- 6 ---------------------------------------------------------------------------------------------

def _reference_attention(q, k, v, spans, scale) -> torch.Tensor:
    """Per-sequence causal attention in fp32, K/V heads repeated: (1, H, T, D) -> (1, T, H, D)."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = q.float(), k.float().repeat_interleave(groups, 1), v.float().repeat_interleave(groups, 1)
    out = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=scale)
           for a, b in spans]
    return torch.cat(out, dim=2).transpose(1, 2)


def _fwd_bwd_ms(fn, q, k, v, repeats: int) -> tuple[torch.Tensor, float]:
    times, out = [], None
    for i in range(repeats + 1):
        for t in (q, k, v):
            t.grad = None
        _sync()
        start = time.perf_counter()
        out, _ = fn()
        out.float().square().mean().backward()
        _sync()
        if i:  # the first call warms up
            times.append(time.perf_counter() - start)
    return out.detach(), statistics.median(times) * 1e3


def packed_attention(run: Run, n) -> None:
    from critic_adapters.common.parallel import packed_attention as packed, varlen_attention

    cuda = run.device.type == "cuda"
    g = torch.Generator().manual_seed(0)
    lengths = [4096, 3000, 2500, 2048, 1500, 1200, 800, 800, 440] if cuda else [130, 100, 64, 64, 40, 31]
    heads, kv_heads, dim = (14, 2, 64) if cuda else (4, 2, 16)
    dtype = torch.bfloat16 if cuda else torch.float32
    total = sum(lengths)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    spans = [(s, s + length) for s, length in zip(starts, lengths)]
    q, k, v = (torch.randn(1, h, total, dim, generator=g).to(run.device, dtype).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    scale = dim ** -0.5
    module = torch.nn.Module().eval()
    n.update(tokens=total, sequences=len(lengths), heads=f"{heads}/{kv_heads}", head_dim=dim, dtype=str(dtype))
    reference = _reference_attention(q.detach(), k.detach(), v.detach(), spans, scale)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5

    def ours():
        with packed.stated_bounds([spans]):
            return packed.packed_attention(module, q, k, v, None, scaling=scale)

    out, ms = _fwd_bwd_ms(ours, q, k, v, repeats=3)
    n["packed_ms_fwd_bwd"] = round(ms, 3)
    n.at_most("packed_max_err", _maxerr(out, reference), tolerance)
    if not kernels.installed().torch_varlen:
        n["varlen"] = ("not run: torch's varlen_attn needs CUDA and torch >= 2.10 (window_size); "
                       f"kernels.installed() = {dataclasses.asdict(kernels.installed())}")
        return

    def varlen():
        with packed.stated_bounds([spans]):
            return varlen_attention.varlen_attention(module, q, k, v, None, scaling=scale)

    out, ms = _fwd_bwd_ms(varlen, q, k, v, repeats=3)
    n["varlen_ms_fwd_bwd"] = round(ms, 3)
    n["packed_over_varlen"] = round(n["packed_ms_fwd_bwd"] / ms, 2)
    n.at_most("varlen_max_err", _maxerr(out, reference), tolerance)


# --- 7 ---------------------------------------------------------------------------------------------

def fsdp_cpu_offload(run: Run, n) -> None:
    ref, mask = run.needs_reference(), run.batch.attention_mask
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = run.build("fsdp", run.config(cpu_offload=True))
    n["warnings"] = sorted({str(w.message) for w in caught if "cpu_offload" in str(w.message)})
    n["parameters_on"] = str(next(engine.model.parameters()).device)
    n.require("no_ignored_warning", not n["warnings"], "engine.cpu_offload is applied, never dropped with a warning")
    n.require("shards_on_cpu", n["parameters_on"] == "cpu", "the offloaded shards live in host memory")
    n.at_most("values_max_diff", _maxdiff(run.values(engine), ref["values"], mask), 1e-5)
    metrics = engine.update(run.batch)
    n.at_most("loss_diff", abs(metrics["value_loss"] - ref["metrics"]["value_loss"]), 1e-5)
    n.at_most("grad_norm_rel_diff", _rel(metrics["grad_norm"], ref["metrics"]["grad_norm"]), 1e-3)
    n.at_most("values_after_max_diff", _maxdiff(run.values(engine), ref["after"], mask), 1e-3)
    n["resident_bytes"] = engine.resident_bytes()
    run.close_engine(engine)


# --- 8 ---------------------------------------------------------------------------------------------

def _rollout(lengths: list[int], vocab: int, seed: int) -> RolloutBatch:
    """Right-padded rows of these lengths, the second half of each a response with random returns."""
    g = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), max(lengths)
    length = torch.tensor(lengths)
    positions = torch.arange(width)[None]
    mask = (positions < length[:, None]).long()
    response = ((positions >= (length // 2)[:, None]) & mask.bool()).long()
    ids = torch.randint(1, vocab, (rows, width), generator=g) * mask
    return RolloutBatch(ids, mask, response, torch.zeros(rows, width), torch.randn(rows, width, generator=g) * response)


def scale_bf16(run: Run, n) -> None:
    from critic_adapters.bench.scale import CONFIG, write_model
    from critic_adapters.common.job.telemetry import ModelShape, device_peak, measured_matmul_peak
    from critic_adapters.common.parallel.host_memory import MemoryWindow

    if run.cpu:  # the 0.5B config's layout, tiny
        with open(CONFIG) as f:
            config = dict(json.load(f), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=4096)
        config_file = os.path.join(run.workdir, "tiny_scale.json")
        with open(config_file, "w") as f:
            json.dump(config, f)
    else:
        config_file = CONFIG
    model_dir = os.path.join(run.workdir, "scale")
    _, write_s = _timed(lambda: write_model(config_file, model_dir))
    n["config"] = os.path.basename(config_file)
    n["write_s"] = round(write_s, 1)
    g = torch.Generator().manual_seed(3)
    low, high, rows, budget = (256, 2048, 64, 16384) if not run.cpu else (32, 128, 8, 512)
    lengths = torch.randint(low, high + 1, (rows,), generator=g).tolist()
    engine_config = EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-5),
                                 batching=BatchingConfig(micro_batch_tokens=budget), mixed_precision="bf16")
    engine, build_s = _timed(lambda: run.build("fsdp", engine_config))
    n["build_s"] = round(build_s, 1)
    n["kernels"] = engine.load_report.kernels
    critic_config = model_critic_config(engine_config.model)
    batch = _rollout(lengths, critic_config.vocab_size, seed=4)
    shape = ModelShape.of(engine, critic_config)
    parameters = engine.parameter_counts()[1]
    tokens = int(batch.attention_mask.sum())
    n.update(parameters=parameters, tokens_per_update=tokens, rows=rows, micro_batch_tokens=budget)
    engine.update(batch)  # warm-up: Adam's state exists from here on
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with MemoryWindow() as window:
        seconds = [_timed(lambda: engine.update(batch))[1] for _ in range(3)]
    update_s = statistics.median(seconds)
    _, values_s = _timed(lambda: engine.compute_values(batch.input_ids, batch.attention_mask))
    peak_flops = measured_matmul_peak(run.device, torch.bfloat16)
    flops = shape.training_flops(batch.attention_mask.sum(1))
    n.update(update_s=[round(s, 3) for s in seconds], update_tokens_per_s=round(tokens / update_s),
             values_tokens_per_s=round(tokens / values_s), bf16_matmul_peak_tflops=round(peak_flops / 1e12, 2),
             mfu=round(flops / update_s / peak_flops, 4), model_tflops_per_update=round(flops / 1e12, 2))
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated()
        n.update(datasheet_peak_tflops=round(device_peak(run.device) / 1e12, 1),
                 mfu_vs_datasheet=round(flops / update_s / device_peak(run.device), 4),
                 peak_allocated_gib=round(peak / GIB, 2), peak_bytes_per_parameter=round(peak / parameters, 2),
                 update_transient_gib=round((peak - base) / GIB, 2))
    else:
        n.update(peak_resident_gib=round(window.peak / GIB, 3),
                 peak_bytes_per_parameter=round(window.peak / parameters, 2),
                 memory_note="CPU: the process's resident high-water mark during the timed updates, everything included")
    n.require("mfu_positive", n["mfu"] > 0, "the update did work")
    run.close_engine(engine)
    shutil.rmtree(model_dir, ignore_errors=True)


# --- 9 ---------------------------------------------------------------------------------------------

def veomni(run: Run, n) -> None:
    ref, mask = run.needs_reference(), run.batch.attention_mask
    n["ops"] = str(kernels.veomni_ops(have=kernels.installed()))
    engine = run.build("veomni")
    n["kernels"] = engine.load_report.kernels
    n.at_most("values_max_diff", _maxdiff(run.values(engine), ref["values"], mask), 1e-4)
    metrics = engine.update(run.batch)
    n.at_most("loss_diff", abs(metrics["value_loss"] - ref["metrics"]["value_loss"]), 1e-5)
    n.at_most("grad_norm_rel_diff", _rel(metrics["grad_norm"], ref["metrics"]["grad_norm"]), 1e-3)
    n.at_most("values_after_max_diff", _maxdiff(run.values(engine), ref["after"], mask), 1e-3)
    run.close_engine(engine)


# --- 10 --------------------------------------------------------------------------------------------

def vision(run: Run, n) -> None:
    """A tiny Qwen2-VL critic with images: fsdp on the device vs on CPU (fp32, packed: the language
    model on our packed / varlen attention, the vision tower on sdpa), then bf16."""
    from critic_adapters.common.testdata import tiny_config
    from critic_adapters.common.testdata.vision import save_vision_critic, vision_batch

    model_dir = save_vision_critic("qwen2_vl", os.path.join(run.workdir, "vision_critic"))
    config = tiny_config("qwen2_vl")
    ids, mask, images = vision_batch(config, [[(1, 4, 4)], [(1, 4, 6), (1, 2, 2)], [], [(1, 2, 4)]], seed=0, left=(1,))
    response = torch.zeros_like(mask)
    response[:, -3:] = mask[:, -3:]
    batch = RolloutBatch(ids, mask, response, torch.zeros(ids.shape), torch.randn(ids.shape) * response,
                         multi_modal_inputs=images)
    configs = {"fp32": EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=LR), mixed_precision="none"),
               "bf16": EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=LR), mixed_precision="bf16")}
    host = run.build("fsdp", configs["fp32"], dist=run.host)
    expected = host.compute_values(ids, mask, images)
    host_metrics = host.update(batch)
    for name, config_ in configs.items():
        engine = run.build("fsdp", config_)
        n[f"{name}_kernels"] = engine.load_report.kernels
        values = engine.compute_values(ids, mask, images)
        n.at_most(f"{name}_values_max_diff", _maxdiff(values, expected, mask), 1e-4 if name == "fp32" else 0.05)
        metrics = engine.update(batch)
        n.at_most(f"{name}_loss_diff", abs(metrics["value_loss"] - host_metrics["value_loss"]),
                  (1e-5 if name == "fp32" else 0.05) * max(1.0, abs(host_metrics["value_loss"])))
        run.close_engine(engine)


# --- 11 --------------------------------------------------------------------------------------------

def service(run: Run, n) -> None:
    """The critic service's door (serve/app.py, the batcher, the exactly-once updates) over a one-rank fsdp
    engine on the device: values through HTTP equal check 1's engine's own, and an update through HTTP
    moves the critic as check 1's update did."""
    from critic_adapters.serve.client import CriticClient
    from critic_adapters.serve.launch import serve_in_thread
    from critic_adapters.serve.ranks import RankZeroCritic, rank_processes

    ref, batch, mask = run.needs_reference(), run.batch, run.batch.attention_mask
    engine = run.build("fsdp")
    token = "the-gpu-check-service-token"
    _, url, stop = serve_in_thread(RankZeroCritic(engine, None, 600, rank_processes(None)),
                                   os.path.join(run.workdir, "service"), (token, None),
                                   critic_config=model_critic_config(ModelConfig(path=run.model_dir)))
    try:
        client = CriticClient(url, token, timeout_s=300, retries=0)
        (values, version), seconds = _timed(lambda: client.values(batch.input_ids, batch.attention_mask))
        n["values_http_s"] = round(seconds, 3)
        n.require("version_0", version == 0, "the values name version 0")
        n.at_most("values_max_diff", _maxdiff(torch.tensor(values), ref["values"].cpu(), mask), 1e-5)
        answer = client.update(input_ids=batch.input_ids, attention_mask=mask, response_mask=batch.response_mask,
                               old_values=batch.old_values, returns=batch.returns, request_id="gpu-check-1")
        loss = ref["metrics"]["value_loss"]
        n.at_most("loss_diff", abs(answer["metrics"]["value_loss"] - loss), 1e-5 * max(1.0, abs(loss)))
        again = client.update(input_ids=batch.input_ids, attention_mask=mask, response_mask=batch.response_mask,
                              old_values=batch.old_values, returns=batch.returns, request_id="gpu-check-1")
        n.require("retry_once", again == answer and client.version() == 1, "a retried update is applied once")
        after, version = client.values(batch.input_ids, batch.attention_mask)
        n.at_most("values_after_max_diff", _maxdiff(torch.tensor(after), ref["after"].cpu(), mask), 1e-3)
    finally:
        stop()
    run.close_engine(engine)


# (name, check, (estimated seconds with --cpu, on the H200)), in priority order.
CHECKS = [
    ("0_env", env, (15, 30)),
    ("1_fsdp_fp32_parity", fsdp_fp32_parity, (8, 40)),
    ("2_fsdp_bf16", fsdp_bf16, (5, 20)),
    ("3_megatron_fp32", megatron_fp32, (10, 60)),
    ("4_megatron_bf16", megatron_bf16, (10, 45)),
    ("5_offload_memory", offload_memory, (2, 15)),
    ("6_packed_attention", packed_attention, (2, 20)),
    ("7_fsdp_cpu_offload", fsdp_cpu_offload, (3, 20)),
    ("8_scale_bf16", scale_bf16, (8, 120)),
    ("9_veomni", veomni, (8, 40)),
    ("10_vision", vision, (8, 30)),
    ("11_service", service, (8, 30)),
]
