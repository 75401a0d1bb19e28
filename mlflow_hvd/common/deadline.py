"""Deadlines: every wait in mlflow_hvd has one.

:class:`Deadline` is a point in monotonic time with the budget it was made from, so that a
wait can ask what is left and its error can say how long it waited. :func:`call_within`
gives a deadline to a call that may block on a remote service: MLflow's HTTP client retries
with backoff for minutes against a dead server, and the driver must never wait that long
for bookkeeping; the call runs in a daemon thread and the caller stops waiting at the
deadline (the abandoned call ends on its own, or with the process).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Deadline:
    """A monotonic point in time by which a wait must end.

    Attributes:
        seconds: The budget it was made from (``math.inf``: no limit, for a wait that the
            user chose to leave open, e.g. ``HorovodRunner(job=JobConfig(timeout=None))``).
        at: ``time.monotonic()`` value at which it passes.
    """

    seconds: float
    at: float

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        """A deadline ``seconds`` from now (None: never)."""
        budget = math.inf if seconds is None else float(seconds)
        return cls(budget, time.monotonic() + budget)

    def remaining(self) -> float:
        """Seconds left, never negative (``math.inf`` for no limit)."""
        return max(0.0, self.at - time.monotonic())

    def passed(self) -> bool:
        return time.monotonic() >= self.at

    def slice(self, most: float) -> float:
        """Seconds to wait now: what is left, but at most ``most`` (to re-check state)."""
        return min(most, self.remaining())


class DeadlineExceeded(TimeoutError):
    """The call did not return within its deadline; it may still complete later."""


def call_within(seconds: float, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Return ``fn(*args, **kwargs)``, or re-raise its exception, within ``seconds``.

    Raises:
        DeadlineExceeded: The call was still running at the deadline (``what`` names it).
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"mlflow-hvd-call-{what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise DeadlineExceeded(f"{what} did not return within {seconds:g}s")
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value
