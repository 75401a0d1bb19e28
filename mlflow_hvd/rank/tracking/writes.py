"""Rank 0: what is decided once for every param and metric the job's run gets, whichever API
wrote it - :mod:`mlflow_hvd.tracking` (and the Keras callback and checkpoints on it) or
MLflow's own API through the job's store (:mod:`.store`):

* a param is logged once: the same value again is a no-op, a different one is refused
  (:class:`~mlflow_hvd.errors.ConfigurationError`) or, with ``keep_existing``, skipped;
* the latest step logged moves with every metric that is not a per-batch series: a model
  logged next is linked to the run's metrics at that step;
* a sweep that prunes hears each metric of an epoch (not one evaluating a logged model:
  MLflow's ``model_id`` is set on those);
* after a resume from a snapshot, a metric value at a step the run already has for its key
  is not logged again (:func:`unrepeated`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mlflow_hvd.protocol import records as rec
from mlflow_hvd.rank.tracking import pruning
from mlflow_hvd.rank.tracking.session import RankLogger


def params(logger: RankLogger, given: Mapping[str, Any],
           keep_existing: bool = False) -> list[rec.Param]:
    """The records of ``given`` params the run must still get (values as text).

    Raises:
        ConfigurationError: A param the run has with another value, unless
            ``keep_existing``.
    """
    out = []
    for key, value in given.items():
        text = str(value)
        if logger.check_param(key, text, keep_existing):
            out.append(rec.Param(key, text))
    return out


def unrepeated(logger: RankLogger | None, metrics: list[rec.Metric]) -> list[rec.Metric]:
    """``metrics`` without the values at steps an earlier attempt already logged for their
    key: a loop resumed from a snapshot runs the steps since it again."""
    if logger is None or not logger.repeated_through:
        return metrics
    return [m for m in metrics if m.step > logger.repeated_through.get(m.key, -1)]


def metrics_logged(logger: RankLogger, metrics: Sequence[rec.Metric],
                   per_batch: bool = False, report: bool = True) -> None:
    """After ``metrics`` are queued: the latest step moves to theirs (not for a
    ``per_batch`` series, whose step counts batches), and with ``report`` (the caller gave
    a step) a pruning sweep hears the epoch's values, step by step."""
    if per_batch or not metrics:
        return
    logger.last_step = max(logger.last_step, max(m.step for m in metrics))
    epoch = [m for m in metrics if m.model_id is None]
    if not report:
        return
    for step in sorted({m.step for m in epoch}):
        pruning.observe({m.key: m.value for m in epoch if m.step == step}, step)
