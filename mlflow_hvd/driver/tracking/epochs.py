"""Driver side of pruning: what answers rank 0's tracking requests in a job whose epochs
are judged (:mod:`mlflow_hvd.rank.tracking.pruning` is the rank side).

The job's judge (the runner's adapter of a :class:`mlflow_hvd.runner.EpochJudge`, a sweep's
trial) answers each :class:`~mlflow_hvd.protocol.messages.EpochReport` on the channel
server's thread, while rank 0 waits: a decision from numbers already in memory, no MLflow
call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from mlflow_hvd.protocol.messages import (
    EpochReport,
    EpochVerdict,
    NotJudged,
    TrackingWrite,
    TrackingWritten,
)

log = logging.getLogger(__name__)

Judge = Callable[[EpochReport], EpochVerdict]
"""Decides, per epoch, whether a job's training goes on."""


def rank0_requests(
    writes: Callable[[TrackingWrite], TrackingWritten],
    judge: Judge | None,
    run_id: str,
) -> Callable[[TrackingWrite | EpochReport], object]:
    """One job's answers to rank 0: writes to ``writes``, epoch reports of the job's run to
    ``judge`` (:class:`NotJudged` without one, for another run, or when the judge fails:
    rank 0 then trains on)."""

    def answer(request: TrackingWrite | EpochReport) -> object:
        if not isinstance(request, EpochReport):
            return writes(request)
        if judge is None:
            return NotJudged("the job does not prune")
        if request.run_id != run_id:
            return NotJudged(f"run {request.run_id} is not this job's run ({run_id})")
        try:
            return judge(request)
        except Exception as exc:  # a bug in the judge must not stop training: it goes on
            log.exception("run %s: judging epoch step %d failed; the trial goes on",
                          run_id, request.step)
            return NotJudged(f"judging failed: {type(exc).__name__}: {exc}")

    return answer
