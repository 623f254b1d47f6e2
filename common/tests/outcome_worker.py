"""2 gloo ranks agree on how a step went (common.parallel.distributed.one_outcome), with a process-group
timeout of TIMEOUT_S: in step "between", rank 1 fails between collectives; in step "inside", rank 1
fails before a collective rank 0 is already waiting in (rank 0 leaves it at the timeout). Each rank
writes what it raised, and after how long, to WORKDIR/rank<r>.json."""

import json
import os
import sys
import time

from critic_adapters.common.parallel.distributed import barrier, init_distributed, one_outcome, world_group

TIMEOUT_S = 5.0


def attempt(step: str, rank: int) -> dict:
    start = time.monotonic()
    try:
        with one_outcome(f"step {step}", group=world_group(), timeout_s=TIMEOUT_S):
            if rank == 1:
                raise ValueError(f"rank 1's own problem in step {step}")
            if step == "inside":
                barrier(world_group())  # rank 1 never comes
        raised = None
    except Exception as err:  # noqa: BLE001 - what each rank raised is the result
        raised = {"type": type(err).__name__, "message": str(err)}
    return {"raised": raised, "seconds": time.monotonic() - start}


def main() -> None:
    workdir = sys.argv[1]
    dist = init_distributed(timeout_s=TIMEOUT_S)
    out = {step: attempt(step, dist.rank) for step in ("between", "inside")}
    with open(os.path.join(workdir, f"rank{dist.rank}.json"), "w") as f:
        json.dump(out, f)
    # No shutdown barrier: after a timed-out collective the gloo group is not to be trusted.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
