"""Driver side of elastic jobs (``JobConfig(min_np=...)``): growing an attempt that runs below
``np`` back to ``np`` at a checkpoint.

While an attempt runs on fewer ranks than ``np`` (a host was lost), :class:`GrowBack` looks
every ``grow_interval`` on a thread of its own whether the missing slots are back (on Spark
Connect a look runs probe stages: seconds). Once rank 0's checkpoint is written into the
job's run, rank 0 says so (:class:`~mlflow_hvd.protocol.messages.CheckpointCommitted`), and
the driver loop (:func:`~mlflow_hvd.driver.supervisor.watch`) asks :meth:`GrowBack.at_commit`
whether the attempt ends there for a restart on ``np`` ranks from that checkpoint - in
order with every other event of the job, and never once a rank reported its end (as
torch elastic's agent reacts to membership only while its workers are healthy: a job that
finished wins). The attempt grows back at a checkpoint once the latest look found the
slots back, unless the training loop said the checkpoint is its last (``epochs``
of ``save_checkpoint``; Keras' ``fit`` always says): the job then finishes where it is.
A loop that does not say grows back at the next checkpoint after the slots came back (the
one before may have been its last; a job that returns after it finishes on fewer ranks).

After a planned restart nothing more of the attempt is written: what rank 0 logs after the
checkpoint belongs to work the next attempt, on ``np`` ranks from that checkpoint, does
again (:meth:`GrowBack.dropped`). No epoch is lost, none is logged twice, and no write of
rank 0 waits for a look.

Growing back needs checkpoints in the job's run: a job that does not track
(``TrackingConfig(track=False)``) shrinks but never grows back (the runner says so).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from mlflow_hvd.protocol.messages import (
    CheckpointCommitted,
    EpochReport,
    NotJudged,
    TrackingWrite,
    TrackingWritten,
)

log = logging.getLogger(__name__)


class GrowBack:
    """The controller of one attempt running on ``size`` of ``np`` ranks (see the module
    docstring): :meth:`start` its looks when the attempt starts, :meth:`close` when it
    ends; :meth:`at_commit` decides, from the driver loop only.

    Args:
        np: The ranks the job wants.
        size: The ranks this attempt runs on (fewer).
        interval: Seconds from the attempt's start to the first look for the missing
            slots, and between two looks.
        slots_back: Whether ``np`` slots are there now, this attempt's ``size`` included.
        on_change: Told each look's answer that differs from the one before (the first
            that finds the slots back, then any change; the job's run records it).
    """

    def __init__(self, np: int, size: int, interval: float,
                 slots_back: Callable[[], bool],
                 on_change: Callable[[bool], None] | None = None) -> None:
        self.np, self.size, self.interval = np, size, interval
        self._slots_back = slots_back
        self._on_change = on_change
        self._back = threading.Event()  # the latest look found the slots
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self.restart = threading.Event()  # set: the attempt ended for a restart on np ranks
        self.epoch: int | None = None  # the checkpoint the next attempt resumes from
        self._pending: int | None = None  # a checkpoint that may have been the loop's last

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
        changed = back != self._back.is_set()
        (self._back.set if back else self._back.clear)()
        if changed and self._on_change is not None:
            self._on_change(back)
        return back

    def at_commit(self, commit: CheckpointCommitted) -> bool:
        """Rank 0 committed ``commit.epoch``'s checkpoint, and no rank has ended: whether the
        attempt ends here for a restart on ``np`` ranks from it (then :attr:`restart` is
        set and :attr:`epoch` names it). Called by the driver loop only."""
        if self.restart.is_set():
            return True
        if not self._back.is_set():
            self._pending = None
            return False
        if commit.last:
            log.info("job on %d of %d ranks: the missing slots are back, but epoch %d's "
                     "checkpoint is the training loop's last: the job finishes on %d ranks",
                     self.size, self.np, commit.epoch, self.size)
            return False
        if commit.last is None and self._pending is None:
            self._pending = commit.epoch
            log.info("job on %d of %d ranks: the missing slots are back; the training loop "
                     "did not say whether epoch %d's checkpoint is its last "
                     "(save_checkpoint(epochs=...)): the job grows back at the next one",
                     self.size, self.np, commit.epoch)
            return False
        self.epoch = commit.epoch
        self.restart.set()
        log.warning("mlflow_hvd: %d task slots are back: the job restarts on np=%d ranks from "
                    "the checkpoint of epoch %d it just committed (a planned restart, not a "
                    "failure)", self.np, self.np, commit.epoch)
        return True

    def dropped(self, request: TrackingWrite | EpochReport) -> object:
        """The answer to rank 0's request once the attempt ended for a restart: nothing more
        of it is written."""
        if isinstance(request, TrackingWrite):
            log.debug("dropped %d record(s) rank 0 sent after the restart was planned",
                      len(request.records))
            return TrackingWritten()
        return NotJudged("the job restarts on more ranks")
