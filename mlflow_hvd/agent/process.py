"""Start one worker process, stream its output to the driver, and report how it ended.

The same code runs inside a Spark barrier task (the sink sends over the channel) and in the
driver for local processes (the sink puts on the driver's queue).
"""

from __future__ import annotations

import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from mlflow_hvd.agent.output import EOF, pump, send_batches
from mlflow_hvd.common.procs import signal_group, terminate_group
from mlflow_hvd.protocol.messages import Bootstrap, JobEnded, Sink, Stream, WorkerExited

STOP_POLL = 0.05  # seconds between checks of the stop request while the worker runs
KILL_WAIT = 5.0  # seconds for a SIGKILLed group to be gone
PUMP_JOIN = 10.0  # seconds for the output pumps to read what the worker left in its pipes
SENDER_JOIN = 30.0  # seconds for the last output batches to reach the driver


@dataclass(frozen=True)
class WorkerLaunch:
    """Everything needed to start the worker of one rank."""

    rank: int
    host: str
    command: tuple[str, ...]
    env: Mapping[str, str]
    bootstrap: Bootstrap
    max_line_bytes: int
    stop_grace: float
    cwd: str | None = None
    pass_fds: tuple[int, ...] = ()  # descriptors the worker inherits (and never uses)


def run_worker(launch: WorkerLaunch, sink: Sink, stop: threading.Event) -> WorkerExited:
    """Run the worker of ``launch.rank`` to completion and return (and sink) its exit.

    All its output is sunk before the :class:`WorkerExited` message. The wait for the worker
    ends when it exits, or, once ``stop`` is set, when it has been stopped: SIGTERM to its
    process group, SIGKILL after ``stop_grace`` seconds (the job's deadlines are the
    driver's, which sets ``stop``). On return no process of the worker's group is left.
    """
    proc = subprocess.Popen(
        list(launch.command),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(launch.env),
        cwd=launch.cwd,
        start_new_session=True,
        pass_fds=launch.pass_fds,
    )
    lines: queue.Queue[object] = queue.Queue()
    threads = _start_output_threads(proc, launch, lines, sink)
    stopped = False
    try:
        _write_bootstrap(proc, launch.bootstrap)
        ended, stopped = _wait(proc, stop, launch.stop_grace)
    finally:
        code = terminate_group(proc, launch.stop_grace)
        *pumps, sender = threads
        for p in pumps:
            p.join(timeout=PUMP_JOIN)
        lines.put(EOF)
        sender.join(timeout=SENDER_JOIN)
        for thread in threads:
            if thread.is_alive():
                sys.stderr.write(f"mlflow_hvd: {thread.name} of rank {launch.rank} still "
                                 "running after the worker ended; its last output may be "
                                 "missing\n")
    exited = WorkerExited(launch.rank, launch.host, code, ended, stopped and code < 0)
    sink(exited)
    return exited


def _wait(proc: subprocess.Popen[bytes], stop: threading.Event, grace: float) -> tuple[float,
                                                                                        bool]:
    """Wait until the worker exits; returns (its exit time, whether ``stop`` ended it).

    The exit time is taken the moment the process ends (a pidfd becomes readable), not at
    the next poll: the driver orders failures by it. Once ``stop`` is set the worker gets
    SIGTERM and, ``grace`` seconds later, its group SIGKILL, so the wait is bounded by the
    stop plus ``grace`` and :data:`KILL_WAIT`.
    """
    exits = _ExitWatch(proc)
    try:
        while not exits.wait(STOP_POLL):
            if stop.is_set():
                signal_group(proc, signal.SIGTERM)
                if not exits.wait(grace):
                    signal_group(proc, signal.SIGKILL)
                    exits.wait(KILL_WAIT)
                return time.time(), True
        return time.time(), False
    finally:
        exits.close()


class _ExitWatch:
    """Waits for a child's exit without reaping it (``Popen`` reaps it), through a pidfd
    where Linux has one, else by polling."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc
        try:
            self._fd: int | None = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # not Linux >= 5.3: poll instead
            self._fd = None

    def wait(self, seconds: float) -> bool:
        """True once the process has exited; waits at most ``seconds``."""
        if self._fd is None:
            try:
                self._proc.wait(timeout=seconds)
            except subprocess.TimeoutExpired:
                return False
            return True
        ready, _, _ = select.select([self._fd], [], [], seconds)
        return bool(ready)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _start_output_threads(
    proc: subprocess.Popen[bytes], launch: WorkerLaunch, lines: queue.Queue[object], sink: Sink
) -> list[threading.Thread]:
    """One pump thread per output stream, then the sender thread (last in the list)."""
    threads = [
        threading.Thread(
            target=pump,
            args=(stream, kind, lines, launch.max_line_bytes),
            name=f"mlflow-hvd-pump-{launch.rank}-{kind.value}",
            daemon=True,
        )
        for stream, kind in ((proc.stdout, Stream.STDOUT), (proc.stderr, Stream.STDERR))
    ]
    def job_end() -> JobEnded:  # a pooled worker finished one job (and stays up)
        return JobEnded(launch.rank, launch.host, time.time())

    threads.append(
        threading.Thread(
            target=send_batches, args=(lines, launch.rank, sink, job_end),
            name=f"mlflow-hvd-output-{launch.rank}", daemon=True,
        )
    )
    for t in threads:
        t.start()
    return threads


def _write_bootstrap(proc: subprocess.Popen[bytes], boot: Bootstrap) -> None:
    if proc.stdin is None:
        return
    try:
        proc.stdin.write((boot.to_json() + "\n").encode())
        proc.stdin.close()
    except BrokenPipeError:  # the worker died at once; its exit report tells why
        sys.stderr.write("mlflow_hvd: a worker exited before reading its bootstrap\n")
