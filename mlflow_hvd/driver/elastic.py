"""Driver side of elastic jobs (``JobConfig(min_np=...)``): growing an attempt that runs below
``np`` back to ``np`` at a checkpoint.

While an attempt runs on fewer ranks than ``np`` (a host was lost), a controller thread of
its own looks every ``grow_interval`` whether the missing slots are back (on Spark Connect a
look runs probe stages: seconds). Rank 0's writes to the run are watched: when one of them
commits a resumable checkpoint (the run's latest-checkpoint tag, written in one call with
the epoch's metrics) after a look found the slots back, the driver writes the records up to
and including that checkpoint and plans a restart (:class:`GrowBack`'s ``restart`` event:
the driver loop then ends the job with :class:`~mlflow_hvd.driver.supervisor.GrowingBack`,
and the runner's attempts go on with ``Decision.GROW``). Every later write of the attempt
is answered without being written: what rank 0 logs after the checkpoint belongs to work
the next attempt, on ``np`` ranks from that checkpoint, does again. No epoch is lost, none
is logged twice, and no write of rank 0 waits for a look.

Growing back needs checkpoints in the job's run: a job that does not track
(``TrackingConfig(track=False)``) shrinks but never grows back (the runner says so).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

from mlflow_hvd.protocol import records as rec
from mlflow_hvd.protocol.checkpoint_layout import LATEST_TAG, parse
from mlflow_hvd.protocol.messages import EpochReport, NotJudged, TrackingWrite, TrackingWritten

log = logging.getLogger(__name__)

Answer = Callable[[TrackingWrite | EpochReport], object]


def checkpoint_commit(records: tuple[rec.Record, ...], run_id: str) -> int | None:
    """The index of the last record that commits a resumable checkpoint of ``run_id``
    (None: there is none)."""
    found = None
    for index, record in enumerate(records):
        if isinstance(record, rec.Commit) and any(
                tag.key == LATEST_TAG and parse(run_id, tag.value) is not None
                for tag in record.tags):
            found = index
    return found


class GrowBack:
    """Watches one attempt running on ``size`` of ``np`` ranks (see the module docstring):
    :meth:`start` its looks when the attempt starts, :meth:`close` when it ends.

    Args:
        np: The ranks the job wants.
        size: The ranks this attempt runs on (fewer).
        interval: Seconds from the attempt's start to the first look for the missing
            slots, and between two looks.
        slots_back: Whether ``np`` slots are there now, this attempt's ``size`` included.
        run_id: The job's run.
    """

    def __init__(self, np: int, size: int, interval: float, slots_back: Callable[[], bool],
                 run_id: str) -> None:
        self.np, self.size, self.interval, self.run_id = np, size, interval, run_id
        self._slots_back = slots_back
        self._back = threading.Event()  # the latest look found the slots
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.restart = threading.Event()  # set: the attempt ends for a restart on np ranks
        self.epoch: int | None = None  # the checkpoint the next attempt resumes from

    def start(self) -> None:
        """Start looking, every ``interval`` seconds, off rank 0's requests."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._looks, name="mlflow-hvd-grow-back",
                                            daemon=True)
            self._thread.start()

    def close(self, timeout: float = 1.0) -> None:
        """Stop looking (a look under way ends by itself: the thread is a daemon)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _looks(self) -> None:
        while not self._closed.wait(self.interval) and not self.restart.is_set():
            self.look()

    def look(self) -> bool:
        """Look once whether the missing slots are back, and remember the answer."""
        try:
            back = self._slots_back()
        except Exception:  # counting failed (a Connect probe): training goes on as it is
            log.warning("looking for the missing slots failed; the job goes on on %d ranks",
                        self.size, exc_info=True)
            back = False
        log.info("job on %d of %d ranks: the missing slots are %s", self.size, self.np,
                 "back" if back else "still missing")
        (self._back.set if back else self._back.clear)()
        return back

    def answering(self, answer: Answer) -> Answer:
        """``answer`` (rank 0's requests) with the attempt's growth watched."""

        def watched(request: TrackingWrite | EpochReport) -> object:
            with self._lock:  # one request at a time: writes stay in rank 0's order
                if self.restart.is_set():
                    return self._dropped(request)
                if not isinstance(request, TrackingWrite):
                    return answer(request)
                cut = checkpoint_commit(request.records, self.run_id)
                if cut is None or not self._back.is_set():
                    return answer(request)
                kept = dataclasses.replace(request, records=request.records[:cut + 1])
                written = answer(kept)
                if isinstance(written, TrackingWritten) and not written.error:
                    self._plan(request.records[cut], len(request.records) - cut - 1)
                return written

        return watched

    def _plan(self, commit: rec.Record, dropped: int) -> None:
        assert isinstance(commit, rec.Commit)
        tag = next(t for t in commit.tags if t.key == LATEST_TAG)
        ref = parse(self.run_id, tag.value)
        self.epoch = ref.epoch if ref is not None else None
        self.restart.set()
        log.warning("mlflow_hvd: %d task slots are back: the job restarts on np=%d ranks from "
                    "the checkpoint of epoch %s it just committed (a planned restart, not a "
                    "failure)%s", self.np, self.np, self.epoch,
                    f"; {dropped} record(s) logged after it are done again" if dropped else "")

    def _dropped(self, request: TrackingWrite | EpochReport) -> object:
        """After the planned restart: nothing more of this attempt is written."""
        if isinstance(request, TrackingWrite):
            log.debug("dropped %d record(s) rank 0 sent after the restart was planned",
                      len(request.records))
            return TrackingWritten()
        return NotJudged("the job restarts on more ranks")
