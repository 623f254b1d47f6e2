"""Our critic engine in verl's engine slot: a verl BaseEngine (model_type value_model, backend
critic_adapters) over any of our backends, as verl's TrainingWorker drives it.

verl's TrainingWorker builds it with EngineRegistry.new(...), asks for its data-parallel
coordinates, calls initialize() (reset), then per mini-batch optimizer_zero_grad,
forward_backward_batch and optimizer_step, and lr_scheduler_step per update. Batches are
TensorDicts of nested (jagged) input_ids / position_ids, one entry per valid token of each
sequence (verl's left_right_2_no_padding). This engine:

  - splits them into verl's micro-batches (verl.workers.engine.utils.prepare_micro_batches: the
    micro_batch_size_per_gpu or max_token_len_per_gpu the data carries), the same count on every
    data-parallel rank;
  - runs each as one packed forward of our engine (engine.forward_backward), with the values laid
    out as verl's value engines give them: a jagged tensor, one value per valid token, unshifted
    (verl's no_padding_2_padding reads a token's value at the position before it, as we do);
  - calls the loss function verl passes (its value_loss) on them and backpropagates that loss as
    it is: verl normalises it over the global batch with a factor dp_size, and our FSDP and DDP
    average gradients over the data-parallel ranks, as verl's own engines do;
  - returns verl's output layout (postprocess_batch_func): model_output.values, loss, metrics.

A vision-language critic's images come in verl's batch as verl's own engines take them: the key
multi_modal_inputs (its DataProto's non_tensor_batch: one dict of the processor's tensors or None per
row), which verl's micro-batch split carries with the rows; each micro-batch passes its rows' dicts
to our engine (micro_batch_images). Qwen-VL position ids ([4, n] per sequence: text, then the
multimodal rope's t/h/w) are checked by their text row; the engine derives the t/h/w rows itself.

A batch may carry a value_mask (agentic stacks, VAGEN's verl fork: the response tokens whose
values the critic regresses, in response_mask's layout). verl's value_loss masks by response_mask
and the token count comes from loss_mask, so both are narrowed to it first (apply_value_mask).

Checkpoints are our engine's (save_checkpoint / load_checkpoint at verl's local_path; any of our
backends' formats, resharded on load). The critic comes from any format load_critic reads.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from verl.utils import tensordict_utils as tu
from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

from ...common.parallel.distributed import all_reduce, init_distributed
from ...common.engine.registry import build_engine, check_engine_config
from .config import STRATEGY, engine_config_from_verl

DEVICES = ["cpu", "cuda", "npu"]


def padded_rows(micro_batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [B, L] right-padded with 0, attention_mask [B, L], offsets) of a micro-batch
    whose input_ids are nested (jagged); its position ids must be each sequence's 0..n-1."""
    ids = micro_batch["input_ids"]
    if not getattr(ids, "is_nested", False):
        raise ValueError("the critic_adapters engine takes verl's no-padding batches (nested input_ids, from "
                         "left_right_2_no_padding or the v1 trainer); got a padded tensor")
    offsets = ids.offsets()
    lengths = offsets.diff().cpu()
    padded = torch.nested.to_padded_tensor(ids, 0).cpu()
    mask = (torch.arange(padded.shape[1])[None] < lengths[:, None]).long()
    positions = micro_batch.get("position_ids", None)
    if positions is not None:
        text = text_positions(positions)
        expected = torch.cat([torch.arange(int(n)) for n in lengths])
        if not torch.equal(text.cpu(), expected):
            raise ValueError("the critic_adapters engine needs each sequence's position ids to be 0..n-1 (what "
                             "left_right_2_no_padding gives for left-padded prompts and right-padded responses)")
    return padded * mask, mask, offsets


def text_positions(positions: torch.Tensor) -> torch.Tensor:
    """The text position of every token of a nested position_ids: one per token, or a Qwen-VL
    batch's [4, n] per sequence (verl's layout: text positions, then the multimodal rope's t/h/w),
    whose first row it is. The t/h/w rows are not read: our engine derives each sequence's from its
    images (the family's get_rope_index), as verl's data pipeline computes them."""
    if not positions.is_nested:
        raise ValueError("the critic_adapters engine takes nested position ids (verl's no-padding layout)")
    values = positions.values()
    if values.dim() == 1:
        return values
    if values.dim() == 2 and values.shape[0] == 4:
        return values[0]
    raise ValueError(f"the critic_adapters engine takes position ids of one text position per token or verl's "
                     f"Qwen-VL layout [4, n] per sequence (text, then t/h/w); got values of shape "
                     f"{tuple(values.shape)}")


