"""Per-process scratch directories that never outlive their owner for long.

A directory is named ``mlflow-hvd-<kind>-<pid>-<start>-<random>`` in the temporary
directory, where ``<pid>``/``<start>`` identify the owning process (its start time guards
against pid reuse). The owner removes it when done; if the owner was killed (SIGKILL, a
lost Spark task), the next :func:`owned_dir` on the same host removes it, since it can see
the owner is gone. Directories are private (0700): payloads hold the user's function and
arguments.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

_NAME = re.compile(r"^mlflow-hvd-([a-z]+)-(\d+)-(\d+)-[0-9a-f]{8}$")


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _owner_alive(pid: int, start: int) -> bool:
    return _start_time(pid) == start


def remove_orphans(root: str | None = None) -> list[str]:
    """Remove scratch directories whose owning process is gone; returns their paths."""
    root = root or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            m = _NAME.match(name)
            if m is None or _owner_alive(int(m.group(2)), int(m.group(3))):
                continue
            path = os.path.join(root, name)
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.exists(path):
                removed.append(path)
    return removed


def new_dir(kind: str, root: str | None = None) -> str:
    """Create a private scratch directory owned by this process (after removing orphans)."""
    root = root or tempfile.gettempdir()
    remove_orphans(root)
    pid = os.getpid()
    start = _start_time(pid) or int(time.time())
    path = os.path.join(root, f"mlflow-hvd-{kind}-{pid}-{start}-{uuid.uuid4().hex[:8]}")
    os.mkdir(path, 0o700)
    return path


@contextmanager
def owned_dir(kind: str, root: str | None = None) -> Iterator[str]:
    """A scratch directory for the ``with`` block, removed on every exit path."""
    path = new_dir(kind, root)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
