"""Why Spark removed executors, kept for as long as the driver needs to say it.

When a standalone master gives up on an application (its executors fail to start, e.g. a
worker with no room to unpack the shipped environment) it removes it, and Spark stops the
driver's context in a thread of its own: the job that was running fails with only "Master
removed our application: FAILED", and the context's status store - the one place the
executors' removal reasons were - is closed at the end of that stop, a moment later. Read
after the failure, the reasons are there or not by the luck of that race (or not yet, if
the listener bus is behind). So a watch reads them while the context runs, and keeps them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from mlflow_hvd.backends.spark import private

log = logging.getLogger(__name__)

PERIOD = 0.2  # seconds between looks: after the executor that recorded why it failed, the
# master launches ten more that fail at once (spark.deploy.maxExecutorRetries) and removes
# the application, about a second later


class RemovalWatch:
    """The removal reasons of one SparkContext's executors, read every :data:`PERIOD`
    seconds by a daemon thread until the context stops (two JVM calls a look while nothing
    was removed), and on demand."""

    def __init__(self, sc: Any, period: float = PERIOD) -> None:
        self._sc = sc
        self._period = period
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[str, str]] = {}  # executor id -> (host, reason)
        self._counted = 0
        threading.Thread(target=self._loop, name="mlflow-hvd-removals", daemon=True).start()

    def removed(self) -> list[tuple[str, str]]:
        """(host, reason) of every executor Spark removed, oldest first: what the watch kept,
        with what the context says now if it still runs."""
        self._look()
        with self._lock:
            return list(self._seen.values())

    def _loop(self) -> None:
        while not private.context_stopped(self._sc):
            self._look()
            time.sleep(self._period)
        self._look()  # the last events, if the store is still open

    def _look(self) -> None:
        try:
            count = private.removed_executor_count(self._sc)
            if count == self._counted:
                return
            found = private.removed_executors(self._sc)
        except Exception:  # py4j's errors: the context or its JVM stopped; kept what was seen
            return
        with self._lock:
            for executor, host, reason in found:
                self._seen.setdefault(executor, (host, reason))
            self._counted = count


ATTRIBUTE = "_mlflow_hvd_removals"  # where a context keeps its watch (it lives as long)
_lock = threading.Lock()


def watch(sc: Any) -> RemovalWatch:
    """The watch of ``sc`` (a ``SparkContext``), started on the first call."""
    with _lock:
        found = getattr(sc, ATTRIBUTE, None)
        if found is None:
            found = RemovalWatch(sc)
            setattr(sc, ATTRIBUTE, found)
            log.debug("watching why Spark removes executors of %s", sc)
        return found
