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
from typing import Any, Generic, TypeVar

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


class Running(Generic[T]):
    """``fn(*args, **kwargs)`` running in a daemon thread of its own, named ``what``, for a
    caller that waits for it with deadlines (:meth:`wait`) and may give up: a Python thread
    cannot be stopped, so a call given up on goes on until it returns, or until the process
    ends; callers say so where they give up. The one home of "a call with a deadline"."""

    def __init__(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> None:
        self.what = what
        self._value: T | None = None
        self.error: BaseException | None = None

        def target() -> None:
            try:
                self._value = fn(*args, **kwargs)
            except BaseException as exc:  # handed to the caller
                self.error = exc

        self._thread = threading.Thread(target=target, name=f"mlflow-hvd-{what}", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, seconds: float) -> bool:
        """Wait at most ``seconds`` (>= 0); whether the call has returned."""
        self._thread.join(max(0.0, seconds))
        return self.done

    def result(self) -> T:
        """The call's value, or its exception raised here (once :attr:`done`)."""
        if not self.done:
            raise DeadlineExceeded(f"{self.what} has not returned yet")
        if self.error is not None:
            raise self.error
        return self._value  # type: ignore[return-value]


def call_within(seconds: float, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Return ``fn(*args, **kwargs)``, or re-raise its exception, within ``seconds``.

    Raises:
        DeadlineExceeded: The call was still running at the deadline (``what`` names it;
            it goes on in its thread).
    """
    call = Running(f"call-{what}", fn, *args, **kwargs)
    if not call.wait(seconds):
        raise DeadlineExceeded(f"{what} did not return within {seconds:g}s")
    return call.result()
