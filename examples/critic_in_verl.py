"""Our critic in verl 0.9.1's own TrainingWorker (the engine slot of docs/VERL.md), in one
process: the critic's values for a batch of rollouts, one PPO value update with verl's value_loss,
the values again.

  python examples/critic_in_verl.py [--model DIR] [--backend fsdp|megatron|veomni]

Run it where verl 0.9.1 is installed (it needs transformers < 5.11; in this repo tools/setup.sh
builds one: PYTHONPATH=.overlays/verl-0.9.1 python examples/critic_in_verl.py). Without --model it
writes a tiny random Qwen2 model first and starts a fresh critic from it. On a machine without a
GPU our CPU platform for verl is put in place by the import below; nothing else is set up by hand.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from functools import partial

import torch

import critic_adapters.integrations.verl as ours  # registers the engine with verl (and verl's CPU platform)


def world_of_one() -> None:
    """The environment verl's Worker reads, for one process (torchrun or Ray set it otherwise)."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          LOCAL_WORLD_SIZE="1")


def rollouts(batch: int = 4, prompt: int = 5, response: int = 6, seed: int = 0) -> dict:
    """Left-padded prompts and right-padded responses, as verl's rollout hands them to the critic."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens, response_lens = torch.randint(2, prompt + 1, (batch,), generator=g), torch.randint(
        2, response + 1, (batch,), generator=g)
    ids = torch.zeros(batch, prompt + response, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompt_lens.tolist(), response_lens.tolist())):
        ids[i, prompt - p:prompt + r] = torch.randint(3, 900, (p + r,), generator=g)
        attention[i, prompt - p:prompt + r] = 1
    return {"prompts": ids[:, :prompt], "responses": ids[:, prompt:], "input_ids": ids, "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0), "response_mask": attention[:, prompt:].clone()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a critic or causal LM directory (default: a tiny random Qwen2)")
    parser.add_argument("--backend", default="fsdp", choices=["fsdp", "megatron", "veomni"])
    args = parser.parse_args()
    world_of_one()

    from verl import DataProto
    from verl.trainer.config import CheckpointConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPCriticConfig, FSDPOptimizerConfig, HFModelConfig, TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import value_loss
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    model_dir = args.model
    if model_dir is None:
        from critic_adapters.common.testdata import save_tiny_causal_lm

        model_dir = save_tiny_causal_lm("qwen2", os.path.join(tempfile.mkdtemp(prefix="critic_in_verl_"), "model"))
    engine = ours.CriticAdaptersEngineConfig(critic_adapters_backend=args.backend, model_dtype="fp32", use_dynamic_bsz=False,
                                             micro_batch_size_per_gpu=2, infer_micro_batch_size_per_gpu=2)
    worker = TrainingWorker(TrainingWorkerConfig(
        model_type="value_model", engine_config=engine,
        model_config=HFModelConfig(path=model_dir, load_tokenizer=False, use_remove_padding=False),
        optimizer_config=FSDPOptimizerConfig(lr=1e-3, total_training_steps=10),
        checkpoint_config=CheckpointConfig()))
    worker.reset()
    critic = FSDPCriticConfig(strategy="fsdp2", ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=4,
                              cliprange_value=0.5, loss_agg_mode="token-mean")
    worker.set_loss_fn(partial(value_loss, config=critic))

    batch = rollouts()
    mask = batch["response_mask"]

    def values() -> torch.Tensor:  # what verl's trainer reads back (_compute_values)
        td = left_right_2_no_padding(DataProto.from_dict(tensors=batch, meta_info={"temperature": 1.0}).to_tensordict())
        tu.assign_non_tensor(td, compute_loss=False)
        return no_padding_2_padding(tu.get(worker.infer_batch(td), "values"), td).float() * mask

    before = values()
    returns = torch.ones_like(before) * mask  # every response token's return is 1.0
    td = left_right_2_no_padding(DataProto.from_dict(tensors={**batch, "values": before, "returns": returns},
                                                     meta_info={"temperature": 1.0}).to_tensordict())
    tu.assign_non_tensor(td, global_batch_size=4, mini_batch_size=4, epochs=1, seed=0,
                         dataloader_kwargs={"shuffle": False})
    metrics = tu.get(worker.train_mini_batch(td), "metrics")
    after = values()
    error = lambda v: float(((v - returns) ** 2)[mask.bool()].mean())  # noqa: E731
    print(f"values of the responses: {tuple(before.shape)} (batch, response tokens)")
    print(f"critic/vf_loss {float(torch.as_tensor(metrics['critic/vf_loss']).mean()):.4f}; squared error to the "
          f"returns {error(before):.4f} before the update, {error(after):.4f} after")


if __name__ == "__main__":
    main()
