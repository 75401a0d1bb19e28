"""What a worker process knows about its run: the driver channel and its rank.

Set once by :mod:`mlflow_hvd.rank.worker` at start; read by :func:`log_to_driver` and the tracking
API. Outside a worker (e.g. code run directly on the driver) nothing is installed and the
functions fall back to local behaviour.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from mlflow_hvd.protocol.channel import ChannelClient
from mlflow_hvd.protocol.messages import OutputLines, Stream

_lock = threading.Lock()
_client: ChannelClient | None = None
_rank: int = 0
_attempt: int = 0


def install(client: ChannelClient, rank: int, attempt: int = 0) -> None:
    """Called by the worker entry point before the user's function runs."""
    global _client, _rank, _attempt
    with _lock:
        _client, _rank, _attempt = client, rank, attempt


def connector() -> Callable[[], ChannelClient] | None:
    """What opens another connection to the driver, for a thread whose requests must
    neither wait behind nor hold up the worker's own messages; None outside a worker."""
    client = _client
    return None if client is None else client.another


def driver_gone() -> bool:
    """Whether the driver closed the worker's connection (False outside a worker): a wait
    the driver bounds ends by itself when the driver is gone."""
    client = _client
    return client is not None and client.driver_gone()


def attempt() -> int:
    """Which run of the job this is: 0 the first, k after k restarts
    (``HorovodRunner(job=JobConfig(max_failures=...))``). 0 outside a worker."""
    return _attempt


def log_to_driver(message: str) -> None:
    """Send ``message`` to the driver, which prints it prefixed with this rank.

    Shown with both ``driver_log_verbosity`` settings (this is what ``"log_callback_only"``
    shows). Outside a HorovodRunner worker it prints to stdout. Blocks until the driver has
    received it; keep it for progress messages, not per-step firehoses.
    """
    client = _client
    if client is None:
        print(message, flush=True)
        return
    client.send(OutputLines(_rank, Stream.LOG, (str(message),)))


__all__ = ["attempt", "install", "log_to_driver"]
