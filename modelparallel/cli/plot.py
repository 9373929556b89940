"""Run artifacts: ``metrics.json`` for machines and ``loss.png`` for people.

Matplotlib runs on the Agg backend so the plot is written on headless machines and over SSH.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def write_metrics(out_dir: Path, metrics: dict) -> Path:
    """Write ``metrics.json``; non-finite floats become null so the file is strict JSON."""
    path = out_dir / "metrics.json"
    tmp = path.with_name(".metrics.json.tmp")  # a Ctrl-C mid-write leaves the previous file whole
    tmp.write_text(json.dumps(_finite(metrics), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def smooth(values: list[float], weight: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average (as TensorBoard draws it): single-batch losses
    are noisy, and the trend is what the plot is for."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** i))
    return out


def plot_loss(out_dir: Path, train_loss: list[float], val: list[tuple[int, float]], title: str,
              first_step: int = 0) -> Path:
    """Write ``loss.png``: raw and smoothed training loss per step (from ``first_step`` on, for a
    resumed run), validation loss as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(first_step + 1, first_step + len(train_loss) + 1))
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(steps, train_loss, color="tab:blue", alpha=0.3, linewidth=0.8, label="train (batch)")
    ax.plot(steps, smooth(train_loss), color="tab:blue", linewidth=1.8, label="train (smoothed)")
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], "o-", color="tab:orange", label="validation")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out_dir / "loss.png"
    tmp = path.with_name(".loss.png.tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, path)
    return path
