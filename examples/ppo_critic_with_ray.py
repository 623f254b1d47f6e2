"""A PPO loop's critic side on a Ray worker group: values for each rollout batch, GAE returns, then
critic updates over mini-batches, a checkpoint and an HF export.

  python examples/ppo_critic_with_ray.py [--backend fsdp] [--workers 2] [--iterations 3] [--out outputs/ray-example]

The policy is not part of this example: its rollouts are the embedded generator's (common/learning/data.py),
with per-token rewards, put in Ray's object store the way a stack's generation actors would hand them
over (the group reads them from there: no copy through this driver per worker). On a laptop it
starts a local Ray cluster (loopback only); pass --address to join one.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a file: use this checkout's package
    import importlib.util

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.util.spec_from_file_location("critic_adapters", os.path.join(_root, "__init__.py"),
                                                   submodule_search_locations=[_root])
    sys.modules["critic_adapters"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["critic_adapters"])

import torch  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="fsdp", help="fsdp, megatron (add --tensor 2) or veomni")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tensor", type=int, default=1, help="engine.parallel.tensor (megatron)")
    parser.add_argument("--iterations", type=int, default=3, help="PPO iterations (rollout batch -> critic updates)")
    parser.add_argument("--rollouts", type=int, default=256, help="rollouts per iteration")
    parser.add_argument("--mini-batch", type=int, default=64)
    parser.add_argument("--address", default=None, help="an existing Ray cluster (default: a local one)")
    parser.add_argument("--out", default="outputs/ray-example")
    args = parser.parse_args(argv)

    import ray

    from critic_adapters.common.engine.config import EngineConfig, ModelConfig, OptimConfig, ParallelConfig
    from critic_adapters.common.learning.data import gae_returns, make_default_records, to_rollouts
    from critic_adapters.common.engine import RolloutBatch, shift_to_tokens
    from critic_adapters.common.learning.loss import explained_variance
    from critic_adapters.common.testdata import save_tiny_causal_lm
    from critic_adapters.integrations.ray import RayCriticGroup
    from critic_adapters.integrations.ray.cluster import ensure_ray, shutdown_ray

    os.makedirs(args.out, exist_ok=True)
    model_dir = save_tiny_causal_lm("qwen2", os.path.join(args.out, "base-model"))  # a tiny random Qwen2
    config = EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=2e-3),
                          parallel=ParallelConfig(tensor=args.tensor))
    ensure_ray(args.address)
    group = RayCriticGroup(args.backend, config, num_workers=args.workers)
    # The "policy": the embedded generator's rollouts (one task-to-reward mapping for every iteration).
    records = make_default_records(args.rollouts * args.iterations, seed=0)
    try:
        for iteration in range(args.iterations):
            # 1. This iteration's rollouts, handed to the group by reference (Ray's object store).
            rollouts = to_rollouts(records[iteration * args.rollouts:(iteration + 1) * args.rollouts])
            ids, mask = ray.put(rollouts.input_ids), ray.put(rollouts.attention_mask)
            # 2. The critic's values for every rollout: old values, and the baseline of GAE.
            old_values = shift_to_tokens(group.compute_values(ids, mask)) * rollouts.response_mask
            returns = gae_returns(rollouts.rewards, old_values, rollouts.response_mask, gamma=1.0, lam=0.95)
            # 3. Critic updates over shuffled mini-batches (one epoch).
            order = torch.randperm(args.rollouts, generator=torch.Generator().manual_seed(iteration))
            for start in range(0, args.rollouts, args.mini_batch):
                rows = order[start:start + args.mini_batch]
                metrics = group.update(RolloutBatch(rollouts.input_ids[rows], rollouts.attention_mask[rows],
                                                    rollouts.response_mask[rows], old_values[rows], returns[rows]))
            after = shift_to_tokens(group.compute_values(ids, mask))
            print(f"iteration {iteration + 1}/{args.iterations}: value loss {metrics['value_loss']:.4f}, explained "
                  f"variance of the returns {explained_variance(after, returns, rollouts.response_mask):.3f}", flush=True)
        group.save_checkpoint(os.path.join(args.out, "checkpoint"), extra_state={"iteration": args.iterations})
        group.export_hf(os.path.join(args.out, "hf_export"))
        print(f"checkpoint: {args.out}/checkpoint, critic: {args.out}/hf_export")
    finally:
        group.close()
        shutdown_ray()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
