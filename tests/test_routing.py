"""Who answers each request on the driver (driver/routing.py, driver/tracking/epochs.py):
every request type gets its own answer type, and a reader of a reply knows its meaning."""

from __future__ import annotations

import queue

from mlflow_hvd.driver.rendezvous import Rendezvous
from mlflow_hvd.driver.routing import (
    credentials_answer,
    layout_answer,
    message_router,
    request_router,
    untracked_answer,
)
from mlflow_hvd.driver.tasks import TaskGate
from mlflow_hvd.driver.tracking.epochs import rank0_requests
from mlflow_hvd.protocol.credentials import Credentials, Sealed
from mlflow_hvd.protocol.messages import (
    AskCredentials,
    AwaitJob,
    EpochReport,
    EpochVerdict,
    NoCredentials,
    NotJudged,
    TrackingWrite,
    TrackingWritten,
    Unanswered,
    UndeliveredTracking,
    WorkerStarted,
)

SECRET = b"k" * 32


def test_a_request_nobody_handles_is_unanswered_naming_it() -> None:
    route = request_router(untracked_answer, lambda r: None, lambda r: None)
    assert route(AwaitJob(0)) == Unanswered("this driver does not answer AwaitJob")
    assert route(WorkerStarted(0, "h")) == Unanswered(
        "this driver does not answer WorkerStarted")


def test_an_untracked_job_refuses_writes_and_judges_no_epoch() -> None:
    assert untracked_answer(TrackingWrite("r1", ())) == TrackingWritten(
        error="the driver keeps no MLflow run for this job (rank 0 wrote to run r1)",
        outage=False)
    assert untracked_answer(EpochReport("r1", "val_loss", 1, 0.5)) == NotJudged(
        "the job does not prune")


def test_credentials_go_to_rank_0_only_and_sealed() -> None:
    credentials = Credentials((("MLFLOW_TRACKING_TOKEN", "t"),), ())
    answer = credentials_answer(SECRET, lambda: credentials)
    assert isinstance(answer(AskCredentials(0)), Sealed)
    assert answer(AskCredentials(1)) == NoCredentials()
    assert credentials_answer(SECRET, lambda: None)(AskCredentials(0)) == NoCredentials()


def test_epoch_reports_without_a_judge_another_run_or_a_failing_judge_train_on() -> None:
    def written(request: TrackingWrite) -> TrackingWritten:
        return TrackingWritten()

    report = EpochReport("r1", "val_loss", 2, 0.5)
    assert rank0_requests(written, None, "r1")(report) == NotJudged("the job does not prune")

    class Judge:
        metric = "val_loss"

        def __call__(self, report: EpochReport) -> EpochVerdict:
            if report.step == 3:
                raise ZeroDivisionError("no history")
            return EpochVerdict(True, 2, "worse than the median")

    answer = rank0_requests(written, Judge(), "r1")
    assert answer(report) == EpochVerdict(True, 2, "worse than the median")
    assert answer(EpochReport("r2", "val_loss", 2, 0.5)) == NotJudged(
        "run r2 is not this job's run (r1)")
    assert answer(EpochReport("r1", "val_loss", 3, 0.5)) == NotJudged(
        "judging failed: ZeroDivisionError: no history")
    assert answer(TrackingWrite("r1", ())) == TrackingWritten()


def test_a_late_layout_report_starts_no_worker() -> None:
    from mlflow_hvd.common.layout import assign_slots
    from mlflow_hvd.protocol.messages import Launch, LayoutReport, StartNoWorker

    rendezvous = Rendezvous(2)
    try:
        tasks, events = TaskGate(), queue.Queue[object]()
        answer = layout_answer(tasks, rendezvous, events.put)
        slots = assign_slots(["h", "h"])
        assert answer(LayoutReport(0, slots)) == Launch()
        tasks.close()
        assert answer(LayoutReport(1, slots)) == StartNoWorker()
        assert tasks.remaining() == [0]
    finally:
        rendezvous.stop()


def test_undelivered_tracking_goes_to_the_current_jobs_handler() -> None:
    rendezvous = Rendezvous(1)
    try:
        kept: list[UndeliveredTracking] = []
        events: queue.Queue[object] = queue.Queue()
        handler = {"now": None}
        route = message_router(events.put, rendezvous, lambda: handler["now"], TaskGate())
        message = UndeliveredTracking("r1", "sqlite://", "h", (), (), "outage")
        route(message)  # no job yet: said, not queued
        handler["now"] = kept.append  # type: ignore[assignment]
        route(message)
        assert kept == [message] and events.empty()
    finally:
        rendezvous.stop()
