"""The description of one distributed job, as the driver hands it to a backend and a backend
to its Spark tasks (the same object travels in the barrier task's closure)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlflow_hvd.protocol.environment import EnvironmentFingerprint
from mlflow_hvd.protocol.feed import FeedSpec


@dataclass(frozen=True)
class JobSpec:
    """One distributed run, as the driver hands it to a backend (and a backend to its
    Spark tasks: the same object travels in the barrier task's closure).

    Attributes:
        np: Number of ranks (positive).
        payload: A pickled :class:`~mlflow_hvd.protocol.messages.Payload`.
        secret: Per-run HMAC secret; excluded from ``repr`` so it never lands in a log.
        driver_host: Address workers use to reach the driver's channel and rendezvous.
        channel_port: Port of the driver's authenticated channel.
        rendezvous_port: Port of horovod's Gloo rendezvous server.
        job_id: Unique id; also the Spark job group.
        description: Human-readable description (Spark UI).
        channel_timeout: Deadline of each worker-to-driver send, in seconds.
        max_line_bytes: Output lines longer than this are truncated with a marker.
        stop_grace: Seconds between SIGTERM and SIGKILL when stopping a worker.
        gloo_iface: Network interface for Gloo; None picks the one that routes to the driver.
        pooled: Workers stay up after the job and ask the driver for the next one
            (:mod:`mlflow_hvd.driver.pool`).
        idle_timeout: How long a pooled worker waits for the next job before the driver
            retires it, in seconds.
        horovod_env: Horovod's tuning variables every rank gets (from ``HorovodOptions``
            and the driver's environment).
        feed: The DataFrame arguments each task writes from its partition before its
            rank starts (None: the job has none).
        environment: What the environment shipped to the executors (``spark.archives``)
            needs on each host; every task checks before its rank starts (None: executors
            run an environment of their own, unchecked).
        job_vars: The variables every rank has for the first job (``MASTER_PORT`` of its
            ``torch.distributed`` store among them, where the driver offers one), as
            :func:`mlflow_hvd.common.layout.job_vars` builds them; a warm rank's later jobs
            bring their own.
        torch_nodes_are_tasks: Each task is a torchrun node of its own, as pyspark's
            TorchDistributor numbers processes (``LOCAL_RANK`` 0 in every task); False:
            hosts are the nodes, ranks numbered as Horovod numbers them
            (:func:`mlflow_hvd.common.layout.torch_env`).
    """

    np: int
    payload: bytes = field(repr=False)
    secret: bytes = field(repr=False)
    driver_host: str
    channel_port: int
    rendezvous_port: int
    job_id: str
    description: str
    channel_timeout: float
    max_line_bytes: int
    stop_grace: float
    gloo_iface: str | None
    pooled: bool
    log_level: str  # the driver's lifecycle log level for agents and ranks ("": off)
    idle_timeout: float
    # HOROVOD_* tuning variables for every rank (mlflow_hvd.common.horovod_env.job_env)
    horovod_env: tuple[tuple[str, str], ...]
    gpu_resource: str  # the Spark resource whose addresses become CUDA_VISIBLE_DEVICES
    feed: FeedSpec | None = None
    environment: EnvironmentFingerprint | None = None
    job_vars: tuple[tuple[str, str], ...] = ()
    torch_nodes_are_tasks: bool = False

    @property
    def torch_store(self) -> bool:
        """The driver offers the job a ``torch.distributed`` store (it has torch)."""
        return any(name == "MASTER_PORT" for name, _ in self.job_vars)
