"""The driver's side of an elastic job growing back (mlflow_hvd.driver.elastic), on the
records rank 0 really sends: a checkpoint's commit ends the attempt only once the missing
slots are back, looked for at most once per interval; what follows the checkpoint is not
written."""

from __future__ import annotations

from mlflow_hvd.driver.elastic import GrowBack, checkpoint_commit
from mlflow_hvd.protocol import records as rec
from mlflow_hvd.protocol.checkpoint_layout import LATEST_TAG, model_path
from mlflow_hvd.protocol.messages import EpochReport, NotJudged, TrackingWrite, TrackingWritten

RUN = "r1"


def metric(key: str, step: int) -> rec.Metric:
    return rec.Metric(key, 1.0, 0, step)


def commit(epoch: int, tag: str | None = None) -> rec.Commit:
    return rec.Commit((metric("loss", epoch),),
                      (rec.Tag(LATEST_TAG, tag or model_path(epoch)),))


class Clock:
    """Seconds that pass only when a test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Store:
    """What the driver's relay was asked to write."""

    def __init__(self, error: str = "") -> None:
        self.written: list[tuple[rec.Record, ...]] = []
        self.error = error

    def answer(self, request: TrackingWrite | EpochReport) -> object:
        if isinstance(request, EpochReport):
            return NotJudged("no judge")
        self.written.append(request.records)
        return TrackingWritten(self.error, outage=bool(self.error))


def test_a_checkpoint_commit_is_found_only_when_it_names_an_epoch() -> None:
    records = (metric("a", 0), commit(0), metric("b", 1), commit(1), metric("c", 2))
    assert checkpoint_commit(records, RUN) == 3
    assert checkpoint_commit((metric("a", 0),), RUN) is None
    # MLflow autolog's best-only checkpoint: nothing to resume from
    assert checkpoint_commit((commit(0, "checkpoints/latest_checkpoint.keras"),), RUN) is None


def test_the_attempt_ends_at_the_checkpoint_after_the_slots_are_back() -> None:
    looks: list[bool] = []
    back = False

    def slots_back() -> bool:
        looks.append(back)
        return back

    store, clock = Store(), Clock()
    grow = GrowBack(4, 2, interval=60, slots_back=slots_back, run_id=RUN, clock=clock)
    answer = grow.answering(store.answer)
    # within the interval of the attempt's start: no look
    assert answer(TrackingWrite(RUN, (commit(0),))) == TrackingWritten()
    assert looks == []
    clock.now += 60
    assert answer(TrackingWrite(RUN, (metric("step_loss", 5),))) == TrackingWritten()
    assert looks == []  # no checkpoint, no look
    assert answer(TrackingWrite(RUN, (commit(1),))) == TrackingWritten()
    assert looks == [False] and not grow.restart.is_set()
    assert answer(TrackingWrite(RUN, (commit(2),))) == TrackingWritten()
    assert looks == [False]  # looked less than an interval ago
    back = True
    clock.now += 60
    after = (metric("step_loss", 9), metric("val", 3))
    assert answer(TrackingWrite(RUN, (metric("val", 3), commit(3), *after))) == (
        TrackingWritten())
    assert looks == [False, True] and grow.restart.is_set() and grow.epoch == 3
    # written up to the checkpoint's commit; what followed it is done again
    assert store.written[-1] == (metric("val", 3), commit(3))
    count = len(store.written)
    assert answer(TrackingWrite(RUN, (commit(4),))) == TrackingWritten()
    assert answer(EpochReport(RUN, "loss", 4, 0.5)) == NotJudged(
        "the job restarts on more ranks")
    assert len(store.written) == count  # nothing more of the attempt reaches the run


def test_a_checkpoint_the_store_did_not_take_plans_no_restart() -> None:
    store, clock = Store(error="server down"), Clock()
    grow = GrowBack(4, 2, interval=60, slots_back=lambda: True, run_id=RUN, clock=clock)
    clock.now += 60
    written = grow.answering(store.answer)(TrackingWrite(RUN, (commit(0),)))
    assert isinstance(written, TrackingWritten) and written.outage
    assert not grow.restart.is_set()


def test_a_failing_look_leaves_the_job_running() -> None:
    def broken() -> bool:
        raise RuntimeError("probe failed")

    store, clock = Store(), Clock()
    grow = GrowBack(4, 2, interval=60, slots_back=broken, run_id=RUN, clock=clock)
    clock.now += 60
    assert grow.answering(store.answer)(TrackingWrite(RUN, (commit(0),))) == TrackingWritten()
    assert not grow.restart.is_set() and store.written == [(commit(0),)]