# Keys verl writes into a row's multi_modal_inputs for itself, not for the model (its agent loop's
# images_seqlens: for its FLOPs count).
VERL_ONLY_KEYS = ("images_seqlens",)


def micro_batch_images(micro_batch) -> list | None:
    """The micro-batch's multi_modal_inputs: one dict of the processor's tensors or None per row
    (verl's non_tensor_batch key; in its TensorDicts a NonTensorStack, which verl's row selection,
    mini-batch iterator and micro-batch split carry with their rows), verl's own keys dropped. None
    without the key."""
    if "multi_modal_inputs" not in micro_batch.keys():
        return None
    rows = micro_batch["multi_modal_inputs"]  # a list of the rows' entries
    return [{key: value for key, value in row.items() if key not in VERL_ONLY_KEYS} if isinstance(row, Mapping)
            else row for row in rows]


def as_nested(values: torch.Tensor, mask: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[B, L] values at every position -> verl's jagged layout: one value per valid token."""
    flat = values[mask.to(values.device).bool()]
    return torch.nested.nested_tensor_from_jagged(flat, offsets=offsets.to(flat.device))


def apply_value_mask(data) -> tuple[int, str | None]:
    """response_mask and loss_mask of `data` ANDed with its value_mask, in place, so that verl's
    value_loss and the global token count (batch_num_tokens) see only the tokens it marks. It has
    response_mask's layout: padded [B, R] (left_right_2_no_padding keeps response_mask so and makes
    loss_mask the same tensor) or nested over each row's response tokens (the v1 trainer's batches,
    loss_mask the same mask). Idempotent, so another epoch over the same mini-batch changes nothing.
    Returns (value_mask tokens outside response_mask, a layout problem or None), for the caller to
    raise on every rank together; (0, None) without the key, and nothing changes."""
    value_mask = data.get("value_mask", None)
    if value_mask is None:
        return 0, None
    response_mask, loss_mask = data["response_mask"], data["loss_mask"]
    for name, mask in (("response_mask", response_mask), ("loss_mask", loss_mask)):
        if not same_layout(mask, value_mask):
            return 0, (f"value_mask must have response_mask's layout (both padded [B, R] or both nested over the "
                       f"same rows' tokens); got value_mask {layout(value_mask)} and {name} {layout(mask)}")
    outside = int((flat(value_mask).bool() & ~flat(response_mask).bool()).sum())
    data["response_mask"] = intersect(response_mask, value_mask)
    data["loss_mask"] = intersect(loss_mask, value_mask)
    return outside, None


def flat(mask: torch.Tensor) -> torch.Tensor:
    return mask.values() if mask.is_nested else mask


def layout(mask: torch.Tensor) -> str:
    return f"nested {mask.offsets().diff().tolist()}" if mask.is_nested else f"padded {list(mask.shape)}"


def same_layout(mask: torch.Tensor, other: torch.Tensor) -> bool:
    if mask.is_nested != other.is_nested:
        return False
    if mask.is_nested:
        return torch.equal(mask.offsets().cpu(), other.offsets().cpu())
    return mask.shape == other.shape


def intersect(mask: torch.Tensor, value_mask: torch.Tensor) -> torch.Tensor:
    """mask AND value_mask, in mask's layout and dtype. A nested one keeps mask's offsets and is given
    its rows' shortest and longest lengths: without them to_padded_tensor (value_loss's) pads to the
    total length."""
    both = (flat(mask).bool() & flat(value_mask).bool()).to(mask.dtype)
    if not mask.is_nested:
        return both
    lengths = mask.offsets().diff()
    return torch.nested.nested_tensor_from_jagged(both, offsets=mask.offsets(), min_seqlen=int(lengths.min()),
                                                  max_seqlen=int(lengths.max()))


class CriticAdaptersEngine(BaseEngine):
    """verl's value-model engine interface over a critic-adapters engine (see the module docstring)."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config, **unused):
        super().__init__()
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        self.mode = None
        self.backend, self.config = engine_config_from_verl(model_config, engine_config, optimizer_config)
        check_engine_config(self.backend, self.config)
        self.dist = init_distributed()  # joins the process group verl's worker started
        # Built now: verl asks for the data-parallel coordinates before initialize().
        self.engine = build_engine(self.backend, self.config, self.dist)
        self._initialized = False

    # -- lifecycle -----------------------------------------------------------------------------------
    def initialize(self):
        """The first call keeps the engine built at construction; a later one (a reset) rebuilds it.
        Then, as verl's own engines end their initialize(), what the offload keys name leaves the
        device (param_offload: parameters and gradients; optimizer_offload: the optimizer state), so
        that verl's rollout engine, built after, sizes its KV cache with the critic off the GPU; the
        first phase (PhaseContext) brings back what it needs."""
        if self._initialized:
            self.engine.close()
            self.engine = build_engine(self.backend, self.config, self.dist)
        self._initialized = True
        params, optimizer = self.is_param_offload_enabled, self.is_optimizer_offload_enabled
        self.move_state(onto_device=False, model=params, optimizer=optimizer, grads=params)

    # -- offload between phases (verl's critic.fsdp.param_offload / optimizer_offload) -------------------
    @property
    def is_param_offload_enabled(self) -> bool:
        """critic.fsdp.param_offload: parameters and gradients leave the device between phases."""
        return bool(getattr(self.engine_config, "param_offload", False))

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        """critic.fsdp.optimizer_offload: the optimizer state leaves the device between updates."""
        return bool(getattr(self.engine_config, "optimizer_offload", False))

    def train_mode(self, **kwargs):
        return PhaseContext(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return PhaseContext(self, "eval", **kwargs)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        """verl's manual load / offload: to the compute device, these parts come back
        (engine.onload); to "cpu" from a GPU, they leave it (engine.offload: storages freed on the
        device, held in pinned host memory). On a CPU machine the state is on its compute device
        already and stays resident (verl names "cpu" both ways there); the train / eval phases
        still offload and onload it (PhaseContext)."""
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        target = torch.device(device).type
        if target == self.dist.device.type:
            if target != "cpu":
                self.move_state(onto_device=True, model=model, optimizer=optimizer, grads=grad)
        elif target == "cpu":
            self.move_state(onto_device=False, model=model, optimizer=optimizer, grads=grad)
        else:
            raise ValueError(f"to({device!r}): the critic_adapters engine computes on {self.dist.device}; move it "
                             f"there or to 'cpu'")

    def move_state(self, *, onto_device: bool, model: bool, optimizer: bool, grads: bool) -> None:
        """Our engine's onload (onto_device) or offload of these parts; nothing when none is named."""
        if not (model or optimizer or grads):
            return
        move = self.engine.onload if onto_device else self.engine.offload
        move(model=model, optimizer=optimizer, grads=grads)

    # -- coordinates -----------------------------------------------------------------------------------
    def get_data_parallel_rank(self):
        return self.engine.dp_rank

    def get_data_parallel_size(self):
        return self.engine.dp_size

    def get_data_parallel_group(self):
        # verl all-gathers metrics over it; a world of one still needs a real group.
        return self.engine.dp_group if self.engine.dp_group is not None else torch.distributed.group.WORLD

    def is_mp_src_rank_with_outputs(self):
        """One rank per data-parallel share reports outputs (common.engine.mesh.ParallelMesh.reports_outputs:
        the last pipeline stage's first tensor, context and Ulysses rank)."""
        return self.engine.parallel.reports_outputs

    # -- the step --------------------------------------------------------------------------------------
    def optimizer_zero_grad(self):
        self.engine.zero_grad()

    def optimizer_step(self):
        """Clip (critic.optim.clip_grad) and step; the global gradient norm before clipping."""
        return self.engine.step_optimizer()

    def lr_scheduler_step(self):
        self.engine.scheduler.step()
        return self.engine.scheduler.get_last_lr()[0]

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        """verl's micro-batches through our engine; verl's output layout (see the module docstring)."""
        group = self.get_data_parallel_group()
        outside, problem = apply_value_mask(data)
        # One collective for the global token count and value_mask's errors (raised on every rank together).
        tokens, outside, problems = all_reduce([float(data["loss_mask"].sum()), float(outside), float(bool(problem))],
                                               group=group)
        if problems:
            raise ValueError(problem or "another data-parallel rank's value_mask does not have its response_mask's "
                                        "layout")
        if outside:
            raise ValueError(f"value_mask marks {int(outside)} token(s) outside response_mask (over the data-parallel "
                             f"ranks): the critic regresses values of response tokens only; pass a subset of it "
                             f"(value_mask & response_mask)")
        tu.assign_non_tensor(data, batch_num_tokens=int(tokens), dp_size=self.get_data_parallel_size())
        return_model_output = tu.get_non_tensor_data(data=data, key="return_model_output", default=False)
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=group, same_micro_num_in_dp=True)
        device = self.dist.device
        outputs = []
        for micro_batch in micro_batches:
            micro_batch = micro_batch.to(device)
            input_ids, mask, offsets = padded_rows(micro_batch)
            metrics: dict = {}

            def verl_loss(values):
                loss, found = loss_function(model_output={"values": as_nested(values, mask, offsets)},
                                            data=micro_batch, dp_group=group)
                metrics.update(found)
                return loss

            train = loss_function is not None and not forward_only
            values, loss = self.engine.forward_backward(input_ids, mask, verl_loss if train else None,
                                                        micro_batch_images(micro_batch))
            nested = as_nested(values.to(device), mask, offsets)
            if loss_function is not None and not train:  # evaluation with a loss: verl reports it too
                loss, found = loss_function(model_output={"values": nested}, data=micro_batch, dp_group=group)
                metrics.update(found)
            output = {"loss": 1.0 if loss is None else float(loss), "metrics": metrics}
            if forward_only or return_model_output:
                output["model_output"] = {"values": nested}
            outputs.append(output)
        return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)

    # -- checkpoints -----------------------------------------------------------------------------------
    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        """Our engine's checkpoint at `local_path` (a complete directory or none: common/storage/checkpoints.py).
        verl's trainer puts each step in its own directory and rotates them; max_ckpt_to_keep is its."""
        if hdfs_path is not None:
            raise ValueError(f"save_checkpoint(hdfs_path={hdfs_path!r}): the critic_adapters engine writes local "
                             f"directories only; copy local_path yourself")
        self.engine.save_checkpoint(local_path, {"global_step": int(global_step)})

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        """Restore model, optimizer, LR schedule and RNG from our checkpoint at `local_path` (it is
        never deleted: del_local_after_load does not apply to a local checkpoint)."""
        if hdfs_path is not None:
            raise ValueError(f"load_checkpoint(hdfs_path={hdfs_path!r}): the critic_adapters engine reads local "
                             f"directories only")
        return self.engine.load_checkpoint(local_path)

    def get_per_tensor_param(self, *args, **kwargs):
        raise NotImplementedError("the critic_adapters engine is a value model: verl syncs no critic weights to "
                                  "rollout engines; export it with the engine's export_hf")


