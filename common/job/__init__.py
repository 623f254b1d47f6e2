"""The training job around an engine: the launcher, the trainer's loop and what a job needs beside it.

The one launcher (launcher: `python -m critic_adapters.train --backend X`, torchrun in process via
quiet_torchrun), the trainer (trainer: rollouts -> updates -> checkpoints, resume), metrics
(metrics), one job per run directory (run_lock) and ranks that stop when their launcher is gone
(lifeline); the embedded default job is default_job.yaml. The top layer: it may import every other
part of common, and no backend (engines are built through common.engine.registry).
"""
