"""Torchrun worker for test_engine_input_checks: NaN returns in one rank's rows only.

Every rank must raise the same ValueError before any collective of the step, leaving weights and
optimizer state as they were, and the process group usable for the next (clean) step.

  python -m critic_adapters.backends.fsdp.tests.input_check_worker MODEL_DIR OUT.pt
"""

import sys

import torch

from critic_adapters.backends.fsdp.engine import FSDPCriticEngine
from critic_adapters.backends.fsdp.tests.worker_common import full
from critic_adapters.common.config import EngineConfig, ModelConfig, OptimConfig
from critic_adapters.common.distributed import all_reduce, init_distributed, shutdown
from critic_adapters.common.engine import RolloutBatch


def batch(rank: int, poison: bool) -> RolloutBatch:
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(3, 990, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    response = torch.zeros_like(ids)
    response[:, 4:] = 1
    returns = torch.randn(3, 10, generator=g) * response
    if poison:
        returns[1, 6] = float("nan")
    return RolloutBatch(ids, mask, response, torch.zeros(3, 10), returns)


def snapshot(engine) -> dict[str, torch.Tensor]:
    state = {f"param:{n}": full(p) for n, p in engine.model.named_parameters()}
    for n, p in engine.model.named_parameters():
        for key, value in engine.optimizer.state[p].items():
            state[f"optim:{n}:{key}"] = full(value) if torch.is_tensor(value) else torch.tensor(value)
    return state


def main():
    model_dir, out_file = sys.argv[1:3]
    dist = init_distributed()
    engine = FSDPCriticEngine(EngineConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-2)), dist)
    engine.update(batch(dist.rank, poison=False))  # the optimizer has state to protect
    before = snapshot(engine)
    error = None
    try:
        engine.update(batch(dist.rank, poison=dist.rank == 1))
    except ValueError as err:
        error = str(err)
    after = snapshot(engine)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    metrics = engine.update(batch(dist.rank, poison=False))  # the group still works
    (agree,) = all_reduce([float(error is not None)])
    result = {"rank": dist.rank, "error": error, "unchanged": unchanged, "raised_on": agree,
              "next_loss": metrics["value_loss"]}
    gathered = [None] * dist.world_size
    torch.distributed.all_gather_object(gathered, result)
    engine.close()
    if dist.is_main:
        torch.save(gathered, out_file)
    shutdown()


if __name__ == "__main__":
    main()
