"""Driver side: Hyperopt's ``Trials`` saved in the sweep's parent run, so an interrupted
sweep resumes."""

from __future__ import annotations

import math
import os
import pickle
import tempfile
from typing import Any

from mlflow_hvd.errors import TrackingError

TRIALS_ARTIFACT = "hyperopt/trials.pkl"


def load_trials(client: Any, run_id: str) -> Any:
    """The trials saved in ``run_id``, or None when the run has none saved.

    Raises:
        TrackingError: Trials are saved but cannot be read: the sweep must not start over
            (and later overwrite them) as if there were none.
    """
    folder = os.path.dirname(TRIALS_ARTIFACT)
    saved = [a.path for a in client.list_artifacts(run_id, folder)]
    if TRIALS_ARTIFACT not in saved:
        return None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = client.download_artifacts(run_id, TRIALS_ARTIFACT, tmp)
            with open(path, "rb") as f:
                return pickle.load(f)
    except Exception as exc:
        raise TrackingError(
            f"sweep run {run_id} has saved trials ({TRIALS_ARTIFACT}) that cannot be read: "
            f"{type(exc).__name__}: {exc}. Fix access to the run's artifacts and rerun, or "
            "start a new sweep without parent_run_id"
        ) from exc


def save_trials(client: Any, run_id: str, trials: Any) -> None:
    """Store ``trials`` in ``run_id`` (replacing the previous copy)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, os.path.basename(TRIALS_ARTIFACT))
        with open(path, "wb") as f:
            pickle.dump(trials, f)
        client.log_artifact(run_id, path, os.path.dirname(TRIALS_ARTIFACT))


def no_progress(results: list[dict[str, Any]], rounds: int) -> bool:
    """hyperopt's ``no_progress_loss`` rule (no new best loss for ``rounds`` trials), as a
    pure function of the trial history so that it holds across a resume, and with failed
    and pruned trials counted as no progress (hyperopt's own raises on failed ones)."""
    # a pruned trial's value is from an early epoch: never a new best
    losses = [None if r.get("pruned_at_epoch") else r.get("loss") for r in results]
    best_at = None
    best = math.inf
    for i, loss in enumerate(losses):
        if loss is not None and loss < best:
            best, best_at = loss, i
    return best_at is not None and len(losses) - 1 - best_at >= rounds
