"""Which Spark tasks may still host a worker, so that ``run()`` returns only when none does.

A cancelled Spark task's Python process is killed some time after the driver cancels the
job, and the task may not even have reported yet when the job fails (a rank that raises at
once can fail the job before a slower executor starts its task). The driver therefore
counts every task it lets start a worker (:meth:`TaskGate.admit`, answering the task's
:class:`~mlflow_hvd.protocol.messages.LayoutReport`), lets none start once the job is being
stopped (:meth:`TaskGate.close`), and waits until each admitted task's connection closed
(:meth:`TaskGate.left`). The worker holds a copy of that connection, so it closes only when
the task and its worker are both gone.
"""

from __future__ import annotations

import threading
import time


class TaskGate:
    """Admission and departure of one job's (or warm generation's) Spark tasks.

    Thread-safe: the channel's handler threads admit tasks and report departures while the
    driver loop closes the gate and asks what remains.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = True
        self._admitted: set[int] = set()
        self._left: set[int] = set()
        self._admitted_at = 0.0  # monotonic time of the latest admission (0: none yet)

    def admit(self, partition: int) -> bool:
        """May the task of ``partition`` start its worker? False once the gate is closed."""
        with self._lock:
            if self._open:
                self._admitted.add(partition)
                self._admitted_at = time.monotonic()
            return self._open

    def left(self, partition: int) -> None:
        """The connection of the task of ``partition`` closed."""
        with self._lock:
            self._left.add(partition)

    def close(self) -> None:
        """No task starts a worker from now on (the job is being stopped)."""
        with self._lock:
            self._open = False

    def admitted(self) -> tuple[list[int], float]:
        """Partitions of every task admitted so far, sorted, and when the latest was
        (monotonic; 0.0 when none was): a task reaching the driver is progress of a
        starting job."""
        with self._lock:
            return sorted(self._admitted), self._admitted_at

    def remaining(self) -> list[int]:
        """Partitions of admitted tasks whose connection is still open, sorted."""
        with self._lock:
            return sorted(self._admitted - self._left)
