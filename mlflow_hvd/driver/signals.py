"""SIGTERM on the driver unwinds a job like Ctrl-C does.

A scheduler, ``kill`` or a container stop sends SIGTERM; Python's default is to die at once,
leaving the MLflow run RUNNING and the Spark job to time out. While a job runs, SIGTERM
instead raises :class:`~mlflow_hvd.errors.Terminated` (a ``KeyboardInterrupt``) in the main
thread, so every ``finally`` runs: ranks stopped, Spark job group cancelled, run ended KILLED.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from mlflow_hvd.errors import Terminated


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(f"the driver received signal {signal.Signals(signum).name}")


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While active (main thread only; elsewhere a no-op), SIGTERM raises ``Terminated``.

    The previous handler is restored on exit. A handler the application installed itself
    (anything but the default) is left alone: the application decides what SIGTERM means.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous not in (signal.SIG_DFL, None):
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
