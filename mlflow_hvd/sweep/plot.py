"""The sweep's loss-per-trial chart, logged as an artifact of the parent run."""

from __future__ import annotations

import os
import tempfile
from typing import Any


def plot_losses(client: Any, run_id: str, losses: tuple[float | None, ...], metric: str) -> None:
    """PNG of the loss per trial, failures as x at the bottom, the best ringed."""
    # A bare Figure renders with Agg and leaves the caller's pyplot backend alone.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6, 3.5), dpi=100)
    ax = fig.subplots()
    xs = [i for i, v in enumerate(losses) if v is not None]
    ys = [v for v in losses if v is not None]
    ax.plot(xs, ys, "o-", color="tab:blue", label=metric)
    failed = [i for i, v in enumerate(losses) if v is None]
    if failed:
        low = min(ys) if ys else 0.0
        ax.plot(failed, [low] * len(failed), "x", color="tab:red", label="failed trial")
    if ys:
        b = xs[ys.index(min(ys))]
        ax.plot(
            [b],
            [min(ys)],
            "o",
            markersize=14,
            markerfacecolor="none",
            markeredgecolor="tab:green",
            markeredgewidth=2,
            label=f"best (trial {b})",
        )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial")
    ax.set_ylabel(metric)
    ax.set_title("hyperopt sweep")
    ax.legend()
    fig.tight_layout()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "loss_per_trial.png")
        fig.savefig(path)
        client.log_artifact(run_id, path)
