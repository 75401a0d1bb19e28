"""Reading a worker's output streams and forwarding them as ordered, batched messages."""

from __future__ import annotations

import queue
import sys
from collections.abc import Callable
from typing import IO, cast

from mlflow_hvd.protocol.messages import JOB_END_MARK, Message, OutputLines, Sink, Stream

_BATCH = 256
EOF = object()
JOB_END = object()  # the pump's stand-in for a JOB_END_MARK line
_PIPED = (Stream.STDOUT, Stream.STDERR)


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


def pump(stream: IO[bytes] | None, kind: Stream, out: queue.Queue[object], limit: int) -> None:
    if stream is None:
        return
    try:
        while (line := read_line(stream, limit)) is not None:
            out.put((kind, JOB_END if line == JOB_END_MARK else line))
    except (OSError, ValueError) as exc:  # the pipe was closed under us (the agent stops)
        sys.stderr.write(f"mlflow_hvd: stopped reading the worker's {kind.value}: {exc}\n")


def send_batches(
    lines: queue.Queue[object],
    rank: int,
    sink: Sink,
    job_end: Callable[[], Message] | None = None,
) -> None:
    """Forward lines in order, batching whatever has queued up while the last send ran.

    A pooled worker ends each job with :data:`JOB_END_MARK` on both streams; once both are
    read, every line of that job has been forwarded and ``job_end()`` is sunk."""
    done = False
    ended: set[Stream] = set()
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
            if entry is EOF:
                done = True
                break
            kind, text = cast(tuple[Stream, str], entry)
            if text is JOB_END:
                ended.add(kind)
                if len(ended) == len(_PIPED) and job_end is not None:
                    if group and current is not None:
                        _safe_sink(sink, OutputLines(rank, current, tuple(group)))
                    group, current = [], None
                    ended.clear()
                    _safe_sink(sink, job_end())
                continue
            if kind is not current and group and current is not None:
                _safe_sink(sink, OutputLines(rank, current, tuple(group)))
                group = []
            current = kind
            group.append(text)
        if group and current is not None:
            _safe_sink(sink, OutputLines(rank, current, tuple(group)))


def _safe_sink(sink: Sink, message: Message) -> None:
    """Forward output; if the driver cannot take it, say on this host's stderr (the
    executor's log) how many lines were lost, and keep going: the exit report matters more."""
    try:
        sink(message)
    except Exception as exc:
        if isinstance(message, OutputLines):
            sys.stderr.write(
                f"mlflow_hvd: {len(message.lines)} {message.stream.value} lines of rank "
                f"{message.rank} not delivered to the driver: {exc}\n"
            )
