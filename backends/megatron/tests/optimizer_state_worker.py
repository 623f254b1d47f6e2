"""torchrun worker (2 ranks, data parallel 2): the distributed optimizer's checkpoint read back by a
fresh engine gives every rank exactly the fp32 weights and Adam moments it had, whether this
module wrote it (each rank its own rectangles) or megatron-core's `fully_reshardable` format did
(what this project wrote before optimizer_state.py; its keys are the same).

argv: model_dir work_dir. Prints one line per checkpoint and rank; asserts equality.
"""

import os
import sys
import warnings

import torch

from critic_adapters.backends.megatron import checkpoint
from critic_adapters.backends.megatron.parallelize import optimizer_parts
from critic_adapters.common.engine import build_engine
from critic_adapters.common.engine.config import EngineConfig, ModelConfig, OptimConfig
from critic_adapters.common.parallel.distributed import init_distributed, shutdown


def fully_reshardable_state(ddp_model, optimizer, *, is_loading):
    """checkpoint._sharded_state as it was: megatron-core's own fully_reshardable layout."""
    checkpoint._give_state(optimizer)
    model_state = ddp_model.module.sharded_state_dict()
    return {"model": model_state, "optimizer": optimizer.sharded_state_dict(
        model_state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})}


def optimizer_tensors(engine) -> dict:
    """parameter name -> {fp32 main weight, exp_avg, exp_avg_sq} of this rank's range."""
    out = {}
    for part in optimizer_parts(engine.optimizer):
        for name, param in engine.model.module.named_parameters():
            if param in part.model_param_group_index_map:
                tensors = part._get_main_param_and_optimizer_states(param)
                out[name] = {k: v.detach().clone() for k, v in tensors.items() if k != "step"}
    return out


def main() -> None:
    warnings.filterwarnings("ignore")
    model_dir, work = sys.argv[1:3]
    dist = init_distributed()
    config = EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-2))
    engine = build_engine("megatron", config, dist)
    ids = torch.randint(3, 200, (4, 16), generator=torch.Generator().manual_seed(dist.rank))
    for _ in range(2):
        engine.forward_backward(ids, torch.ones_like(ids), lambda values: values.square().mean())
        engine.step_optimizer()
    ours, theirs = os.path.join(work, "owned"), os.path.join(work, "fully_reshardable")
    engine.save_checkpoint(ours)
    own_layout = checkpoint._sharded_state
    checkpoint._sharded_state = fully_reshardable_state
    try:
        engine.save_checkpoint(theirs)
    finally:
        checkpoint._sharded_state = own_layout
    before = optimizer_tensors(engine)
    engine.close()
    for directory in (ours, theirs):
        fresh = build_engine("megatron", config, dist)
        fresh.load_checkpoint(directory)
        after = optimizer_tensors(fresh)
        fresh.close()
        assert after.keys() == before.keys(), (sorted(after), sorted(before))
        worst = max(float((after[n][k] - before[n][k]).abs().max()) for n in before for k in before[n])
        print(f"rank {dist.rank} {os.path.basename(directory)}: {len(before)} parameters, max |diff| {worst}",
              flush=True)
        assert worst == 0.0, (directory, worst)
    shutdown()


if __name__ == "__main__":
    main()
