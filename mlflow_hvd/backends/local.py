"""Local backend: ``np < 0`` runs |np| worker processes on the driver machine."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

from mlflow_hvd.agent import WorkerLaunch, run_worker, staged_payload, worker_launch
from mlflow_hvd.backends.base import Backend, FrameSource
from mlflow_hvd.backends.local_feed import feed_locally
from mlflow_hvd.common.config import JobConfig
from mlflow_hvd.common.layout import assign_slots
from mlflow_hvd.common.phases import Phase, Progress, in_phase
from mlflow_hvd.protocol.job import JobSpec
from mlflow_hvd.protocol.messages import LayoutReport, Sink

LOCAL_HOST = "localhost"
LOOPBACK = "127.0.0.1"


class LocalBackend:
    """Runs every rank as a child process of the driver, one agent thread per rank.

    Workers talk to the driver and to each other over loopback (Gloo on ``lo``). A job's
    DataFrames are written for the ranks first (:data:`~mlflow_hvd.common.phases.Phase`
    ``FEEDING``: ``feed_timeout`` seconds without progress at most, ended by ``stop``).
    """

    name = "local"

    def __init__(self, python: str | None = None, frame: Any = None,
                 stop: threading.Event | None = None, feed_timeout: float | None = None
                 ) -> None:
        self._python = python
        self._frame = frame  # the job's DataFrames in |np| partitions (None: no data)
        self._asked_to_stop = stop  # the runner's stop request
        self._feed_timeout = feed_timeout
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._staging = contextlib.ExitStack()

    def start(self, job: JobSpec, sink: Sink) -> None:
        shards = [""] * job.np
        if job.feed is not None and self._frame is not None:
            progress = Progress()
            shards, split = in_phase(Phase.FEEDING, feed_locally, job.feed, self._frame,
                                     job.np, self._staging, progress, progress=progress,
                                     limit=self._feed_timeout, option="start_timeout",
                                     stop=self._asked_to_stop)
            sink(split)
        slots = assign_slots([LOCAL_HOST] * job.np)
        sink(LayoutReport(partition=0, slots=slots))
        payload_path = self._staging.enter_context(staged_payload(job.payload))
        for index, slot in enumerate(slots):
            launch = worker_launch(
                job,
                slots,
                index,
                payload_path,
                driver_host=LOOPBACK,
                iface=job.gloo_iface or "lo",
                cwd=os.getcwd(),
                python=self._python,
                shards=shards[slot.rank],
            )
            t = threading.Thread(
                target=self._run_rank,
                args=(launch, sink),
                name=f"mlflow-hvd-local-rank-{slot.rank}",
                daemon=True,
            )
            self._threads.append(t)
            t.start()

    def _run_rank(self, launch: WorkerLaunch, sink: Sink) -> None:
        # The worker's parent-death signal is tied to this thread, which outlives it.
        run_worker(launch, sink, self._stop)

    def stop(self) -> None:
        self._stop.set()

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def close(self) -> None:
        if not self.wait(5.0):
            self.stop()
            self.wait(30.0)
        self._staging.close()

    def describe(self) -> dict[str, str]:
        return {"backend": self.name}


class LocalPlacement:
    """``np < 0``: every generation is ``|np|`` processes on the driver (``job``: the
    runner's options, ``start_timeout`` bounding the feed of DataFrames; ``stop``: the
    runner's stop request)."""

    def __init__(self, np: int, job: JobConfig | None = None,
                 stop: threading.Event | None = None) -> None:
        self.np, self.stop = np, stop
        self.start_timeout = job.start_timeout if job is not None else None

    def new_run(self) -> None:
        pass

    def prepare(self) -> None:
        pass

    def describe(self) -> dict[str, str]:
        return {"backend": LocalBackend.name}

    def task_slots(self) -> tuple[int, str]:
        return os.cpu_count() or 1, "the driver"

    def elastic_size(self, least: int) -> int:
        return self.np  # the driver's processes lose no host (the runner refuses min_np)

    def slots_back(self, running: int) -> bool:
        return True

    def backend(self, feed: FrameSource | None, np: int) -> tuple[Backend, str]:
        frame = feed.fed_frame(np) if feed is not None else None
        return (LocalBackend(frame=frame, stop=self.stop, feed_timeout=self.start_timeout),
                "127.0.0.1")
