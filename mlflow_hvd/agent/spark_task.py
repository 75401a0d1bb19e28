"""Executor side of the Spark backend: the body of one barrier task, hosting one rank.

Each task learns every task's executor address from ``BarrierTaskContext.getTaskInfos``,
computes the same Horovod layout as its peers (and reports it to the driver, which initialises the
rendezvous server before acknowledging), then runs its rank's worker process through the
agent and returns its exit code. It never raises for a worker failure, so Spark does not
retry the barrier stage: the driver decides and cancels the job.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from mlflow_hvd.agent import run_worker, staged_payload, worker_launch
from mlflow_hvd.agent.host_check import environment_differences
from mlflow_hvd.agent.task_feed import TaskFeeding, task_feeding
from mlflow_hvd.common import logs
from mlflow_hvd.common.layout import Devices, assign_slots, visible_devices
from mlflow_hvd.common.network import route_source
from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.protocol.channel import ChannelClient
from mlflow_hvd.protocol.job import JobSpec
from mlflow_hvd.protocol.messages import EnvironmentMismatch, Launch, LayoutReport, RankSlot

log = logging.getLogger(__name__)

EXIT_NOT_LAUNCHED = 75  # the task's result when the driver let it start no worker
STOP_MARGIN = 10.0  # seconds past stop_grace for a stopped rank's output to be relayed


def iface_towards(address: str) -> str:
    """Name of the local network interface whose address routes to ``address``.

    Raises:
        ConfigurationError: No interface holds the source address (set ``gloo_iface``).
    """
    import psutil

    source = route_source(address)
    if ipaddress.ip_address(source).is_loopback:
        return "lo"
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == source for a in addrs):
            return name
    raise ConfigurationError(
        f"no network interface holds {source}, the address that routes to the driver at "
        f"{address}; pass HorovodRunner(cluster=ClusterConfig(gloo_iface=...)) with the "
        f"interface Gloo should use"
    )


def _devices(ctx: Any, resource: str, slots: Sequence[RankSlot],
             partition: int) -> Devices | None:
    """The addresses of ``resource`` (GPUs) this task's rank sees, or None when Spark
    assigned the stage none. Every task of the stage has the same resource profile, so all
    or none take part in the exchange (an ``allGather``: about a second, GPU jobs only)."""
    info = ctx.resources().get(resource)
    if info is None:
        return None
    mine = [str(a) for a in info.addresses]
    every = [json.loads(m) for m in ctx.allGather(json.dumps(mine))]  # in partition order
    return visible_devices(slots, every, partition)


RESULT_SCHEMA = "exit_code int"  # what each barrier task returns: its rank's exit code


def barrier_task(job: JobSpec) -> Callable[[Iterable[Any]], Iterator[Any]]:
    """Build the function that ``mapInArrow(..., barrier=True)`` runs in every barrier task:
    it takes the task's partition as Arrow record batches (the job's data, if any) and
    yields one batch holding the exit code of the task's rank (``RESULT_SCHEMA``)."""

    def run_task(batches: Iterable[Any]) -> Iterator[Any]:
        import pyarrow as pa

        yield _exit_code_batch(pa, _task(job, batches))

    return run_task


def barrier_partition_task(job: JobSpec) -> Callable[[Iterable[Any]], Iterator[int]]:
    """The same task for an RDD barrier stage (``sc.parallelize(range(np), np).barrier()
    .mapPartitions``), which a job without data runs on a classic session: it yields the
    exit code of the task's rank. Its partition's one number is not read."""

    def run_task(rows: Iterable[Any]) -> Iterator[int]:
        del rows
        yield _task(job, ())

    return run_task


