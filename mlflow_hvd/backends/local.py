"""Local backend: ``np < 0`` runs |np| worker processes on the driver machine."""

from __future__ import annotations

import os
import tempfile
import threading

from mlflow_hvd.agent import Bootstrap, Sink, WorkerLaunch, run_worker
from mlflow_hvd.backends.base import JobSpec
from mlflow_hvd.layout import assign_slots, rank_env, worker_command, worker_env
from mlflow_hvd.messages import LayoutReport

LOCAL_HOST = "localhost"


class LocalBackend:
    """Runs every rank as a child process of the driver, one agent thread per rank.

    Workers talk to the driver and to each other over loopback (Gloo on ``lo``).
    """

    name = "local"

    def __init__(self, python: str | None = None) -> None:
        self._python = python
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._payload_dir: tempfile.TemporaryDirectory[str] | None = None

    def start(self, job: JobSpec, sink: Sink) -> None:
        slots = assign_slots([LOCAL_HOST] * job.np)
        sink(LayoutReport(partition=0, attempt=0, slots=slots))
        self._payload_dir = tempfile.TemporaryDirectory(prefix="mlflow-hvd-")
        payload_path = os.path.join(self._payload_dir.name, "payload.pkl")
        with open(os.open(payload_path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(job.payload)
        boot = Bootstrap(
            secret_hex=job.secret.hex(),
            driver_host="127.0.0.1",
            driver_port=job.channel_port,
            payload_path=payload_path,
            parent_pid=os.getpid(),
            channel_timeout=job.channel_timeout,
        )
        for slot in slots:
            env = worker_env(
                os.environ,
                rank_env(slot, "127.0.0.1", job.rendezvous_port, job.gloo_iface or "lo"),
            )
            launch = WorkerLaunch(
                rank=slot.rank,
                host=LOCAL_HOST,
                command=tuple(worker_command(self._python)),
                env=env,
                bootstrap=boot,
                cwd=os.getcwd(),
                max_line_bytes=job.max_line_bytes,
                stop_grace=job.stop_grace,
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
        import time

        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def close(self) -> None:
        if not self.wait(5.0):
            self.stop()
            self.wait(30.0)
        if self._payload_dir is not None:
            self._payload_dir.cleanup()
            self._payload_dir = None

    def describe(self) -> dict[str, str]:
        return {"backend": self.name}
