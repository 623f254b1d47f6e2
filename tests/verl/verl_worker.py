"""Runs inside the verl overlay (.overlays/verl-0.9.1 on PYTHONPATH: verl 0.9.1, transformers 5.10.4):
verl's own TrainingWorker, without Ray, in a world of one gloo process on CPU, fp32.

  python -m critic_adapters.tests.verl.verl_worker CHECK OUT_FILE [ARGS...]

CHECK:
  parity MODEL_DIR BACKEND   our engine (BACKEND: fsdp, veomni, megatron, megatron-tp2, ...; with
                             -offload / -paramoffload / -optoffload: verl's offload keys) and verl's own
                             fsdp2 value-model engine, the same critic and global batch: values
                             before, one train_mini_batch, values after; what our engine holds off
                             its device after reset and after each phase
  value_mask MODEL_DIR BACKEND   one train_mini_batch with a value_mask key in verl's batch and one
                             with response_mask replaced by response_mask & value_mask (parity's
                             critic and batch, a fresh worker each), padded then in the v1 layout;
                             the errors for a value_mask outside response_mask or of another layout
  vision MODEL_DIR BACKEND    a Qwen-VL critic with multi_modal_inputs in verl's batch (padded and
                             v1 layouts, fixed and dynamic micro-batches, the pixels zeroed): values
                             and one train_mini_batch each, and the same through our engine directly
  resume MODEL_DIR BACKEND WORKDIR   a step, save_checkpoint, a step; a new worker loads the
                             checkpoint and takes the same step
  save_hf MODEL_DIR OUT_DIR DTYPE   verl's own fsdp2 value-model engine at model_dtype DTYPE (fp32,
                             bf16) saves the critic with hf_model in its checkpoint contents: the
                             HF critic verl writes, in OUT_DIR/huggingface (the committed fixture
                             tests/testdata/verl-fsdp2-bf16 is its bf16 output)
  formats DIR...             per critic directory: our engine's values through verl's infer_batch
                             and our compute_values; one training step
  config MODEL_DIR           verl's configs mapped onto ours, and the settings that are refused
  yaml FILE|- OVERRIDES...   verl's ppo_trainer.yaml through hydra with a YAML snippet and overrides
  batch JSON                 several of the checks above in this one process, one after another
                             (JSON: a list of [CHECK, ARGS...]); a list of their results
Writes a torch.save'd dict to OUT_FILE (under torchrun, each rank to OUT_FILE.rank<r>: its share of
the batch, as verl's dispatch splits it over the data-parallel ranks).

The batch is what verl's PPO trainer hands its critic: left-padded prompts and right-padded
responses through verl's DataProto and left_right_2_no_padding (values and returns added for the
update). What is set up for CPU (and only that): verl's process-group environment, our CPU
platform (integrations/verl/cpu_platform.py, installed by importing the package),
VERL_ENGINE_DEVICE=cuda so that verl's own engine (registered for cuda/npu only) is found, and
verl.utils.model.load_valuehead_model replaced by ours (the same signature; verl's hard-codes
flash_attention_2, which needs CUDA).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import warnings
from functools import partial


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if "RANK" not in os.environ:  # not under torchrun: a world of one (what verl's Worker reads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
os.environ.update(VERL_ENGINE_DEVICE="cuda", VERL_USE_EXTERNAL_PLUGINS="none")
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import critic_adapters.integrations.verl as ours  # noqa: E402  (registers the engine; CPU platform)

# The process group is verl's to create (TrainingWorker does, through our CPU platform: plain gloo).
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

import verl.utils.model as verl_model_utils  # noqa: E402

from critic_adapters.common.valuehead import compute_values, load_critic, load_valuehead_model  # noqa: E402

verl_model_utils.load_valuehead_model = load_valuehead_model  # read lazily by verl's fsdp engine

from verl import DataProto  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import FSDPCriticConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig  # noqa: E402
from verl.workers.config import TrainingWorkerConfig  # noqa: E402
from verl.workers.engine_workers import TrainingWorker  # noqa: E402
from verl.workers.utils.losses import value_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

B, P, R = 4, 5, 6  # sequences, prompt width, response width
MICRO = 2  # sequences per micro-batch (verl's micro_batch_size_per_gpu): 2 micro-batches per step
LR = 1e-3
CRITIC = FSDPCriticConfig(strategy="fsdp2", ppo_micro_batch_size_per_gpu=MICRO, ppo_mini_batch_size=B,
                          cliprange_value=0.5, loss_agg_mode="token-mean")
ENGINE_FIELDS = dict(model_dtype="fp32", mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32",
                                                          "buffer_dtype": "fp32"},
                     use_torch_compile=False, wrap_policy={"min_num_params": 0}, use_dynamic_bsz=False,
                     micro_batch_size_per_gpu=MICRO, infer_micro_batch_size_per_gpu=MICRO, seed=0)


def degree(backend: str, key: str) -> int:
    """'megatron-tp2': megatron at tensor degree 2 ('tp'); 'megatron-cp2': context degree 2 ('cp');
    'fsdp-sp2': Ulysses degree 2 ('sp', set through verl's own ulysses_sequence_parallel_size)."""
    for part in backend.split("-")[1:]:
        if part.startswith(key) and part[len(key):].isdigit():
            return int(part[len(key):])
    return 1


def offload_keys(backend: str) -> dict[str, bool]:
    """verl's critic.fsdp offload keys from the name: '-offload' (fsdp-offload, megatron-tp2-offload)
    both on, '-paramoffload' param_offload only, '-optoffload' optimizer_offload only."""
    parts = backend.split("-")
    return {"param_offload": "offload" in parts or "paramoffload" in parts,
            "optimizer_offload": "offload" in parts or "optoffload" in parts}


def verl_configs(model_dir: str, backend: str) -> tuple:
    """verl's (model, engine, optimizer) configs of make_worker's critic on `backend`."""
    if backend == "verl-fsdp2":
        engine = FSDPEngineConfig(strategy="fsdp2", **ENGINE_FIELDS)
    else:
        engine = ours.CriticAdaptersEngineConfig(critic_adapters_backend=backend.partition("-")[0], critic_adapters={
            "parallel": {"tensor": degree(backend, "tp"), "context": degree(backend, "cp")}},
            ulysses_sequence_parallel_size=degree(backend, "sp"),
            **offload_keys(backend),
            **ENGINE_FIELDS)
    model = HFModelConfig(path=model_dir, load_tokenizer=False, use_remove_padding=False,
                          enable_gradient_checkpointing=False, override_config={"attn_implementation": "sdpa"})
    return model, engine, FSDPOptimizerConfig(lr=LR, total_training_steps=10, clip_grad=1.0, weight_decay=0.0)


def make_worker(model_dir: str, backend: str) -> TrainingWorker:
    """verl's TrainingWorker on `backend`: 'verl-fsdp2' (verl's own engine) or one of ours
    ('fsdp', 'veomni', 'megatron', 'megatron-tp2', 'fsdp-sp2'; offload suffixes: offload_keys), after reset()."""
    model, engine, optimizer = verl_configs(model_dir, backend)
    worker = TrainingWorker(TrainingWorkerConfig(
        model_type="value_model", model_config=model, engine_config=engine, optimizer_config=optimizer,
        checkpoint_config=CheckpointConfig()))
    worker.reset()
    worker.set_loss_fn(partial(value_loss, config=CRITIC))
    return worker


def padded_batch(seed: int = 1, data_parallel: int | None = None):
    """Left-padded prompts and right-padded responses of different lengths, as verl's rollout gives;
    this rank's share of them (B / data_parallel rows, default one share per process: what verl's
    dispatch hands each data-parallel rank; tensor-parallel peers get the same share)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens, response_lens = [5, 3, 4, 2], [6, 2, 4, 5]
    prompts = torch.zeros(B, P, dtype=torch.long)
    responses = torch.zeros(B, R, dtype=torch.long)
    attention = torch.zeros(B, P + R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        prompts[i, P - p:] = torch.randint(3, 990, (p,), generator=g)
        responses[i, :r] = torch.randint(3, 990, (r,), generator=g)
        attention[i, P - p:P + r] = 1
    returns = torch.randn(B, R, generator=g) * attention[:, P:]
    tensors = {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
               "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
               "response_mask": attention[:, P:].clone()}
    share = share_rows(data_parallel)
    return {name: tensor[share] for name, tensor in tensors.items()}, returns[share]


def share_rows(data_parallel: int | None = None) -> slice:
    """This rank's rows of the global batch: data-parallel share dp_rank of `data_parallel`."""
    dp = WORLD if data_parallel is None else data_parallel
    dp_rank = RANK // (WORLD // dp)
    return slice(dp_rank * B // dp, (dp_rank + 1) * B // dp)


def verl_batch(tensors: dict, extra: dict | None = None, images: list | None = None):
    """verl's critic batch: a DataProto of these tensors, with the rows' images (one dict or None per
    row) as its non_tensor_batch's multi_modal_inputs, through left_right_2_no_padding."""
    non_tensors = None
    if images is not None:
        column = np.empty(len(images), dtype=object)  # one dict per row, as verl's rollout stores them
        column[:] = images
        non_tensors = {"multi_modal_inputs": column}
    data = DataProto.from_dict(tensors={**tensors, **(extra or {})}, non_tensors=non_tensors,
                               meta_info={"temperature": 1.0})
    return left_right_2_no_padding(data.to_tensordict())


def infer(worker, tensors, images: list | None = None, max_token_len: int | None = None) -> torch.Tensor | None:
    """The critic's values for the responses, [B, R], as verl's trainer reads them (_compute_values);
    None on a rank verl does not collect outputs from (a tensor-parallel peer). max_token_len: verl's
    dynamic micro-batches (use_dynamic_bsz) of at most that many tokens, rows regrouped by length."""
    td = verl_batch(tensors, images=images)
    tu.assign_non_tensor(td, compute_loss=False)
    if max_token_len is not None:
        tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=max_token_len)
    output = worker.infer_batch(td)
    if output is None:
        return None
    return no_padding_2_padding(tu.get(output, "values"), td).float() * tensors["response_mask"]


def train(worker, tensors, old_values, returns, extra: dict | None = None, images: list | None = None) -> dict:
    """One update on the whole batch (verl's _update_critic: train_mini_batch), `extra` keys added
    to it; its metrics."""
    td = verl_batch(tensors, {"values": old_values, "returns": returns, **(extra or {})}, images)
    tu.assign_non_tensor(td, global_batch_size=B, mini_batch_size=B, epochs=1, seed=42,
                         dataloader_kwargs={"shuffle": False})
    output = worker.train_mini_batch(td)
    if output is None:  # a rank verl does not collect outputs from
        return None
    metrics = tu.get(output, "metrics")
    return {key: value for key, value in metrics.items() if not key.startswith("perf/") and key != "mfu"}


def v1_batch(tensors: dict, old_values=None, returns=None, value_mask=None, value_mask_as: str = "key",
             images: list | None = None):
    """The same rows in the layout of verl's v1 trainer (its default, trainer.use_v1): every
    per-sample field nested, responses' values and returns nested over their tokens, no
    attention_mask. A value_mask ([B, R]) goes in nested the same way, as the key value_mask
    (value_mask_as="key") or as response_mask and loss_mask themselves ("response_mask"). Images:
    each row's multi_modal_inputs, as verl's v1 agent loop stores them per row."""
    rows = []
    prompt_width = tensors["prompts"].shape[1]
    for i in range(tensors["input_ids"].shape[0]):
        valid = tensors["attention_mask"][i].bool()
        prompt, response = int(valid[:prompt_width].sum()), int(tensors["response_mask"][i].sum())
        ids = tensors["input_ids"][i][valid]
        row = {"prompts": ids[:prompt], "responses": ids[prompt:], "input_ids": ids,
               "position_ids": tensors["position_ids"][i][..., valid],  # 0..n-1 (text), or [4, n] (Qwen-VL)
               "response_mask": torch.ones(response, dtype=torch.long),
               "loss_mask": torch.ones(response, dtype=torch.long)}
        if images is not None:
            row["multi_modal_inputs"] = images[i]
        if old_values is not None:
            row.update(values=old_values[i, :response], returns=returns[i, :response])
        if value_mask is not None:
            kept = value_mask[i, :response]
            row.update({"value_mask": kept} if value_mask_as == "key" else {"response_mask": kept, "loss_mask": kept})
        rows.append(row)
    td = tu.list_of_dict_to_tensordict(rows)
    tu.assign_non_tensor(td, temperature=1.0)
    return td


def v1_step(worker, tensors, old_values, returns, **keys) -> tuple[torch.Tensor | None, dict | None]:
    """verl's v1 trainer's critic calls on `tensors`: values ([B, R], read back with verl's own
    no_padding_2_padding) and one train_mini_batch's metrics (keys: v1_batch's value_mask keys, images)."""
    td = v1_batch(tensors, **keys)
    tu.assign_non_tensor(td, compute_loss=False)
    output = worker.infer_batch(td)
    values = None if output is None else no_padding_2_padding(tu.get(output, "values"), td).float()
    td = v1_batch(tensors, old_values, returns, **keys)
    tu.assign_non_tensor(td, global_batch_size=B, mini_batch_size=B, epochs=1, seed=42,
                         dataloader_kwargs={"shuffle": False})
    output = worker.train_mini_batch(td)
    metrics = None if output is None else {k: v for k, v in tu.get(output, "metrics").items()
                                           if not k.startswith("perf/") and k != "mfu"}
    return values, metrics


def our_values(model_dir: str, tensors) -> torch.Tensor:
    """Our load_critic + compute_values on each sequence alone (its valid tokens), the value of each
    response token read at the position before it: [B, R]."""
    critic, _ = load_critic(model_dir)
    rows = tensors["input_ids"].shape[0]
    out = torch.zeros(rows, R)
    for i in range(rows):
        ids = tensors["input_ids"][i][tensors["attention_mask"][i].bool()]
        prompt = int(tensors["attention_mask"][i, :P].sum())
        response = int(tensors["response_mask"][i].sum())
        with torch.no_grad():
            values = compute_values(critic, ids[None], None)[0]
        out[i, :response] = values[prompt - 1:prompt + response - 1]
    return out


def parity(model_dir: str, backend: str) -> dict:
    """Both engines on the same global batch, each rank on its data-parallel share (ours holds more
    rows than verl's engine under tensor parallelism): per engine, its rows of the global batch,
    our compute_values on them, values before and after one train_mini_batch, its metrics."""
    out = {}
    for name in (backend, "verl-fsdp2"):
        split = degree(name, "tp") * degree(name, "cp") * degree(name, "sp")
        dp = WORLD // split if name != "verl-fsdp2" else WORLD
        tensors, returns = padded_batch(data_parallel=dp)
        reference = our_values(model_dir, tensors)  # also the update's old values, on every rank
        worker = make_worker(model_dir, name)
        phases = [("after reset", offloaded(worker))]  # what our engine holds off its device after each step
        before = infer(worker, tensors)
        phases.append(("after infer", offloaded(worker)))
        metrics = train(worker, tensors, reference, returns)
        phases.append(("after train", offloaded(worker)))
        share = share_rows(dp)
        out[name] = {"rows": (share.start, share.stop), "reference": reference,
                     "response_mask": tensors["response_mask"], "before": before, "metrics": metrics,
                     "after": infer(worker, tensors), "engine": type(worker.engine).__name__}
        phases.append(("after infer", offloaded(worker)))
        out[name]["phases"] = phases
        # Then the v1 trainer's layout, from the state after that step.
        out[name]["v1_values"], out[name]["v1_metrics"] = v1_step(worker, tensors, reference, returns)
        close = getattr(getattr(worker.engine, "engine", None), "close", None)
        if close is not None:  # megatron keeps one layout per process: the next run may want another
            close()
        del worker
    return out


# Per sequence of the global batch (responses of 6, 2, 4, 5 tokens): how many leading response tokens
# the value_mask keeps (the rest as if after a terminal turn), so that the ranks' shares differ.
VALUE_TOKENS = [4, 1, 3, 5]


def value_mask(model_dir: str, backend: str) -> dict:
    """A value_mask key in verl's batch against response_mask replaced by response_mask & value_mask:
    per form, a fresh worker on parity's critic and batch, one train_mini_batch's metrics and the
    values after it, then the v1 layout's; then, on the key's worker, the errors for a value_mask
    outside response_mask (one token, on the last data-parallel rank's rows only) and of another shape."""
    tensors, returns = padded_batch()
    share = share_rows()
    mask = tensors["response_mask"] * (torch.arange(R)[None] < torch.tensor(VALUE_TOKENS)[share, None])
    reference = our_values(model_dir, tensors)
    out = {"value_mask": mask}
    for form in ("key", "response_mask"):
        worker = make_worker(model_dir, backend)
        if form == "key":
            metrics = train(worker, tensors, reference, returns, {"value_mask": mask})
        else:
            metrics = train(worker, {**tensors, "response_mask": mask}, reference, returns)
        after = infer(worker, tensors)
        _, v1_metrics = v1_step(worker, tensors, reference, returns, value_mask=mask, value_mask_as=form)
        out[form] = {"metrics": metrics, "after": after, "v1_metrics": v1_metrics, "v1_after": infer(worker, tensors)}
        if form == "key":
            outside = torch.zeros(B, R, dtype=mask.dtype)
            outside[B - 1, R - 1] = 1  # past the last sequence's response
            errors = {}
            for name, bad in (("outside", mask | outside[share]), ("shape", mask[:, :-1])):
                try:
                    train(worker, tensors, reference, returns, {"value_mask": bad})
                    errors[name] = None
                except ValueError as err:
                    errors[name] = str(err)
            out["errors"] = errors
        worker.engine.engine.close()
        del worker
    return out


# The vision check's rows: each prompt's images (grids t, h, w in patches), a text-only row among them.
VISION_LAYOUT = [[(1, 4, 4)], [(1, 2, 4), (1, 2, 2)], [], [(1, 2, 2)]]


def vision_batch(model_dir: str, seed: int = 3) -> tuple[dict, torch.Tensor, list]:
    """(tensors, returns [B, R], images) of a Qwen-VL critic's batch as verl's trainer hands it:
    prompts with the processor's expanded image placeholders (left-padded), text responses
    (right-padded), position_ids [B, 4, T] (verl's layout: text positions, then the multimodal rope's
    t/h/w from the family's get_rope_index), and per row the processor's tensors ({} for the text
    row) with the images_seqlens key verl's agent loop adds for its FLOPs count."""
    from critic_adapters.common.testdata.vision import image_row
    from critic_adapters.common.valuehead.multimodal import sequence_positions

    critic, _ = load_critic(model_dir)
    g = torch.Generator().manual_seed(seed)
    prompts, images = [], []
    for grids in VISION_LAYOUT:
        ids, row = image_row(critic.config, grids, before=2, after=3, generator=g)
        prompts.append(ids)
        if row is not None:
            grid = row["image_grid_thw"]
            row["images_seqlens"] = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
        images.append(row or {})
    response_lens = [6, 2, 4, 5]
    width = max(ids.numel() for ids in prompts)
    input_ids = torch.zeros(B, width + R, dtype=torch.long)
    attention = torch.zeros(B, width + R, dtype=torch.long)
    for i, (ids, r) in enumerate(zip(prompts, response_lens)):
        input_ids[i, width - ids.numel():width] = ids
        input_ids[i, width:width + r] = torch.randint(3, 900, (r,), generator=g)
        attention[i, width - ids.numel():width + r] = 1
    positions = torch.zeros(B, 4, width + R, dtype=torch.long)
    positions[:, 0] = (attention.cumsum(-1) - 1).clamp(min=0)
    for i in range(B):
        valid = attention[i].bool()
        positions[i, 1:, valid] = sequence_positions(critic, input_ids[i][valid], images[i])
    returns = torch.randn(B, R, generator=g) * attention[:, width:]
    tensors = {"prompts": input_ids[:, :width], "responses": input_ids[:, width:], "input_ids": input_ids,
               "attention_mask": attention, "position_ids": positions, "response_mask": attention[:, width:].clone()}
    return tensors, returns, images


def vision(model_dir: str, backend: str) -> dict:
    """A Qwen-VL critic in verl's slot with multi_modal_inputs in verl's batch (this rank's share of
    vision_batch): values through infer_batch (verl's fixed micro-batches, its dynamic ones, the
    pixels zeroed), one train_mini_batch and the values after it, then the v1 layout's values and
    step; and the same through our engine directly (built from the config verl's keys map to):
    compute_values, update, compute_values, update (the v1 step's), on the same rows and images."""
    from critic_adapters.common.engine import RolloutBatch, shift_to_tokens
    from critic_adapters.common.engine.registry import build_engine
    from critic_adapters.common.parallel.distributed import init_distributed
    from verl.workers.engine.utils import prepare_micro_batches

    tensors, returns, images = vision_batch(model_dir)
    longest = int(tensors["attention_mask"].sum(-1).max())  # over every rank's rows: verl's dynamic limit is global
    share = share_rows()  # this rank's rows, as verl's dispatch hands them; each with its images
    tensors, returns, images = {k: v[share] for k, v in tensors.items()}, returns[share], images[share]
    width = tensors["prompts"].shape[1]
    ids, mask, response = tensors["input_ids"], tensors["attention_mask"], tensors["response_mask"]
    zeroed = [dict(row, pixel_values=row["pixel_values"] * 0) if row else row for row in images]
    # verl's dynamic micro-batches of these rows (two, regrouped by length: what infer_batch splits them into)
    max_tokens = max(longest, (int(mask.sum()) + 1) // 2)
    td = verl_batch(tensors, images=images)
    tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=max_tokens)
    _, groups = prepare_micro_batches(data=td, same_micro_num_in_dp=True)
    out = {"tensors": tensors, "returns": returns, "images": images, "dynamic_groups": groups}

    worker = make_worker(model_dir, backend)
    before = infer(worker, tensors, images)
    out["verl"] = {"before": before, "zeroed": infer(worker, tensors, zeroed),
                   "dynamic": infer(worker, tensors, images, max_token_len=max_tokens)}
    try:  # the image rows without multi_modal_inputs in verl's batch: refused, never computed blind (issue 49)
        infer(worker, tensors)
        out["verl"]["blind"] = None
    except ValueError as error:
        out["verl"]["blind"] = str(error)
    old = before.clone()
    out["verl"]["metrics"] = train(worker, tensors, old, returns, images=images)
    out["verl"]["after"] = infer(worker, tensors, images)
    out["verl"]["v1_values"], out["verl"]["v1_metrics"] = v1_step(worker, tensors, old, returns, images=images)
    out["verl"]["v1_after"] = infer(worker, tensors, images)
    worker.engine.engine.close()
    del worker

    def whole(per_response: torch.Tensor) -> torch.Tensor:  # [B, R] on the response tokens -> [B, T]
        full = torch.zeros(ids.shape, dtype=per_response.dtype)
        full[:, width:] = per_response
        return full

    def responses(values: torch.Tensor) -> torch.Tensor:  # [B, T] unshifted -> [B, R], as verl reads them
        return shift_to_tokens(values)[:, width:] * response

    _, config = ours.engine_config_from_verl(*verl_configs(model_dir, backend))
    engine = build_engine(backend.partition("-")[0], config, init_distributed())
    images = [{key: value for key, value in row.items() if key != "images_seqlens"} for row in images]  # verl's own
    step = RolloutBatch(ids, mask, whole(response), whole(old), whole(returns), multi_modal_inputs=images)
    out["ours"] = {"before": responses(engine.compute_values(ids, mask, images)), "metrics": engine.update(step),
                   "after": responses(engine.compute_values(ids, mask, images)), "v1_metrics": engine.update(step),
                   "v1_after": responses(engine.compute_values(ids, mask, images))}
    engine.close()
    return out


def offloaded(worker) -> list[str] | None:
    """What our engine (under verl's) holds off its device now; None for verl's own engine."""
    inner = getattr(worker.engine, "engine", None)
    return None if inner is None else sorted(inner.offloaded)


def resume(model_dir: str, backend: str, workdir: str) -> dict:
    tensors, returns = padded_batch()
    worker = make_worker(model_dir, backend)
    start = infer(worker, tensors)
    train(worker, tensors, start, returns)
    checkpoint = os.path.join(workdir, "global_step_1", "critic")
    worker.save_checkpoint(checkpoint, global_step=1, max_ckpt_to_keep=2)
    continued = train(worker, tensors, start, returns), infer(worker, tensors)
    del worker
    resumed_worker = make_worker(model_dir, backend)
    resumed_worker.load_checkpoint(checkpoint)
    resumed = train(resumed_worker, tensors, start, returns), infer(resumed_worker, tensors)
    return {"continued": continued, "resumed": resumed, "files": sorted(os.listdir(checkpoint))}


def save_hf(model_dir: str, out_dir: str, dtype: str) -> dict:
    """verl's own engine, built at model_dtype `dtype`, saves the critic with its checkpoint manager's
    hf_model contents (verl/utils/checkpoint: an HF critic in OUT_DIR/huggingface, written by rank 0):
    what verl users hand to another stack. {file: size} of that directory."""
    model, engine, optimizer = verl_configs(model_dir, "verl-fsdp2")
    engine = dataclasses.replace(engine, model_dtype=dtype)
    worker = TrainingWorker(TrainingWorkerConfig(
        model_type="value_model", model_config=model, engine_config=engine, optimizer_config=optimizer,
        checkpoint_config=CheckpointConfig(save_contents=["model", "hf_model"])))
    worker.reset()
    worker.save_checkpoint(out_dir, global_step=0, max_ckpt_to_keep=1)
    hf_dir = os.path.join(out_dir, "huggingface")
    return {name: os.path.getsize(os.path.join(hf_dir, name)) for name in sorted(os.listdir(hf_dir))}


def formats(*model_dirs: str) -> dict:
    tensors, returns = padded_batch(seed=2)
    out = {}
    for model_dir in model_dirs:
        worker = make_worker(model_dir, "fsdp")
        before = infer(worker, tensors)
        metrics = train(worker, tensors, before, returns)
        out[os.path.basename(model_dir)] = {"verl": before, "ours": our_values(model_dir, tensors),
                                            "metrics": metrics, "after": infer(worker, tensors)}
        del worker
    out["response_mask"] = tensors["response_mask"]
    return out


def config(model_dir: str) -> dict:
    """verl's configs mapped onto ours (config.engine_config_from_verl), and what is refused."""
    from types import SimpleNamespace

    model = HFModelConfig(path=model_dir, load_tokenizer=False, use_remove_padding=False,
                          enable_gradient_checkpointing=True)
    optim = FSDPOptimizerConfig(lr=3e-4, weight_decay=0.05, betas=(0.9, 0.95), clip_grad=0.5, total_training_steps=100,
                                lr_warmup_steps_ratio=0.1, lr_scheduler_type="cosine", min_lr_ratio=0.1)
    engine = ours.CriticAdaptersEngineConfig(critic_adapters_backend="megatron", critic_adapters={
        "parallel": {"tensor": 2}, "batching": {"micro_batch_tokens": 4096}})
    backend, mapped = ours.engine_config_from_verl(model, engine, optim)
    out = {"mapped": {"backend": backend, "path": mapped.model.path, "optim": {
        key: getattr(mapped.optim, key) for key in ("lr", "weight_decay", "betas", "grad_clip", "lr_schedule",
                                                     "warmup_steps", "min_lr_ratio", "total_steps")},
        "tensor": mapped.parallel.tensor, "micro_batch_tokens": mapped.batching.micro_batch_tokens,
        "gradient_checkpointing": mapped.gradient_checkpointing}}
    out["mapped"]["optim"]["betas"] = list(out["mapped"]["optim"]["betas"])
    out["precision"] = {}  # verl's precision keys (verl's defaults: model_dtype fp32, no mixed_precision)
    for name, fields in {"default": {}, "fp32": ENGINE_FIELDS, "bf16 params": {"model_dtype": "bf16"},
                         "explicit bf16": {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}}.items():
        _, precision = ours.engine_config_from_verl(model, ours.CriticAdaptersEngineConfig(**fields), optim)
        out["precision"][name] = (precision.mixed_precision, precision.model.dtype)
    refused = {}
    for key, fields in {"fp16": {"mixed_precision": {"param_dtype": "fp16"}},
                        "reduce_dtype": {"mixed_precision": {"reduce_dtype": "bf16"}},
                        "buffer_dtype": {"mixed_precision": {"buffer_dtype": "bf16"}},
                        "model_dtype": {"model_dtype": "fp16"},
                        "bf16 params, fp32 compute": {"model_dtype": "bf16", "mixed_precision": {"param_dtype": "fp32"}}
                        }.items():
        refused[key] = lambda fields=fields: ours.engine_config_from_verl(
            model, ours.CriticAdaptersEngineConfig(**fields), optim)
    errors = {}
    for name, make in {
        **refused,
        "unknown key": lambda: ours.engine_config_from_verl(model, ours.CriticAdaptersEngineConfig(
            critic_adapters={"batching": {"micro_batch_token": 1}}), optim),
        "hl_gauss": lambda: ours.engine_config_from_verl(model, ours.CriticAdaptersEngineConfig(critic_adapters={
            "loss": {"kind": "hl_gauss", "clip_range": None, "hl_gauss": {"min_value": -1.0, "max_value": 1.0}}}), optim),
        "backend": lambda: ours.CriticAdaptersEngineConfig(critic_adapters_backend="deepspeed"),
        "schedule": lambda: ours.engine_config_from_verl(model, ours.CriticAdaptersEngineConfig(),
                                                         SimpleNamespace(**{**vars(optim), "lr_scheduler_type": "wsd"})),
    }.items():
        try:
            make()
            errors[name] = None
        except ValueError as err:
            errors[name] = str(err)
    out["errors"] = errors
    return out


def yaml(readme_yaml: str, *overrides: str) -> dict:
    """verl's own ppo_trainer.yaml composed by hydra with the README's critic settings (its YAML
    snippet merged in, or its command-line overrides), then built into verl's critic config as
    verl's trainer does (omega_conf_to_dataclass): what reaches the engine, mapped onto ours."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    config_dir = os.path.join(os.path.dirname(verl_model_utils.__file__), "..", "trainer", "config")
    with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base=None):
        config = compose(config_name="ppo_trainer", overrides=list(overrides))
    if readme_yaml != "-":
        OmegaConf.set_struct(config, False)  # a user's trainer YAML may add keys; so may this snippet
        config = OmegaConf.merge(config, OmegaConf.load(readme_yaml))
    critic = omega_conf_to_dataclass(config.critic)
    backend, mapped = ours.engine_config_from_verl(critic.model, critic.engine, critic.optim)
    return {"strategy": critic.strategy, "engine_strategy": critic.engine.strategy,
            "engine_config": type(critic.engine).__name__, "backend": backend,
            "mixed_precision": mapped.mixed_precision, "dtype": mapped.model.dtype,
            "parallel": dataclasses.asdict(mapped.parallel), "batching": dataclasses.asdict(mapped.batching),
            "path": mapped.model.path}


CHECKS = {"parity": parity, "value_mask": value_mask, "vision": vision, "resume": resume, "save_hf": save_hf,
          "formats": formats, "config": config, "yaml": yaml}


def main():
    check, out_file, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    if check == "batch":  # one interpreter start (torch, transformers, verl) for several checks
        import json

        result = [CHECKS[name](*rest) for name, *rest in json.loads(args[0])]
    else:
        result = CHECKS[check](*args)
    torch.save(result, out_file if WORLD == 1 else f"{out_file}.rank{RANK}")
    torch.distributed.destroy_process_group()
    # The result is written. verl's workers (and the megatron engine they hold) keep gloo groups
    # whose threads can outlive the interpreter's teardown and abort the process ("terminate called
    # without an active exception", seen once in CI on megatron-tp2): skip the teardown.
    from critic_adapters.common.job.launcher import exit_process

    exit_process(0)


if __name__ == "__main__":
    main()