def _task(job: JobSpec, batches: Iterable[Any]) -> int:
    """The barrier task's work: check the host, feed the job's data (``batches``) and run
    the task's rank; returns the rank's exit code (``EXIT_NOT_LAUNCHED`` when none ran)."""
    from pyspark import BarrierTaskContext

    if job.log_level:  # the driver's lifecycle log level: into the executor's stderr
        logs.enable(job.log_level)
    ctx = BarrierTaskContext.get()
    partition = ctx.partitionId()
    # every task's executor address, known to each task without a round trip (an
    # allGather costs about a second: it polls every second)
    slots = assign_slots([info.address.rsplit(":", 1)[0] for info in ctx.getTaskInfos()])
    client = ChannelClient(job.driver_host, job.channel_port, job.secret, job.channel_timeout)
    try:
        differences = environment_differences(job.environment)
        if differences:  # the driver fails the job on the first of these
            client.send(EnvironmentMismatch(partition, socket.gethostname(), differences))
            return EXIT_NOT_LAUNCHED
        with task_feeding(job.feed, ctx, batches, client.send) as feed:
            return _report_and_run(job, ctx, client, slots, partition, feed)
    finally:
        client.close()


def _exit_code_batch(pa: Any, code: int) -> Any:
    """The task's one-row result, built from a buffer: ``pa.array()`` and ``from_pydict()``
    import pandas on first use (pyarrow checks for pandas objects), a cost every Spark
    Python worker of the stage would pay before its rank starts."""
    values = pa.py_buffer(struct.pack("<i", code))
    return pa.RecordBatch.from_arrays(
        [pa.Array.from_buffers(pa.int32(), 1, [None, values])], names=["exit_code"])


def _report_and_run(job: JobSpec, ctx: Any, client: ChannelClient,
                    slots: Sequence[RankSlot], partition: int, feed: TaskFeeding) -> int:
    """Report this task's layout and, once the driver says so, start its rank while the
    task feeds its partition: the rank's start (its imports, Horovod's rendezvous) overlaps
    the feed, and the rank waits for its shard on first use. Returns the rank's exit code.

    The task always feeds (the other tasks wait for its counts in ``allGather``). When the
    feed fails, every task has told the driver, which ends the job; the rank, waiting for
    its shard or done, exits without an error of its own.
    """
    devices = _devices(ctx, job.gpu_resource, slots, partition)
    answer = client.request(LayoutReport(partition, tuple(slots)), job.channel_timeout)
    if not isinstance(answer, Launch):  # the job failed before this task reported
        log.info("job %s: task %d starts no worker: the job is being stopped", job.job_id,
                 partition)
        feed.run()
        return EXIT_NOT_LAUNCHED
    stop = threading.Event()
    codes: list[int] = []
    rank = threading.Thread(
        target=lambda: codes.append(_run_rank(job, client, slots, partition, devices,
                                              feed.manifest, stop)),
        name="mlflow-hvd-rank", daemon=True)
    rank.start()
    try:
        feed.run()
    except BaseException:
        stop.set()  # the task fails: its rank must not outlive it (SIGTERM, then SIGKILL)
        rank.join(job.stop_grace + STOP_MARGIN)
        raise
    # the rank's lifetime, as when the task ran it in this thread: the driver's deadlines
    # bound it (it stops the job, Spark kills this task and the rank with it)
    rank.join()
    return codes[0] if codes else EXIT_NOT_LAUNCHED


def _run_rank(job: JobSpec, client: ChannelClient, slots: Sequence[RankSlot], partition: int,
              devices: Devices | None, shards: str, stop: threading.Event) -> int:
    """Start the worker of this task's rank, stream it to the driver, return its exit code."""
    iface = job.gloo_iface or iface_towards(job.driver_host)
    with staged_payload(job.payload, kind="task") as payload_path:
        launch = worker_launch(
            job,
            slots,
            partition,
            payload_path,
            driver_host=job.driver_host,
            iface=iface,
            cwd=None,
            host_name=socket.gethostname(),
            devices=devices,
            shards=shards,
        )
        # the worker holds a copy of this task's connection: the driver sees it
        # close only once the task and its worker are both gone
        launch = dataclasses.replace(launch, pass_fds=(client.fileno(),))
        log.info("job %s: task %d starts rank %d on %s", job.job_id, partition,
                 launch.rank, launch.host)
        exited = run_worker(launch, client.send, stop)
        log.info("job %s: rank %d on %s exited with %d", job.job_id, launch.rank,
                 launch.host, exited.exit_code)
    return exited.exit_code
