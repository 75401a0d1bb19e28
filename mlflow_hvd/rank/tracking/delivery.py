"""Rank 0's delivery of tracking records to the MLflow server: ordered, never blocking
training, surviving an outage.

Training threads only :meth:`Delivery.put` records; one background thread sends them in
order (:mod:`mlflow_hvd.protocol.records`). While the server is unreachable the thread keeps
the records, up to ``memory_limit`` in memory and the rest appended to a spill file in the
rank's scratch directory, and retries with backoff; when the server is back everything is
delivered in order. A batch whose answer was lost is sent again, which MLflow deduplicates.

A record the server *refuses* (not an outage: e.g. a run that is no longer active) is
dropped with its count and the first error, raised by the next :meth:`flush`.

At the end, :meth:`close` waits up to a deadline; what is still undelivered is returned as
an :class:`~mlflow_hvd.protocol.messages.UndeliveredTracking` (records plus the bytes of pending
artifact files), for the worker to hand to the driver, which saves it for replay.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence

from mlflow_hvd.common.deadline import Deadline
from mlflow_hvd.common.tracking_server import is_outage
from mlflow_hvd.errors import TrackingError
from mlflow_hvd.protocol import records as rec
from mlflow_hvd.protocol.messages import TrackingTarget, UndeliveredTracking
from mlflow_hvd.protocol.records import Artifact, Commit, Metric, Record

SEND_INTERVAL = 2.0  # seconds between background sends; flush() sends at once
BACKOFF_MIN, BACKOFF_MAX = 0.5, 5.0
MEMORY_LIMIT = 10_000  # records kept in memory during an outage; the rest go to disk

log = logging.getLogger(__name__)


class DeliveryState(enum.Enum):
    """Where rank 0's delivery is. ``DELIVERING -> OUTAGE -> DELIVERING`` as the server goes
    and comes back; ``STOPPED`` once :meth:`Delivery.close` ends it; ``BROKEN`` if the
    thread itself failed (a bug: raised by the next :meth:`Delivery.flush`)."""

    DELIVERING = "delivering"
    OUTAGE = "outage"  # the server is unreachable: records kept, retried with backoff
    STOPPED = "stopped"
    BROKEN = "broken"


class Delivery:
    """The background sender of one rank-0 process (see the module docstring).

    ``state`` changes only through the transition methods (``_outage``, ``_reachable``,
    ``_stop``, ``_break``), under ``_cond``; each says so in the lifecycle log.
    """

    def __init__(self, target: TrackingTarget, send: Callable[[Sequence[Record]], None],
                 spool_dir: str, memory_limit: int = MEMORY_LIMIT) -> None:
        self.target = target
        self._send = send  # makes the call(s) for one batch (:mod:`.sender`); raises on failure
        self.spool_dir = spool_dir
        self._memory_limit = memory_limit
        self._cond = threading.Condition()
        self._inbox: collections.deque[Record] = collections.deque()
        self._memory: collections.deque[Record] = collections.deque()
        self._spill_path = os.path.join(spool_dir, "pending.jsonl")
        self._spill_offset = 0  # bytes of the spill file already moved to memory
        self._spilled = 0  # records in the spill file not yet moved to memory
        self._put = self._done = 0  # records put; records delivered or refused
        self._flush_wanted = 0
        self.state = DeliveryState.DELIVERING
        # refusals not yet reported (the next flush raises them), with the first error
        self._refused: list[Record] = []
        self._error: BaseException | None = None
        self._outage_since = 0.0  # time.time() the last OUTAGE began; 0 once it ended
        self._last_outage = ""  # why, in one line
        self._moving: list[Record] = []  # taken from the inbox, not yet pending
        self._broken: BaseException | None = None  # what made it BROKEN
        self._files = 0
        self._thread = threading.Thread(target=self._loop, name="mlflow-hvd-delivery",
                                        daemon=True)
        self._thread.start()

    # --- training side -----------------------------------------------------------------
    def put(self, record: Record) -> None:
        """Queue ``record``. A checkpoint commit is sent at once (with everything before
        it), without waiting for the next send interval: a restart resumes from it."""
        with self._cond:
            self._inbox.append(record)
            self._put += 1
            if isinstance(record, Commit):
                self._flush_wanted = self._put
            # Waking the thread for every value (five per step) made it contend with
            # training for the GIL; it takes the inbox at its next send interval instead.
            if isinstance(record, Commit) or len(self._inbox) >= rec.MAX_METRICS:
                self._cond.notify_all()

    def stage_file(self, src: str, name: str | None = None) -> str:
        """Copy ``src`` into the spool (the caller may delete or rewrite it at once)."""
        self._files += 1
        folder = os.path.join(self.spool_dir, "files", str(self._files))
        os.makedirs(folder)
        dst = os.path.join(folder, name or os.path.basename(src))
        shutil.copyfile(src, dst)
        return dst

    def queued(self) -> tuple[int, int]:
        """Records taken from the inbox and not yet delivered: ``(in memory, in the spill
        file)``."""
        with self._cond:
            return len(self._memory), self._spilled

    def flush(self, timeout: float) -> None:
        """Wait until every record put so far is delivered.

        Raises:
            TrackingError: Records were refused by the server, or the deadline passed
                (the records stay queued and are delivered later).
        """
        deadline = Deadline.after(timeout)
        with self._cond:
            target = self._put
            self._flush_wanted = max(self._flush_wanted, target)
            self._cond.notify_all()
            while self._done < target:
                self._raise_broken()
                if deadline.passed():
                    n = target - self._done
                    raise TrackingError(
                        f"MLflow logging did not drain within {timeout:g}s: {n} "
                        f"record{'s' if n != 1 else ''} still queued for run "
                        f"{self.target.run_id}; {self._describe_outage()}"
                    )
                self._cond.wait(deadline.slice(0.5))
            self._raise_refused()

    def close(self, timeout: float, host: str) -> tuple[UndeliveredTracking | None, str]:
        """Deliver what is left within ``timeout`` seconds, then stop the thread.

        Returns:
            (what was not delivered, or None; the refusal message, or "").
        """
        deadline = Deadline.after(timeout)
        with self._cond:
            self._flush_wanted = self._put
            self._cond.notify_all()
            while (self._done < self._put and not deadline.passed()
                   and self.state is not DeliveryState.BROKEN):
                self._cond.wait(deadline.slice(0.5))
            self._stop()
            complete = self._done >= self._put
        refusal = ""
        try:
            self._raise_refused()
        except TrackingError as exc:
            refusal = str(exc)
        return (None if complete else self._snapshot(host)), refusal

    # --- background thread -------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._deliver()
        except BaseException as exc:  # a bug here must surface, not stall logging silently
            with self._cond:
                self._break(exc)
            raise

    def _deliver(self) -> None:
        backoff = BACKOFF_MIN
        last_send = time.monotonic()
        while True:
            self._take_inbox()
            with self._cond:
                pending = bool(self._memory) or self._spilled > 0
                wanted = self._flush_wanted > self._done
                due = time.monotonic() - last_send >= SEND_INTERVAL
                if self.state is DeliveryState.STOPPED:
                    return
                if not pending or not (wanted or due or len(self._memory) >= rec.MAX_METRICS):
                    # sleep until the next send is due (or a commit, a flush, a full batch)
                    since = time.monotonic() - last_send
                    self._cond.wait(max(0.01, SEND_INTERVAL - since) if pending else SEND_INTERVAL)
                    continue
                batch = self._head()
            last_send = time.monotonic()
            try:
                self._send(batch)
            except Exception as exc:
                if is_outage(exc):
                    with self._cond:
                        self._outage(exc)
                    self._pause(backoff)
                    backoff = min(backoff * 2, BACKOFF_MAX)
                    continue
                self._finish(batch, refused=exc)
            else:
                backoff = BACKOFF_MIN
                self._finish(batch)

    def _pause(self, seconds: float) -> None:
        """Wait ``seconds`` before retrying a server that is down; new records do not cut
        the wait short (they would turn the backoff into a retry per record), a stop does."""
        end = time.monotonic() + seconds
        with self._cond:
            while self.state is not DeliveryState.STOPPED and (left := end - time.monotonic()) > 0:
                self._cond.wait(left)

    def _take_inbox(self) -> None:
        """Move records from the inbox to the pending sequence: memory, then spill file.

        Metric values are converted outside the lock: a tensor may make ``float()`` wait,
        and neither training (``put``) nor a deadline (``flush``) must wait with it."""
        with self._cond:
            if not self._inbox:
                return
            self._moving = list(self._inbox)
            self._inbox.clear()
        self._moving = [r.converted() if isinstance(r, Metric) else r for r in self._moving]
        with self._cond:
            spill = None
            try:
                for record in self._moving:
                    if self._spilled == 0 and len(self._memory) < self._memory_limit:
                        self._memory.append(record)
                        continue
                    if spill is None:
                        new = not os.path.exists(self._spill_path)
                        spill = open(self._spill_path, "a")  # noqa: SIM115 - closed below
                        if new:
                            spill.write(rec.header() + "\n")
                    spill.write(rec.encode(record) + "\n")
                    self._spilled += 1
            finally:
                self._moving = []
                if spill is not None:
                    spill.close()

    def _head(self) -> list[Record]:
        if not self._memory and self._spilled:
            self._load_spill()
        n = rec.next_batch(self._memory)
        return [self._memory[i] for i in range(n)]

    def _load_spill(self) -> None:
        with open(self._spill_path) as f:
            f.seek(self._spill_offset)
            while len(self._memory) < self._memory_limit and self._spilled:
                line = f.readline()
                if not line:
                    break
                if self._spill_offset == 0 and rec.check_header(line, self._spill_path):
                    self._spill_offset = f.tell()  # the header, not a record
                    continue
                self._memory.append(rec.decode(line))
                self._spilled -= 1
            self._spill_offset = f.tell()
        if self._spilled == 0:  # everything moved to memory: start a new file next time
            os.remove(self._spill_path)
            self._spill_offset = 0

    def _finish(self, batch: list[Record], refused: BaseException | None = None) -> None:
        with self._cond:
            for _ in batch:
                self._memory.popleft()
            self._done += len(batch)
            if refused is not None:
                self._refused.extend(batch)
                self._error = self._error or refused
            if refused is None:
                self._reachable()
            self._cond.notify_all()
        if refused is None:
            for r in batch:
                if isinstance(r, Artifact) and r.path.startswith(self.spool_dir):
                    with contextlib.suppress(OSError):  # the spool is removed at close anyway
                        os.remove(r.path)

    # --- transitions (under _cond) ------------------------------------------------------
    def _outage(self, exc: BaseException) -> None:
        """DELIVERING -> OUTAGE (or stay, noting the latest reason)."""
        self._last_outage = str(exc).splitlines()[0][:300] if str(exc) else repr(exc)
        if self.state is DeliveryState.DELIVERING:
            self.state, self._outage_since = DeliveryState.OUTAGE, time.time()
            log.info("run %s: delivering -> outage: %s", self.target.run_id, self._last_outage)

    def _reachable(self) -> None:
        """OUTAGE -> DELIVERING: a batch was delivered again."""
        if self.state is DeliveryState.OUTAGE:
            self.state = DeliveryState.DELIVERING
            log.info("run %s: outage -> delivering after %.1fs", self.target.run_id,
                     time.time() - self._outage_since)
            self._outage_since = 0.0

    def _stop(self) -> None:
        """-> STOPPED (from any state but BROKEN): the thread leaves at its next check."""
        if self.state is not DeliveryState.BROKEN:
            self.state = DeliveryState.STOPPED
        self._cond.notify_all()

    def _break(self, exc: BaseException) -> None:
        """-> BROKEN: the thread failed; the next flush raises it."""
        self.state, self._broken = DeliveryState.BROKEN, exc
        log.info("run %s: delivery thread failed: %r", self.target.run_id, exc)
        self._cond.notify_all()

    def _describe_outage(self) -> str:
        if not self._outage_since:  # no outage began, or the last one ended (a stop keeps it)
            return f"the tracking server at {self.target.tracking_uri} is slow to answer"
        since = time.strftime("%H:%M:%S", time.localtime(self._outage_since))
        return (f"the tracking server at {self.target.tracking_uri} has been unreachable "
                f"since {since}: {self._last_outage}")

    def _raise_broken(self) -> None:
        if self._broken is not None:
            raise TrackingError(
                f"the MLflow delivery thread of run {self.target.run_id} failed: "
                f"{type(self._broken).__name__}: {self._broken}"
            ) from self._broken

    def _raise_refused(self) -> None:
        if self._error is None:
            return
        error, refused = self._error, self._refused
        self._error, self._refused = None, []
        raise TrackingError(
            f"the tracking store refused {rec.describe(rec.count(refused))} for run "
            f"{self.target.run_id} (not logged): {error}"
        )

    def _snapshot(self, host: str) -> UndeliveredTracking:
        """Everything not yet delivered, in order (the batch in flight included: sending
        it again is harmless)."""
        with self._cond:
            pending = list(self._memory)
            if self._spilled:
                with open(self._spill_path) as f:
                    f.seek(self._spill_offset)
                    for line in f:
                        if line.startswith("{"):  # the file's header (records are lists)
                            continue
                        pending.append(rec.decode(line))
            pending.extend(self._moving)
            pending.extend(self._inbox)
            reason = self._describe_outage()
        files: list[tuple[str, bytes]] = []
        out: list[Record] = []
        for r in pending:
            if isinstance(r, Metric):
                r = r.converted()
            if isinstance(r, Artifact):
                key = f"{len(files)}/{os.path.basename(r.path)}"
                with open(r.path, "rb") as f:
                    files.append((key, f.read()))
                r = Artifact(key, r.artifact_dir)
            out.append(r)
        return UndeliveredTracking(self.target.run_id, self.target.tracking_uri, host, tuple(out),
                           tuple(files), reason)
