"""The driver's side of an elastic job growing back (mlflow_hvd.driver.elastic), on the
records rank 0 really sends: a checkpoint's commit ends the attempt only once a look found
the missing slots back; the looks run on the controller's own thread, never on rank 0's
requests; what follows the checkpoint is not written."""

from __future__ import annotations

import threading
import time

from services import wait_until

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

    store = Store()
    grow = GrowBack(4, 2, interval=60, slots_back=slots_back, run_id=RUN)
    answer = grow.answering(store.answer)
    assert answer(TrackingWrite(RUN, (commit(0),))) == TrackingWritten()
    assert looks == []  # a request never looks
    assert not grow.look()
    assert answer(TrackingWrite(RUN, (metric("step_loss", 5),))) == TrackingWritten()
    assert answer(TrackingWrite(RUN, (commit(1),))) == TrackingWritten()
    assert looks == [False] and not grow.restart.is_set()
    back = True
    assert grow.look()
    assert answer(TrackingWrite(RUN, (metric("step_loss", 6),))) == TrackingWritten()
    assert not grow.restart.is_set()  # no checkpoint in it: the attempt goes on
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


def test_looks_run_on_their_own_thread_and_a_slow_one_holds_no_write() -> None:
    """A look that takes long (a Spark Connect probe: seconds) runs on the controller's
    thread every interval; rank 0's checkpoint written meanwhile is answered at once (before,
    a look ran under the request lock and held it); the next checkpoint after the look found
    the slots is where the attempt ends; closing stops the looks."""
    release, looking = threading.Event(), threading.Event()
    looks: list[float] = []

    def slow_probe() -> bool:
        looks.append(time.monotonic())
        looking.set()
        release.wait(10)
        return True

    store = Store()
    grow = GrowBack(4, 2, interval=0.05, slots_back=slow_probe, run_id=RUN)
    answer = grow.answering(store.answer)
    grow.start()
    try:
        assert looking.wait(5), "the controller never looked"
        t0 = time.monotonic()
        assert answer(TrackingWrite(RUN, (commit(0),))) == TrackingWritten()
        assert time.monotonic() - t0 < 1.0  # not held by the look under way
        assert not grow.restart.is_set()  # the look has not answered yet
        release.set()
        wait_until(lambda: len(looks) >= 2, 5, "a second look")
        assert answer(TrackingWrite(RUN, (commit(1),))) == TrackingWritten()
        assert grow.restart.is_set() and grow.epoch == 1
    finally:
        release.set()
        grow.close()
    assert grow._thread is not None and not grow._thread.is_alive()


def test_a_checkpoint_the_store_did_not_take_plans_no_restart() -> None:
    store = Store(error="server down")
    grow = GrowBack(4, 2, interval=60, slots_back=lambda: True, run_id=RUN)
    assert grow.look()
    written = grow.answering(store.answer)(TrackingWrite(RUN, (commit(0),)))
    assert isinstance(written, TrackingWritten) and written.outage
    assert not grow.restart.is_set()


def test_a_failing_look_leaves_the_job_running() -> None:
    def broken() -> bool:
        raise RuntimeError("probe failed")

    store = Store()
    grow = GrowBack(4, 2, interval=60, slots_back=broken, run_id=RUN)
    assert not grow.look()
    assert grow.answering(store.answer)(TrackingWrite(RUN, (commit(0),))) == TrackingWritten()
    assert not grow.restart.is_set() and store.written == [(commit(0),)]
