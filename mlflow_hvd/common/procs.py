"""Process-tree helpers: parent-death signal and structured termination."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent thread exits.

    Returns False where unsupported (non-Linux); callers keep a polling watchdog as well.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def terminate_group(proc: subprocess.Popen[bytes], grace: float = 5.0) -> int:
    """End ``proc`` and its process group: SIGTERM, up to ``grace`` seconds, then SIGKILL.

    ``proc`` must have been started with ``start_new_session=True`` so that its process group
    holds exactly its own tree. Returns the exit status (negative for a signal).
    """
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    # Grandchildren may outlive the leader; the group is killed either way.
    _signal_group(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + max(grace, 1.0)
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    code = proc.poll()
    return code if code is not None else -signal.SIGKILL


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Send ``sig`` to ``proc``'s process group (see :func:`terminate_group`); a group that is
    already gone is fine."""
    _signal_group(proc.pid, sig)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
