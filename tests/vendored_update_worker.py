"""Torchrun worker for test_vendoring, run by file path (never through a package):
load a critic, build the FSDP engine and take one 2-rank update step with the package named PKG.

  torchrun --nproc_per_node 2 tests/vendored_update_worker.py PKG MODEL_DIR OUT_DIR
PKG is `critic_adapters`, or wherever a stack vendored the tree (mystack._vendor.critic_adapters).
The stack's own top-level `common` module is imported first and must still be the stack's at the end.
"""

import importlib
import json
import os
import sys

import common  # the stack's own module of that name (a decoy first on PYTHONPATH)
import torch


def main():
    package, model_dir, out_dir = sys.argv[1:4]
    distributed = importlib.import_module(f"{package}.common.parallel.distributed")
    config = importlib.import_module(f"{package}.common.engine.config")
    engine_api = importlib.import_module(f"{package}.common.engine")
    valuehead = importlib.import_module(f"{package}.common.valuehead")

    dist = distributed.init_distributed()
    critic, report = valuehead.load_critic(model_dir)
    engine = engine_api.build_engine("fsdp", config.EngineConfig(model=config.ModelConfig(path=model_dir)), dist)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 990, (6, 12), generator=g)
    response = torch.zeros_like(ids)
    response[:, 5:] = 1
    rows = torch.arange(dist.rank, 6, dist.world_size)
    batch = engine_api.RolloutBatch(ids[rows], torch.ones_like(ids)[rows], response[rows], torch.zeros(6, 12)[rows],
                                    torch.randn(6, 12, generator=g)[rows])
    metrics = engine.update(batch)
    engine.export_hf(os.path.join(out_dir, "export"))
    engine.close()
    if dist.is_main:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump({
                "value_loss": metrics["value_loss"], "grad_norm": metrics["grad_norm"], "format": report.format,
                "engine_module": type(engine).__module__,
                "common_is_the_stacks": sys.modules["common"] is common and getattr(common, "DECOY", False),
                "leaked": sorted(m for m in sys.modules if m.split(".")[0] == "critic_adapters"
                                 and package.split(".")[0] != "critic_adapters"),
            }, f)
    distributed.shutdown()


if __name__ == "__main__":
    main()
