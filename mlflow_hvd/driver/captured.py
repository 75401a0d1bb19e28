"""Driver side: DataFrames the job's code holds rather than receives as keywords (a
:mod:`mlflow_hvd.petastorm` converter in a training function's closure or globals), found
while the code is pickled: each such object, when pickled, hands its DataFrame here under
its own argument name, and the runner feeds it to the ranks with the keyword DataFrames."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_local = threading.local()  # each run pickles its code in its own thread (a sweep's slots)


@contextlib.contextmanager
def capturing() -> Iterator[dict[str, Any]]:
    """Collects, while open, what :func:`capture` is handed in this thread:
    argument -> DataFrame, in the order first handed."""
    found: dict[str, Any] = {}
    outer = getattr(_local, "found", None)
    _local.found = found
    try:
        yield found
    finally:
        _local.found = outer


def capture(argument: str, frame: Any) -> bool:
    """Hand ``frame`` to the run whose code is being pickled in this thread; False when no
    run is pickling (the object is pickled for some other purpose)."""
    found = getattr(_local, "found", None)
    if found is None:
        return False
    found.setdefault(argument, frame)
    return True
