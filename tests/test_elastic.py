"""The driver's side of an elastic job growing back (mlflow_hvd.driver.elastic): the
controller decides at the checkpoints rank 0 reports committed, once a look found the
missing slots back, never at the training loop's last; the looks run on the controller's
own thread; after the decision nothing more of the attempt is written."""

from __future__ import annotations

import threading
import time

from services import wait_until

from mlflow_hvd.driver.elastic import GrowBack
from mlflow_hvd.protocol import records as rec
from mlflow_hvd.protocol.messages import (
    CheckpointCommitted,
    EpochReport,
    NotJudged,
    TrackingWrite,
    TrackingWritten,
)

RUN = "r1"


def committed(epoch: int, last: bool | None = None) -> CheckpointCommitted:
    return CheckpointCommitted(0, epoch, last)


def controller(back: bool, interval: float = 60) -> GrowBack:
    grow = GrowBack(4, 2, interval=interval, slots_back=lambda: back)
    grow.look()
    return grow


def test_without_the_slots_no_checkpoint_ends_the_attempt() -> None:
    grow = controller(back=False)
    assert not any(grow.at_commit(committed(e, last)) for e, last in
                   ((0, False), (1, None), (2, None)))
    assert not grow.restart.is_set() and grow.epoch is None


def test_with_the_slots_back_the_attempt_ends_at_a_checkpoint_the_loop_says_is_not_its_last(
) -> None:
    grow = controller(back=True)
    assert grow.at_commit(committed(3, last=False))
    assert grow.restart.is_set() and grow.epoch == 3


def test_the_loops_last_checkpoint_never_ends_the_attempt() -> None:
    grow = controller(back=True)
    assert not grow.at_commit(committed(5, last=True))
    assert not grow.restart.is_set()


def test_a_loop_that_does_not_say_grows_back_at_the_next_checkpoint() -> None:
    """Its checkpoint may have been its last: the attempt ends only at the one after it,
    which proves more epochs followed; slots gone again in between start over."""
    grow = controller(back=True)
    assert not grow.at_commit(committed(1))
    assert grow.at_commit(committed(2)) and grow.epoch == 2
    grow = controller(back=True)
    assert not grow.at_commit(committed(1))
    grow._slots_back = lambda: False
    grow.look()
    assert not grow.at_commit(committed(2))
    grow._slots_back = lambda: True
    grow.look()
    assert not grow.at_commit(committed(3))  # pending again
    assert grow.at_commit(committed(4)) and grow.epoch == 4


def test_after_the_decision_nothing_more_of_the_attempt_is_written() -> None:
    grow = controller(back=True)
    assert grow.at_commit(committed(0, last=False))
    metric = rec.Metric("loss", 1.0, 0, 1)
    assert grow.dropped(TrackingWrite(RUN, (metric,))) == TrackingWritten()
    assert grow.dropped(EpochReport(RUN, "loss", 1, 0.5)) == NotJudged(
        "the job restarts on more ranks")


def test_looks_run_on_their_own_thread_and_a_slow_one_holds_no_decision() -> None:
    """A look that takes long (a Spark Connect probe: seconds) runs on the controller's
    thread every interval; a checkpoint reported meanwhile is decided at once, on what the
    last finished look found; the next checkpoint after the look found the slots is where
    the attempt ends; closing stops the looks."""
    release, looking = threading.Event(), threading.Event()
    looks: list[float] = []

    def slow_probe() -> bool:
        looks.append(time.monotonic())
        looking.set()
        release.wait(10)
        return True

    grow = GrowBack(4, 2, interval=0.05, slots_back=slow_probe)
    grow.start()
    try:
        assert looking.wait(5), "the controller never looked"
        t0 = time.monotonic()
        assert not grow.at_commit(committed(0, last=False))  # no look has answered yet
        assert time.monotonic() - t0 < 1.0  # not held by the look under way
        release.set()
        wait_until(lambda: len(looks) >= 2, 5, "a second look")
        assert grow.at_commit(committed(1, last=False)) and grow.epoch == 1
    finally:
        release.set()
        grow.close()
    assert grow._thread is not None and not grow._thread.is_alive()


def test_a_failing_look_leaves_the_job_running() -> None:
    def broken() -> bool:
        raise RuntimeError("probe failed")

    grow = GrowBack(4, 2, interval=60, slots_back=broken)
    assert not grow.look()
    assert not grow.at_commit(committed(0, last=False)) and not grow.restart.is_set()


def test_each_change_of_the_looks_answer_is_told_and_only_a_change() -> None:
    """The job's run records when the missing slots came back (and went again): the
    controller tells each answer that differs from the one before, from the first look."""
    answers = iter([False, False, True, True, False, True])
    told: list[bool] = []
    grow = GrowBack(4, 2, interval=60, slots_back=lambda: next(answers),
                    on_change=told.append)
    assert [grow.look() for _ in range(6)] == [False, False, True, True, False, True]
    assert told == [True, False, True]
