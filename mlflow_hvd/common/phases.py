"""The phases of an attempt before its ranks run, and the one way each is waited for.

An attempt goes ``PACKING -> BOOTING -> WAITING_FOR_SLOTS -> SHIPPING -> FEEDING`` (each
only where it applies: packing and shipping with ``ship_environment``, booting with no
session yet, feeding with DataFrame arguments on the driver's own processes), then the
supervisor's states (:class:`mlflow_hvd.driver.supervisor.JobState`, from ``RUNNING``).
Every phase is entered and left in the lifecycle log (``mlflow_hvd.driver.supervisor``, with
its seconds), has a deadline named in its error (the option that sets it), and ends at once
with :class:`~mlflow_hvd.errors.JobStopped` when the runner is asked to stop
(``HorovodRunner.stop()``; SIGINT and SIGTERM reach the waiting thread, which waits in
slices).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from mlflow_hvd.common.deadline import Running
from mlflow_hvd.errors import BackendError, JobStopped

T = TypeVar("T")

log = logging.getLogger("mlflow_hvd.driver.supervisor")  # the lifecycle log

STOP_LOOK = 0.1  # seconds between looks at the stop request while a phase runs


class Phase(enum.Enum):
    """A start phase of an attempt; its value says what the driver is doing."""

    PACKING = "packing the environment for the executors"
    BOOTING = "starting the SparkSession"
    WAITING_FOR_SLOTS = "waiting for task slots"
    SHIPPING = "shipping the environment to the executors"
    FEEDING = "writing the DataFrames for the ranks"


class Progress:
    """When a phase's work last moved (:meth:`tick` it as it does), for a deadline that
    counts from its latest progress (``in_phase(progress=...)``)."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def tick(self) -> None:
        self.last = time.monotonic()

    def __call__(self) -> float:
        return self.last


class PhaseTimeout(BackendError):
    """A start phase did not end within its deadline."""


def refuse_stopped(stop: threading.Event | None, phase: Phase, doing: str = "") -> None:
    """Raise :class:`JobStopped` when the runner was asked to stop (``stop`` set) while in
    ``phase`` (``doing``: what exactly, when the phase's name says too little)."""
    if stop is not None and stop.is_set():
        raise JobStopped(f"stopped while {doing or phase.value} (HorovodRunner.stop)")


def in_phase(phase: Phase, fn: Callable[..., T], *args: Any, limit: float | None,
             option: str, stop: threading.Event | None,
             progress: Callable[[], float] | None = None, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` as ``phase``: run in a thread of its own and waited for in
    slices, so that a stop request or a signal ends the wait at once.

    Args:
        limit: Seconds the phase may take (None: no limit, the user's choice); with
            ``progress``, seconds without progress.
        option: The option that sets ``limit``, named in the timeout's error.
        stop: The runner's stop request.
        progress: The ``time.monotonic()`` of the call's latest progress (None: the
            deadline counts from the phase's start).

    Raises:
        JobStopped: ``stop`` was set (the call is abandoned: it ends on its own).
        PhaseTimeout: ``limit`` passed (abandoned likewise).
        Exception: Whatever ``fn`` raised.
    """
    refuse_stopped(stop, phase)
    started = time.monotonic()
    log.info("phase: %s", phase.value)
    call: Running[T] = Running(phase.name.lower(), fn, *args, **kwargs)
    while not call.wait(STOP_LOOK):
        refuse_stopped(stop, phase,
                       f"{phase.value}, after {time.monotonic() - started:.1f}s")
        since = progress() if progress is not None else started
        if limit is not None and time.monotonic() - since > limit:
            raise PhaseTimeout(
                f"{phase.value} did not end within {limit:g}s ({option}"
                f"{', without progress' if progress is not None else ''}); raise {option} "
                "if it needs longer")
    log.info("phase: %s ended in %.1fs", phase.value, time.monotonic() - started)
    return call.result()