class PhaseContext(BaseEngineCtx):
    """verl's train / eval phase around our engine, as verl's BaseEngineCtx does for its own: on
    entry the parts verl's offload keys name come back, on exit they leave the device again
    (train: parameters, gradients with param_offload, the optimizer state with optimizer_offload;
    eval: the parameters only, so an offloaded optimizer stays off through the rollout). They are
    off already before the first phase: initialize() offloads them.
    disable_auto_offload: neither. The direction comes from entry and exit, not from a device name
    (verl's BaseEngineCtx names "cpu" both ways on a CPU machine)."""

    def _parts(self) -> dict:
        params = self.engine.is_param_offload_enabled
        train = self.mode == "train"
        return {"model": params, "optimizer": train and self.engine.is_optimizer_offload_enabled,
                "grads": train and params}

    def __enter__(self):
        self.engine.mode = self.mode
        if not self.disable_auto_offload:
            self.engine.move_state(onto_device=True, **self._parts())

    def __exit__(self, exc_type, exc_val, exc_tb):
        if not self.disable_auto_offload:
            self.engine.move_state(onto_device=False, **self._parts())
        self.engine.mode = None


def register() -> None:
    """Register the engine with verl (once per process: verl refuses a second registration)."""
    engines = EngineRegistry._engines.get("value_model", {}).get(STRATEGY, {})
    if all(engines.get(device) is CriticAdaptersEngine for device in DEVICES):
        return
    EngineRegistry.register(model_type="value_model", backend=STRATEGY, device=DEVICES)(CriticAdaptersEngine)
