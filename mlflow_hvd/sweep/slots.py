"""Driver side: the runners a sweep's concurrent trials run on, one trial each at a time,
each trial in a thread of its own; stopping them is asking their runners to stop
(:meth:`HorovodRunner.stop`)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from mlflow_hvd.runner import HorovodRunner

log = logging.getLogger(__name__)

STOP_WAIT = 60.0  # seconds stopped trials get to stop their ranks and end their runs

Outcome = dict[str, Any] | BaseException  # a trial's hyperopt result, or what it raised


class Slots:
    """The runners trials run on, one trial each at a time, each trial in a thread."""

    def __init__(self, runners: Sequence[HorovodRunner],
                 run: Callable[[int, dict[str, Any], HorovodRunner], dict[str, Any]]) -> None:
        self._run = run
        self._free = list(runners)
        self._busy: dict[int, HorovodRunner] = {}
        self._futures: list[Future[dict[str, Any]]] = []
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(len(runners), thread_name_prefix="mlflow-hvd-trial")

    def start(self, tid: int, params: dict[str, Any],
              ended: Callable[[int, Outcome], None]) -> None:
        """Run trial ``tid`` on a free runner; ``ended`` gets its outcome (in its thread,
        once the runner is free again)."""
        with self._lock:
            if not self._free:
                raise RuntimeError(f"trial {tid} was suggested with every slot busy")
            runner = self._busy[tid] = self._free.pop()
        future = self._executor.submit(self._run, tid, params, runner)
        self._futures.append(future)
        future.add_done_callback(lambda f: self._done(tid, f, ended))

    def _done(self, tid: int, future: Future[dict[str, Any]],
              ended: Callable[[int, Outcome], None]) -> None:
        # a done callback: the future has ended, neither call waits
        outcome: Outcome = future.exception(timeout=0) or future.result(timeout=0)
        with self._lock:
            self._free.append(self._busy.pop(tid))
        ended(tid, outcome)

    def stop(self) -> None:
        """Stop every running trial (its runner's job ends as on Ctrl-C) and wait, within
        :data:`STOP_WAIT`, for their threads to end."""
        with self._lock:
            busy = sorted(self._busy.items())
        for tid, runner in busy:
            log.info("sweep: stopping trial %d", tid)
            runner.stop()
        deadline = time.monotonic() + STOP_WAIT
        for future in list(self._futures):
            with contextlib.suppress(BaseException):  # the trial's JobStopped, or its error
                future.exception(timeout=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)  # stop() waited, with a deadline
