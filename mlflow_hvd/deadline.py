"""Calls that may block on a remote service, given a deadline.

MLflow's HTTP client retries with backoff for minutes against a dead server; the driver must
never wait that long for bookkeeping. :func:`call_within` runs such a call in a daemon
thread and stops waiting at the deadline (the abandoned call ends on its own, or with the
process).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


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
