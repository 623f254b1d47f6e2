"""The critic as a Ray worker group (an optional extra: ray is pinned in requirements/ray.txt, and
nothing outside this package imports it).

    import ray
    from critic_adapters.integrations.ray import RayCriticGroup

    group = RayCriticGroup("fsdp", engine_config, num_workers=2, resources_per_worker={"CPU": 1})
    values = group.compute_values(input_ids, attention_mask)   # float32 [B, T], all rows, on the driver
    metrics = group.update(rollout_batch)                      # one optimizer step over the mini-batch
    group.save_checkpoint(path, extra_state={...}); extra = group.load_checkpoint(path)
    group.export_hf(path); group.close()

`python -m critic_adapters.integrations.ray.train CONFIG [key=value ...]` runs the training job
through a group (train.py).
"""

from .group import CriticWorkerError, RayCriticGroup

__all__ = ["CriticWorkerError", "RayCriticGroup"]
