"""Start one worker process, stream its output to the driver, and report how it ended.

The same code runs inside a Spark barrier task (the sink sends over the channel) and in the
driver for local processes (the sink puts on the driver's queue).
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, cast

from mlflow_hvd.messages import Message, OutputLines, Stream, WorkerExited
from mlflow_hvd.procs import terminate_group

Sink = Callable[[Message], None]
_BATCH = 256
_EOF = object()


@dataclass(frozen=True)
class Bootstrap:
    """What a worker reads from its stdin at start (kept off the command line and env)."""

    secret_hex: str
    driver_host: str
    driver_port: int
    payload_path: str
    parent_pid: int
    channel_timeout: float

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @staticmethod
    def from_json(text: str) -> Bootstrap:
        return Bootstrap(**json.loads(text))


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


def read_line(stream: IO[bytes], limit: int) -> str | None:
    """Read one line of at most ``limit`` bytes; longer lines are cut with a marker.

    Returns None at end of stream. The rest of an overlong line is consumed and counted, never
    silently dropped.
    """
    raw = stream.readline(limit)
    if not raw:
        return None
    if raw.endswith(b"\n") or len(raw) < limit:
        return raw.rstrip(b"\r\n").decode("utf-8", errors="replace")
    dropped = 0
    while True:
        rest = stream.readline(limit)
        if not rest:
            break
        if rest.endswith(b"\n"):
            dropped += len(rest) - 1
            break
        dropped += len(rest)
    text = raw.decode("utf-8", errors="replace")
    return f"{text} ...[line truncated: {dropped} more bytes]" if dropped else text


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
    pumps = [
        threading.Thread(
            target=_pump,
            args=(stream, kind, lines, launch.max_line_bytes),
            name=f"mlflow-hvd-pump-{launch.rank}-{kind.value}",
            daemon=True,
        )
        for stream, kind in ((proc.stdout, Stream.STDOUT), (proc.stderr, Stream.STDERR))
    ]
    sender = threading.Thread(
        target=_send_batches, args=(lines, launch.rank, sink), daemon=True
    )
    for t in (*pumps, sender):
        t.start()
    stop_requested = threading.Event()
    finished = threading.Event()

    def watch_stop() -> None:
        # Kept apart from the wait below so that the exit time is taken the moment it happens.
        while not finished.is_set():
            if stop.wait(0.05):
                stop_requested.set()
                terminate_group(proc, launch.stop_grace)
                return

    watcher = threading.Thread(target=watch_stop, daemon=True)
    watcher.start()
    try:
        assert proc.stdin is not None
        try:
            proc.stdin.write((launch.bootstrap.to_json() + "\n").encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        proc.wait()
        ended = time.time()
    finally:
        finished.set()
        code = terminate_group(proc, launch.stop_grace)
        watcher.join(timeout=launch.stop_grace + 5)
        for p in pumps:
            p.join(timeout=10)
        lines.put(_EOF)
        sender.join(timeout=30)
    stopped = stop_requested.is_set() and code < 0  # ended by us, not by itself
    exited = WorkerExited(launch.rank, launch.host, code, ended, stopped)
    sink(exited)
    return exited


def _pump(stream: IO[bytes] | None, kind: Stream, out: queue.Queue[object], limit: int) -> None:
    if stream is None:
        return
    try:
        while (line := read_line(stream, limit)) is not None:
            out.put((kind, line))
    except (OSError, ValueError):
        pass


def _send_batches(lines: queue.Queue[object], rank: int, sink: Sink) -> None:
    """Forward lines in order, batching whatever has queued up while the last send ran."""
    done = False
    while not done:
        item = lines.get()
        batch = [item]
        while len(batch) < _BATCH:
            try:
                batch.append(lines.get_nowait())
            except queue.Empty:
                break
        group: list[str] = []
        current: Stream | None = None
        for entry in batch:
            if entry is _EOF:
                done = True
                break
            kind, text = cast(tuple[Stream, str], entry)
            if kind is not current and group and current is not None:
                _safe_sink(sink, OutputLines(rank, current, tuple(group)))
                group = []
            current = kind
            group.append(text)
        if group and current is not None:
            _safe_sink(sink, OutputLines(rank, current, tuple(group)))


def _safe_sink(sink: Sink, message: Message) -> None:
    # Output forwarding is best effort; the exit report is not.
    with contextlib.suppress(Exception):
        sink(message)
