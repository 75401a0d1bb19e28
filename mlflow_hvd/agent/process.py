"""Start one worker process, stream its output to the driver, and report how it ended.

The same code runs inside a Spark barrier task (the sink sends over the channel) and in the
driver for local processes (the sink puts on the driver's queue).
"""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from mlflow_hvd.agent.output import EOF, pump, send_batches
from mlflow_hvd.messages import Bootstrap, Sink, Stream, WorkerExited
from mlflow_hvd.procs import terminate_group


@dataclass(frozen=True)
class WorkerLaunch:
    """Everything needed to start the worker of one rank."""

    rank: int
    host: str
    command: tuple[str, ...]
    env: Mapping[str, str]
    bootstrap: Bootstrap
    cwd: str | None = None
    max_line_bytes: int = 16384
    stop_grace: float = 5.0


def run_worker(launch: WorkerLaunch, sink: Sink, stop: threading.Event) -> WorkerExited:
    """Run the worker of ``launch.rank`` to completion and return (and sink) its exit.

    All its output is sunk before the :class:`WorkerExited` message. If ``stop`` is set,
    the worker's process group gets SIGTERM, then SIGKILL after ``stop_grace`` seconds. On
    return no process of the worker's group is left.
    """
    proc = subprocess.Popen(
        list(launch.command),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(launch.env),
        cwd=launch.cwd,
        start_new_session=True,
    )
    lines: queue.Queue[object] = queue.Queue()
    relays = _start_relays(proc, launch, lines, sink)
    finished, stop_requested = threading.Event(), threading.Event()
    watcher = threading.Thread(
        target=_stop_on_request,
        args=(proc, launch.stop_grace, stop, finished, stop_requested),
        daemon=True,
    )
    watcher.start()
    try:
        _write_bootstrap(proc, launch.bootstrap)
        proc.wait()
        ended = time.time()
    finally:
        finished.set()
        code = terminate_group(proc, launch.stop_grace)
        if stop.is_set():  # the watcher may be stopping the worker: let it finish
            watcher.join(timeout=launch.stop_grace + 5)
        # else it leaves at its next poll, without acting: no need to wait up to 50 ms
        *pumps, sender = relays
        for p in pumps:
            p.join(timeout=10)
        lines.put(EOF)
        sender.join(timeout=30)
    stopped = stop_requested.is_set() and code < 0  # ended by us, not by itself
    exited = WorkerExited(launch.rank, launch.host, code, ended, stopped)
    sink(exited)
    return exited


def _start_relays(
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
    def job_end() -> WorkerExited:  # a pooled worker finished one job (and stays up)
        return WorkerExited(launch.rank, launch.host, 0, time.time())

    threads.append(
        threading.Thread(
            target=send_batches, args=(lines, launch.rank, sink, job_end), daemon=True
        )
    )
    for t in threads:
        t.start()
    return threads


def _stop_on_request(
    proc: subprocess.Popen[bytes],
    grace: float,
    stop: threading.Event,
    finished: threading.Event,
    stop_requested: threading.Event,
) -> None:
    # Kept apart from proc.wait() so that the exit time is taken the moment it happens.
    while not finished.is_set():
        if stop.wait(0.05):
            stop_requested.set()
            terminate_group(proc, grace)
            return


def _write_bootstrap(proc: subprocess.Popen[bytes], boot: Bootstrap) -> None:
    if proc.stdin is None:
        return
    try:
        proc.stdin.write((boot.to_json() + "\n").encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass  # the worker died at once; its exit status tells why
