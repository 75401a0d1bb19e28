"""Driver side: the sweep's loss-per-trial chart, logged as an artifact of the parent run."""

from __future__ import annotations

import os
import tempfile
from typing import Any


def plot_losses(client: Any, run_id: str, losses: tuple[float | None, ...], metric: str,
                pruned: tuple[bool, ...] = (), maximised: bool = False) -> None:
    """PNG of the metric per trial, failures as x at the bottom, pruned trials (their value
    at the epoch they stopped after) as hollow triangles, the best trial ringed."""
    # A bare Figure renders with Agg and leaves the caller's pyplot backend alone.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6, 3.5), dpi=100)
    ax = fig.subplots()
    cut = [i < len(pruned) and pruned[i] for i in range(len(losses))]
    xs = [i for i, v in enumerate(losses) if v is not None]
    ys = [v for v in losses if v is not None]
    full = [(i, v) for i, v in zip(xs, ys, strict=True) if not cut[i]]
    ax.plot([i for i, _ in full], [v for _, v in full], "o-", color="tab:blue", label=metric)
    early = [(i, v) for i, v in zip(xs, ys, strict=True) if cut[i]]
    if early:
        ax.plot([i for i, _ in early], [v for _, v in early], "v", color="tab:orange",
                markerfacecolor="none", label="pruned trial (value when stopped)")
    failed = [i for i, v in enumerate(losses) if v is None]
    if failed:
        low = min(ys) if ys else 0.0
        ax.plot(failed, [low] * len(failed), "x", color="tab:red", label="failed trial")
    if full:
        b, best = min(full, key=lambda iv: iv[1]) if not maximised else max(
            full, key=lambda iv: iv[1])
        ax.plot(
            [b],
            [best],
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
