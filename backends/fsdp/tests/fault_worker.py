"""torchrun worker for test_multiprocess_faults: the training job, with an injected fault on rank 1 at
its second update (the test's stand-in for any bug or crash on one rank)."""

import sys

from critic_adapters.backends.fsdp import engine as fsdp_engine
from critic_adapters.backends.fsdp import train

_update = fsdp_engine.FSDPCriticEngine.update


def update_with_fault(self, batch):
    self.updates_done = getattr(self, "updates_done", 0) + 1
    if self.dist.rank == 1 and self.updates_done == 2:
        raise RuntimeError("injected fault on rank 1 at update 2")
    return _update(self, batch)


fsdp_engine.FSDPCriticEngine.update = update_with_fault

if __name__ == "__main__":
    sys.exit(train.main())
