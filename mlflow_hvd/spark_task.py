"""Executor side of the Spark backend: the body of one barrier task, hosting one rank.

Each task learns every task's host with ``BarrierTaskContext.allGather``, computes the
same Horovod layout as its peers (and reports it to the driver, which initialises the
rendezvous server before acknowledging), then runs its rank's worker process through the
agent and returns its exit code. It never raises for a worker failure, so Spark does not
retry the barrier stage: the driver decides and cancels the job.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from mlflow_hvd.agent import Bootstrap, WorkerLaunch, run_worker
from mlflow_hvd.channel import ChannelClient
from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.layout import assign_slots, rank_env, worker_command, worker_env
from mlflow_hvd.messages import LayoutReport


@dataclass(frozen=True)
class TaskSpec:
    """What every barrier task receives in its closure."""

    np: int
    payload: bytes = field(repr=False)
    secret: bytes = field(repr=False)
    driver_host: str
    channel_port: int
    rendezvous_port: int
    channel_timeout: float
    max_line_bytes: int
    stop_grace: float
    gloo_iface: str | None


def iface_towards(address: str) -> str:
    """Name of the local network interface whose address routes to ``address``.

    Raises:
        ConfigurationError: No interface holds the source address (set ``gloo_iface``).
    """
    import psutil

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((address, 9))  # UDP connect sends nothing; it only picks a route
        source = probe.getsockname()[0]
    finally:
        probe.close()
    if ipaddress.ip_address(source).is_loopback:
        return "lo"
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == source for a in addrs):
            return name
    raise ConfigurationError(
        f"no network interface holds {source}, the address that routes to the driver at "
        f"{address}; pass HorovodRunner(gloo_iface=...) with the interface Gloo should use"
    )


def barrier_task(spec: TaskSpec) -> Callable[[Iterable[int]], Iterator[int]]:
    """Build the function that ``mapPartitions`` runs in every barrier task."""

    def run_task(_: Iterable[int]) -> Iterator[int]:
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        partition = ctx.partitionId()
        hosts = ctx.allGather(socket.gethostname())
        slots = assign_slots(hosts)
        client = ChannelClient(
            spec.driver_host, spec.channel_port, spec.secret, spec.channel_timeout
        )
        try:
            client.send(LayoutReport(partition, ctx.attemptNumber(), slots))
            slot = slots[partition]
            iface = spec.gloo_iface or iface_towards(spec.driver_host)
            env = worker_env(
                os.environ, rank_env(slot, spec.driver_host, spec.rendezvous_port, iface)
            )
            with tempfile.TemporaryDirectory(prefix="mlflow-hvd-task-") as tmp:
                payload_path = os.path.join(tmp, "payload.pkl")
                with open(os.open(payload_path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                    f.write(spec.payload)
                launch = WorkerLaunch(
                    rank=slot.rank,
                    host=slot.hostname,
                    command=tuple(worker_command()),
                    env=env,
                    bootstrap=Bootstrap(
                        secret_hex=spec.secret.hex(),
                        driver_host=spec.driver_host,
                        driver_port=spec.channel_port,
                        payload_path=payload_path,
                        parent_pid=os.getpid(),
                        channel_timeout=spec.channel_timeout,
                    ),
                    cwd=None,
                    max_line_bytes=spec.max_line_bytes,
                    stop_grace=spec.stop_grace,
                )
                exited = run_worker(launch, client.send, threading.Event())
        finally:
            client.close()
        yield exited.exit_code

    return run_task
