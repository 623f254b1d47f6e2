"""Training metrics: a JSONL file, TensorBoard scalars, and a PNG plot of loss and explained variance.

Every metric is defined in docs/METRICS.md.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time


class MetricsLogger:
    """Appends one JSON object per step to run_dir/metrics.jsonl (and TensorBoard); rank 0 only.

    keep_until_step=None starts a fresh run: metrics.jsonl and tensorboard/ left by an earlier run are
    removed. A resumed run passes its checkpoint's step: records logged after it are dropped.
    """

    def __init__(self, run_dir: str, *, enabled: bool, tensorboard: bool, keep_until_step: int | None = None):
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.last_step = keep_until_step or 0
        self._writer = None
        if enabled:
            _start_file(self.path, keep_until_step)
            if keep_until_step is None:
                shutil.rmtree(os.path.join(run_dir, "tensorboard"), ignore_errors=True)
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def log(self, step: int, metrics: dict[str, float], prefix: str = "train", *, epoch: int = 0) -> None:
        """One row: step, split, epoch (1-based; 0 for the evaluation before training), time (Unix
        seconds), then the metrics."""
        if prefix == "train":
            self.last_step = step
        if not self.enabled:
            return
        record = {"step": step, "split": prefix, "epoch": epoch, "time": round(time.time(), 3),
                  **{k: _finite_or_none(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._writer.add_scalar(f"{prefix}/{key}", value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _start_file(path: str, keep_until_step: int | None) -> None:
    """Empty `path`, or keep only its records up to `keep_until_step` (rewritten atomically)."""
    kept = []
    if keep_until_step is not None and os.path.isfile(path):
        kept = [r for r in read_metrics(path) if r["step"] <= keep_until_step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, path)


def _finite_or_none(value):
    return value if not isinstance(value, float) or math.isfinite(value) else None


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(metrics_path: str, png_path: str) -> str:
    """training.png from metrics.jsonl (metrics_figure); returns png_path."""
    import matplotlib.pyplot as plt

    fig = metrics_figure(read_metrics(metrics_path))
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def metrics_figure(records: list[dict]):
    """The unclipped 0.5 * MSE (train: `mse`, eval: `value_loss`, the same quantity) and explained
    variance against step, train as a line and held-out evaluations as markers (a lone point of
    either is a marker). The explained-variance axis is not clipped: it is unbounded below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_ev) = plt.subplots(1, 2, figsize=(11, 4))
    for split, loss_key, style in (("train", "mse", "-"), ("eval", "value_loss", "o-")):
        rows = [r for r in records if r["split"] == split and r.get(loss_key) is not None]
        if not rows:
            continue
        steps = [r["step"] for r in rows]
        style = style if len(rows) > 1 else "o"  # a single point is invisible as a line
        label = "train (mini-batches)" if split == "train" else "held-out"
        ax_loss.plot(steps, [r[loss_key] for r in rows], style, label=label)
        ax_ev.plot(steps, [r.get("explained_variance") for r in rows], style, label=label)
    ax_loss.set(title="value loss", xlabel="optimizer step", ylabel="0.5 * MSE vs returns (unclipped)", yscale="log")
    ax_ev.set(title="explained variance", xlabel="optimizer step", ylabel="1 - Var(returns - values) / Var(returns)")
    ax_ev.axhline(1.0, color="grey", linewidth=0.5)
    for ax in (ax_loss, ax_ev):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return fig
