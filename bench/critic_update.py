"""Benchmark one critic update step and one values pass, several ways, side by side in one process on
the same data and weights.

  python -m critic_adapters.bench.critic_update [--repeats 3] [--sequences 16] [--out docs/bench.json]
                                                [--backends megatron,veomni]   (registered engines beside FSDP's)
  python bench/critic_update.py ...                  (the same, run as a file)
  bazel run //bench:critic_update -- ...             (paths are relative to where you run it)

(a) trl-valuehead   trl's AutoModelForCausalLMWithValueHead, padded: computes vocab logits it never uses
(b) padded-tokencls *ForTokenClassification, micro-batches of consecutive rows of the padded batch
(c) sorted-tokencls (b) with rows sorted by length and each micro-batch trimmed to its longest row
(d) engine          FSDPCriticEngine (world of one): packed rows, per-sequence attention, token budget
(e) <name>-engine   every other registered backend's engine (common/engine/registry.py; by default all of
                    them: megatron at TP 1, veomni), world of one, the same batch, weights and token
                    budget, alive beside the FSDP engine in this one process
Each step is a full update: forward, clipped value loss (normalised over the mini-batch), backward,
AdamW. The values pass is what PPO runs over every rollout batch before its updates: a forward-only
(no_grad) compute of the critic's values, with the same micro-batches. Reported: valid (non-padding)
tokens per second, peak memory, and for (d) the achieved FLOP/s against a torch matmul peak
measured in the same run. Variants run round-robin per repeat; the numbers are medians over repeats.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import threading
import time

if __package__ in (None, ""):  # run as a file: this checkout as the package critic_adapters
    import as_a_file  # noqa: F401  (bench/as_a_file.py)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen2Config

from critic_adapters.common.parallel.batching import plan_fixed_size
from critic_adapters.common.engine import RolloutBatch, shift_to_tokens
from critic_adapters.common.learning.loss import loss_normalizer, value_loss
from critic_adapters.common.valuehead import compute_values, load_critic
from critic_adapters.common.valuehead.config import critic_head
from critic_adapters.common.valuehead.trl_compat import require_trl_value_head_class

# The mid-size Qwen2-layout critic of the issue: hidden 512, 8 layers, vocab 32k.
MODEL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=1536, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
ROWS_PER_MICRO_BATCH = 4
CLIP = 0.2


class PeakMemory:
    """Peak memory above the start of the block: CUDA allocator stats, else sampled process RSS."""

    def __enter__(self):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = self.peak = _rss()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            self.bytes = torch.cuda.max_memory_allocated() - self.base
        else:
            self._stop.set()
            self._thread.join()
            self.bytes = max(self.peak, _rss()) - self.base


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_batch(sequences: int, seed: int = 0):
    """Prompts of 16-48 tokens, responses of 16-448: about 45% of the padded [B, T_max] is padding."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(16, 49, (sequences,), generator=g)
    response = torch.randint(16, 449, (sequences,), generator=g)
    lengths = prompt + response
    T = int(lengths.max())
    ids = torch.randint(3, MODEL["vocab_size"], (sequences, T), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    response_mask = ((torch.arange(T)[None] >= prompt[:, None]) & mask.bool()).long()
    returns = torch.randn(sequences, T, generator=g) * response_mask
    old_values = torch.randn(sequences, T, generator=g) * 0.1 * response_mask
    return RolloutBatch(ids * mask, mask, response_mask, old_values, returns)


def padded_step(model, optimizer, batch: RolloutBatch, plan: list[list[int]], *, trim: bool, trl: bool):
    """(a)-(c): micro-batches of rows; loss normalised over the whole mini-batch, then AdamW."""
    model.train()
    normalizer = loss_normalizer(batch.response_mask, "token-mean")
    for rows in plan:
        ids, mask = batch.input_ids[rows], batch.attention_mask[rows]
        if trim:
            ids, mask = ids[:, : int(mask.sum(1).max())], mask[:, : int(mask.sum(1).max())]
        if trl:
            values = model(input_ids=ids, attention_mask=mask)[2].float()  # also builds [b, T, vocab] logits
        else:
            values = compute_values(model, ids, mask)
        T = values.shape[1]
        loss, _ = value_loss(shift_to_tokens(values), batch.old_values[rows][:, :T], batch.returns[rows][:, :T],
                             batch.response_mask[rows][:, :T], clip_range=CLIP, normalizer=normalizer)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def padded_values(model, batch: RolloutBatch, plan: list[list[int]], *, trim: bool, trl: bool) -> None:
    """(a)-(c), values only: forward-only over the same micro-batches as the update."""
    model.eval()
    for rows in plan:
        ids, mask = batch.input_ids[rows], batch.attention_mask[rows]
        if trim:
            ids, mask = ids[:, : int(mask.sum(1).max())], mask[:, : int(mask.sum(1).max())]
        if trl:
            model(input_ids=ids, attention_mask=mask)[2].float()
        else:
            compute_values(model, ids, mask)


def model_flops(batch: RolloutBatch, critic) -> float:
    """Forward+backward FLOPs of the useful work: 6 x non-embedding params per valid token, plus causal
    attention 6 x layers x hidden x sum(L_i^2) (QK^T and AV, fwd 2x + bwd 4x, halved for causality)."""
    params = sum(p.numel() for n, p in critic.named_parameters() if "embed_tokens" not in n)
    lengths = batch.attention_mask.sum(1).double()
    tokens = float(lengths.sum())
    attention = 6 * MODEL["num_hidden_layers"] * MODEL["hidden_size"] * float((lengths ** 2).sum())
    return 6 * params * tokens + attention


def matmul_peak(repeats: int = 5, size: int = 2048) -> float:
    """FLOP/s of a large square fp32 matmul on this device (the best a GEMM-bound step could reach)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    a @ b
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * size ** 3 / statistics.median(times)


def build(workdir: str, sequences: int, other_backends: list[str], lora_rank: int = 0):
    import dataclasses

    from critic_adapters.common.engine.config import (BatchingConfig, EngineConfig, LoRAConfig, LossConfig, ModelConfig,
                                               OptimConfig)
    from critic_adapters.common.parallel.distributed import init_distributed
    from critic_adapters.common.engine import build_engine
    from critic_adapters.backends.fsdp.engine import FSDPCriticEngine
    from critic_adapters.common.valuehead._quiet import quiet_transformers

    torch.manual_seed(0)
    causal = AutoModelForCausalLM.from_config(Qwen2Config(**MODEL))
    path = os.path.join(workdir, "model")
    with quiet_transformers():  # no "Writing model shards" progress bar
        causal.save_pretrained(path)
    critic, _ = load_critic(path, attn_implementation="sdpa")  # fresh head, seed 0: same weights everywhere
    trl = require_trl_value_head_class().from_pretrained(causal, summary_dropout_prob=0.0)
    with torch.no_grad():
        trl.v_head.summary.weight.copy_(critic_head(critic).weight)
        trl.v_head.summary.bias.copy_(critic_head(critic).bias)
    batch = make_batch(sequences)
    budget = ROWS_PER_MICRO_BATCH * batch.input_ids.shape[1]  # the same memory envelope as 4 padded rows
    engine_config = EngineConfig(
        model=ModelConfig(path=path), optim=OptimConfig(lr=1e-5),
        loss=LossConfig(clip_range=CLIP), batching=BatchingConfig(packing=True, micro_batch_tokens=budget),
    )
    dist = init_distributed()
    engine = FSDPCriticEngine(engine_config, dist)
    # Other backends' engines, side by side with the FSDP one (same weights, batch and budget).
    others = {name: build_engine(name, engine_config, dist) for name in other_backends}
    if lora_rank:  # a LoRA critic on every engine run: the same weights, batch and budget
        lora_config = dataclasses.replace(engine_config, lora=LoRAConfig(rank=lora_rank))
        for name in ["fsdp", *other_backends]:
            others[f"{name}-lora{lora_rank}"] = build_engine(name, lora_config, dist)
    rows = plan_fixed_size(sequences, ROWS_PER_MICRO_BATCH)
    by_length = sorted(range(sequences), key=lambda i: -int(batch.attention_mask[i].sum()))
    sorted_rows = [by_length[i:i + ROWS_PER_MICRO_BATCH] for i in range(0, sequences, ROWS_PER_MICRO_BATCH)]
    adam = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-5)  # noqa: E731
    trl_opt, critic_opt = adam(trl), adam(critic)
    variants = {
        "trl-valuehead": lambda: padded_step(trl, trl_opt, batch, rows, trim=False, trl=True),
        "padded-tokencls": lambda: padded_step(critic, critic_opt, batch, rows, trim=False, trl=False),
        "sorted-tokencls": lambda: padded_step(critic, critic_opt, batch, sorted_rows, trim=True, trl=False),
        "engine": lambda: engine.update(batch),
        "values:trl-valuehead": lambda: padded_values(trl, batch, rows, trim=False, trl=True),
        "values:padded-tokencls": lambda: padded_values(critic, batch, rows, trim=False, trl=False),
        "values:sorted-tokencls": lambda: padded_values(critic, batch, sorted_rows, trim=True, trl=False),
        "values:engine": lambda: engine.compute_values(batch.input_ids, batch.attention_mask),
    }
    for name, other in others.items():
        variants[f"{name}-engine"] = functools.partial(other.update, batch)
        variants[f"values:{name}-engine"] = functools.partial(other.compute_values, batch.input_ids,
                                                              batch.attention_mask)
    return variants, batch, critic, {"fsdp": engine, **others}


def _tensors_of(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_of(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors_of(value)


def _optimizer_tensors(optimizer):
    """The state tensors of an optimizer, through megatron's wrappers (.optimizer, .chained_optimizers)."""
    for inner in getattr(optimizer, "chained_optimizers", None) or [getattr(optimizer, "optimizer", None)]:
        if inner is not None and inner is not optimizer:
            yield from _optimizer_tensors(inner)
    yield from _tensors_of(dict(getattr(optimizer, "state", {}) or {}))


def training_state_bytes(engine) -> int:
    """What an engine keeps between steps, read off its tensors: parameters, gradients (megatron's
    main_grad buffers) and optimizer state, each storage once. Peak RSS of engines sharing one process
    says little (activations dominate it and the allocator keeps freed pages); this is what LoRA saves."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0

    def add(tensor):
        nonlocal total
        if tensor is None:
            return
        tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    for param in engine.model.parameters():
        add(param)
        add(param.grad)
        add(getattr(param, "main_grad", None))
    for tensor in _optimizer_tensors(engine.optimizer):
        add(tensor)
    return total


def _step_name(engine: str) -> str:
    """The variant that times an engine's update ("engine" is the FSDP one's)."""
    return "engine" if engine == "fsdp" else f"{engine}-engine"


def lora_vs_full(state: dict, median: dict, rank: int) -> dict:
    """Per backend, its LoRA critic against its full-parameter one, as lora / full: training state
    (training_state_bytes) and median step time."""
    suffix = f"-lora{rank}"
    return {name.removesuffix(suffix): {
        "memory": state[name] / state[name.removesuffix(suffix)],
        "time": median[_step_name(name)] / median[_step_name(name.removesuffix(suffix))]}
        for name in state if rank and name.endswith(suffix)}


def main(argv=None) -> int:
    summary, _usage, variants = __doc__.split("\n\n")[:3]  # (argparse prints its own usage)
    parser = argparse.ArgumentParser(description=f"{summary}\n\n{variants}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds of every variant (the median is reported)")
    parser.add_argument("--sequences", type=int, default=16, help="rows of the mini-batch")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--lora-rank", type=int, default=16,
                        help="also run a LoRA critic of this rank on every engine (default 16; 0: none)")
    from critic_adapters.common.engine.registry import BACKENDS

    others = ",".join(sorted(name for name in BACKENDS if name != "fsdp"))
    parser.add_argument("--backends", default=others,
                        help=f"other registered engines to run beside the FSDP one (comma-separated; '' for "
                             f"none; default {others})")
    args = parser.parse_args(argv)
    other_backends = [name for name in args.backends.split(",") if name]
    if "BUILD_WORKING_DIRECTORY" in os.environ:  # `bazel run`: --out is relative to the user's directory
        os.chdir(os.environ["BUILD_WORKING_DIRECTORY"])

    with tempfile.TemporaryDirectory() as workdir:
        variants, batch, critic, engines = build(workdir, args.sequences, other_backends, args.lora_rank)
        valid = int(batch.attention_mask.sum())
        padded = batch.attention_mask.numel()
        print(f"batch: {args.sequences} sequences, {valid} valid tokens of {padded} padded "
              f"({100 * (1 - valid / padded):.0f}% padding); torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads", flush=True)
        times = {name: [] for name in variants}
        memory = {}
        for name, step in variants.items():  # warm-up, and the peak-memory reading
            with PeakMemory() as peak:
                step()
            memory[name] = peak.bytes
        peaks = []
        for repeat in range(args.repeats):
            peaks.append(matmul_peak())
            for name, step in variants.items():
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
            print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(
                f"{n} {t[-1]:.2f}s" for n, t in times.items()), flush=True)
        state = {name: training_state_bytes(engine) for name, engine in engines.items()}
        for engine in engines.values():
            engine.close()

    median = {name: statistics.median(t) for name, t in times.items()}
    rate = {name: valid / t for name, t in median.items()}
    peak = statistics.median(peaks)
    flops = model_flops(batch, critic) / median["engine"]
    print(f"\n{'variant':<24}{'median s':>10}{'valid tok/s':>13}{'vs (a)':>8}{'peak mem MiB':>14}")
    for name in variants:
        baseline = "values:trl-valuehead" if name.startswith("values:") else "trl-valuehead"
        print(f"{name:<24}{median[name]:>10.3f}{rate[name]:>13.0f}{rate[name] / rate[baseline]:>8.2f}"
              f"{memory[name] / 2**20:>14.0f}")
    print(f"matmul peak {peak / 1e9:.1f} GFLOP/s; engine achieves {flops / 1e9:.1f} GFLOP/s of model FLOPs")
    result = {
        "speedup_vs_trl": rate["engine"] / rate["trl-valuehead"],
        "speedup_vs_padded": rate["engine"] / rate["padded-tokencls"],
        "speedup_vs_sorted": rate["engine"] / rate["sorted-tokencls"],
        "values_speedup_vs_trl": rate["values:engine"] / rate["values:trl-valuehead"],
        "values_speedup_vs_padded": rate["values:engine"] / rate["values:padded-tokencls"],
        "values_speedup_vs_sorted": rate["values:engine"] / rate["values:sorted-tokencls"],
        "other_engines_vs_fsdp": {name: {"update": rate[f"{name}-engine"] / rate["engine"],
                                         "values": rate[f"values:{name}-engine"] / rate["values:engine"]}
                                  for name in other_backends},
        "lora_vs_full": lora_vs_full(state, median, args.lora_rank),
        "training_state_bytes": state,
        "peak_fraction": flops / peak,
        "median_step_s": median, "valid_tokens_per_s": rate, "peak_memory_bytes": memory,
        "matmul_peak_flops": peak, "engine_model_flops": flops, "valid_tokens": valid, "padded_tokens": padded,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    for name, ratio in result["other_engines_vs_fsdp"].items():
        print(f"{name} vs fsdp engine: {ratio['update']:.2f} (values pass: {ratio['values']:.2f})")
    if result["lora_vs_full"]:
        print("training state (parameters, gradients, optimizer): " + ", ".join(
            f"{name} {bytes_ / 2**20:.1f} MiB" for name, bytes_ in state.items()))
        for name, ratio in result["lora_vs_full"].items():
            if name != "fsdp":
                print(f"lora vs full ({name}): memory {ratio['memory']:.2f}x, time {ratio['time']:.2f}x")
        fsdp = result["lora_vs_full"]["fsdp"]
        print(f"lora vs full: memory {fsdp['memory']:.2f}x, time {fsdp['time']:.2f}x (fsdp, rank {args.lora_rank})")
    print(f"values speedup vs trl-valuehead: {result['values_speedup_vs_trl']:.2f}, vs padded-tokencls: "
          f"{result['values_speedup_vs_padded']:.2f}, vs sorted-tokencls: {result['values_speedup_vs_sorted']:.2f}")
    print(f"speedup vs trl-valuehead: {result['speedup_vs_trl']:.2f}, vs padded-tokencls: "
          f"{result['speedup_vs_padded']:.2f}, vs sorted-tokencls: {result['speedup_vs_sorted']:.2f}, "
          f"peak fraction: {result['peak_fraction']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
