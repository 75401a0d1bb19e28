"""Staging one job on a host: the payload file and the description of each rank's launch.

The same code serves the local backend (driver host) and Spark barrier tasks (executors),
so a rank starts the same way wherever it runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from mlflow_hvd.agent.process import WorkerLaunch
from mlflow_hvd.common import horovod_env, logs, scratch
from mlflow_hvd.common.layout import (
    HOST_VARIABLE,
    Devices,
    rank_env,
    torch_env,
    worker_command,
    worker_env,
)
from mlflow_hvd.protocol.job import JobSpec
from mlflow_hvd.protocol.messages import Bootstrap, RankSlot

PAYLOAD_FILE = "payload.pkl"


@contextmanager
def staged_payload(payload: bytes, kind: str = "job") -> Iterator[str]:
    """Write ``payload`` to a private (0600) file in a new scratch directory of this process
    (:mod:`mlflow_hvd.common.scratch`: removed on exit, or by the next job if we are killed);
    yields its path."""
    with scratch.owned_dir(kind) as tmp:
        path = os.path.join(tmp, PAYLOAD_FILE)
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(payload)
        yield path


def worker_launch(
    job: JobSpec,
    slots: Sequence[RankSlot],
    index: int,
    payload_path: str,
    *,
    driver_host: str,
    iface: str,
    cwd: str | None,
    python: str | None = None,
    host_name: str | None = None,
    devices: Devices | None = None,
    shards: str = "",
) -> WorkerLaunch:
    """How to start the worker of ``slots[index]`` (``slots``: every rank's): command,
    environment (Horovod's variables and torchrun's, :func:`~mlflow_hvd.common.layout.torch_env`)
    and bootstrap.

    ``driver_host`` is the address this host uses to reach the driver (its channel and
    horovod's rendezvous server); ``iface`` the network interface Gloo uses; ``host_name``
    the name this host goes by in messages (default: the slot's host, e.g. an address);
    ``devices`` the GPUs the rank sees and its task's own (None: ``CUDA_VISIBLE_DEVICES``
    left as it is); ``shards`` the path of the rank's manifest of DataFrame shards ("":
    the job has no DataFrame arguments).
    """
    slot = slots[index]
    host = host_name or slot.hostname
    rank_vars = rank_env(slot, driver_host, job.rendezvous_port, iface)
    rank_vars.update(torch_env(
        slot, slots, driver_host if job.torch_store else "", iface, os.environ,
        index if job.torch_nodes_are_tasks else None,
        os.path.join(os.path.dirname(payload_path), f"torch-error-rank{slot.rank}.json")))
    env = worker_env(os.environ, rank_vars, dict(job.horovod_env))
    # the timeline and autotune log go to the rank's scratch directory on this host
    env.update(horovod_env.rank_files(env, os.path.dirname(payload_path), slot.rank))
    env[HOST_VARIABLE] = host
    if devices is not None:
        env.update(devices.env())
    if job.log_level:
        env[logs.ENV] = job.log_level
    return WorkerLaunch(
        rank=slot.rank,
        host=host,
        command=tuple(worker_command(python)),
        env=env,
        bootstrap=Bootstrap(
            secret_hex=job.secret.hex(),
            driver_host=driver_host,
            driver_port=job.channel_port,
            payload_path=payload_path,
            parent_pid=os.getpid(),
            channel_timeout=job.channel_timeout,
            pooled=job.pooled,
            idle_timeout=job.idle_timeout,
            shards=shards,
            job_vars=dict(job.job_vars),
        ),
        cwd=cwd,
        max_line_bytes=job.max_line_bytes,
        stop_grace=job.stop_grace,
    )
