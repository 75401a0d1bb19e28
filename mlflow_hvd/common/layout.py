"""Pure builders: the rank layout, the per-rank environment and the worker command.

No side effects here, so every function is unit-tested without processes. Nothing here
imports Horovod: a job of torch.distributed code runs where Horovod is not installed. The
layout and the HOROVOD_* variables are the ones ``horovodrun --gloo`` gives its ranks (its
``get_host_assignments``, ``create_slot_env_vars`` and ``create_run_env_vars``); the main
tier checks them against Horovod's own functions, layout for layout
(tests/test_layout.py).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence

from mlflow_hvd.common.horovod_env import OWNED
from mlflow_hvd.protocol.credentials import ALL_VARS as CREDENTIAL_VARS
from mlflow_hvd.protocol.messages import RankSlot

WORKER_MODULE = "mlflow_hvd.rank.worker"



HOST_VARIABLE = "MLFLOW_HVD_HOST"  # a rank's host, as the driver's messages name it

def assign_slots(task_hosts: Sequence[str]) -> tuple[RankSlot, ...]:
    """Compute the Horovod layout for tasks placed on ``task_hosts``.

    Args:
        task_hosts: The host of each task, indexed by task (partition) number.

    Returns:
        The slot of each task, indexed like ``task_hosts``. Hosts are ordered by their first
        task, ranks are contiguous per host (as horovodrun assigns them), and task 0 is
        always rank 0. A rank's cross rank is its host's index among the hosts that have a
        rank of its local rank; its cross size is how many hosts have one.
    """
    if not task_hosts:
        raise ValueError("task_hosts is empty: at least one task is needed")
    tasks_on: dict[str, list[int]] = {}  # insertion order: hosts by their first task
    for task, host in enumerate(task_hosts):
        tasks_on.setdefault(host, []).append(task)
    size = len(task_hosts)
    by_task: dict[int, RankSlot] = {}
    rank = 0
    for host, tasks in tasks_on.items():
        for local_rank, task in enumerate(tasks):
            peers = [h for h, on in tasks_on.items() if len(on) > local_rank]
            by_task[task] = RankSlot(host, rank, local_rank, peers.index(host), size,
                                     len(tasks), len(peers))
            rank += 1
    return tuple(by_task[t] for t in range(size))


@dataclasses.dataclass(frozen=True)
class Devices:
    """A rank's share of a Spark resource (GPUs): what it sees (``CUDA_VISIBLE_DEVICES``)
    and what Spark assigned its own task (``MLFLOW_HVD_TASK_DEVICES``)."""

    visible: tuple[str, ...]
    own: tuple[str, ...]

    def env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.visible),
                "MLFLOW_HVD_TASK_DEVICES": ",".join(self.own)}


def visible_devices(
    slots: Sequence[RankSlot], addresses: Sequence[Sequence[str]], task: int
) -> Devices:
    """The devices (e.g. GPUs) task ``task``'s rank should see, from the addresses Spark
    assigned every task (``addresses``, indexed like ``slots``).

    When every device of a host belongs to one task: all the job's devices on that host,
    ordered by local rank, so that the usual ``gpus[hvd.local_rank()]`` picks the task's own
    (with several devices per task, its first). When Spark let tasks share a device
    (fractional ``spark.task.resource.*.amount``): only the task's own devices, since a
    shared device cannot appear twice in ``CUDA_VISIBLE_DEVICES``.
    """
    host = slots[task].hostname
    mine = sorted((t for t, s in enumerate(slots) if s.hostname == host),
                  key=lambda t: slots[t].local_rank)
    own = tuple(addresses[task])
    ordered = [a for t in mine for a in addresses[t]]
    shared = len(set(ordered)) < len(ordered)
    if shared or any(len(addresses[t]) != len(own) for t in mine):
        return Devices(own, own)  # each sees its own
    # rank i's first device at index i, then everyone's others
    firsts = [addresses[t][0] for t in mine if addresses[t]]
    rest = [a for t in mine for a in addresses[t][1:]]
    return Devices(tuple(firsts + rest), own)


def rank_env(
    slot: RankSlot, rendezvous_addr: str, rendezvous_port: int, iface: str
) -> dict[str, str]:
    """The environment variables one Gloo rank needs (and nothing secret), as
    ``horovodrun --gloo`` sets them.

    Contains HOROVOD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE/CROSS_RANK/CROSS_SIZE/HOSTNAME,
    HOROVOD_CONTROLLER=gloo, HOROVOD_CPU_OPERATIONS=gloo, HOROVOD_GLOO_IFACE and
    NCCL_SOCKET_IFNAME (``iface``), HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT when a rendezvous
    server runs (``rendezvous_port`` 0: none, the driver has no Horovod), and
    PYTHONUNBUFFERED=1 so that output streams live.
    """
    env = {
        "HOROVOD_HOSTNAME": slot.hostname, "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size), "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size), "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": iface, "NCCL_SOCKET_IFNAME": iface,
    }
    if rendezvous_port:
        env.update({"HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_addr,
                    "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port)})
    env["PYTHONUNBUFFERED"] = "1"
    return env


# torch.distributed's worker contract (torch.distributed.run documents these variables)
TORCH_VARS = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "NODE_RANK", "TORCHELASTIC_ERROR_FILE",
})
ROLE = "default"  # torchrun's role name when none is given


def torch_env(slot: RankSlot, slots: Sequence[RankSlot], store_addr: str, iface: str,
              environ: Mapping[str, str], task: int | None = None,
              error_file: str = "") -> dict[str, str]:
    """The variables ``torchrun`` gives a worker that stay the same from job to job, for the
    rank of ``slot`` among ``slots`` (every rank of the job), consistent with Horovod's:
    ``RANK`` is ``hvd.rank()``, ``LOCAL_RANK`` ``hvd.local_rank()``; ``GROUP_RANK`` is the
    index of the rank's host (hosts ordered by their first rank, as torchrun's node ranks
    are) and ``GROUP_WORLD_SIZE`` the number of hosts. ``MASTER_ADDR`` is ``store_addr``, the
    driver's address as this host reaches it, where every job's store listens and every
    rank joins it as a client (``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun); ""
    when the driver offers no store (it has no torch), and neither is set. torch's Gloo
    uses ``iface``, the interface Horovod's Gloo uses (``GLOO_SOCKET_IFNAME``), unless
    ``environ`` (the host's) names one; NCCL's is Horovod's (``NCCL_SOCKET_IFNAME``,
    :func:`rank_env`). What changes from job to job comes with each job
    (:func:`job_vars`).

    ``task``: the rank's task (its index among ``slots``) when each task is a torchrun node
    of its own, as pyspark's TorchDistributor runs them (``torchrun --nnodes=<tasks>
    --node_rank=<task> --nproc_per_node=1`` in each barrier task, ``NODE_RANK`` set in the
    task): ``RANK``, ``GROUP_RANK`` and ``NODE_RANK`` are the task, ``LOCAL_RANK`` 0 of
    ``LOCAL_WORLD_SIZE`` 1. None: hosts are the nodes (HorovodRunner's numbering).

    As torchrun, ``TORCHELASTIC_ERROR_FILE`` names where torch's ``@record`` writes the
    process's error (``error_file``, in the rank's scratch directory; "": not set) and
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is 1 unless ``environ`` sets it."""
    if task is not None:
        tasks = str(len(slots))
        env = {"RANK": str(task), "WORLD_SIZE": tasks, "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(task), "GROUP_WORLD_SIZE": tasks,
               "NODE_RANK": str(task), "ROLE_RANK": str(task), "ROLE_WORLD_SIZE": tasks,
               "ROLE_NAME": ROLE}
    else:
        hosts: list[str] = []
        for other in sorted(slots, key=lambda s: s.rank):
            if other.hostname not in hosts:
                hosts.append(other.hostname)
        env = {
            "RANK": str(slot.rank), "WORLD_SIZE": str(slot.size),
            "LOCAL_RANK": str(slot.local_rank), "LOCAL_WORLD_SIZE": str(slot.local_size),
            "GROUP_RANK": str(hosts.index(slot.hostname)),
            "GROUP_WORLD_SIZE": str(len(hosts)), "ROLE_RANK": str(slot.rank),
            "ROLE_WORLD_SIZE": str(slot.size), "ROLE_NAME": ROLE,
        }
    if store_addr:
        env.update({"MASTER_ADDR": store_addr, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    if error_file:
        env["TORCHELASTIC_ERROR_FILE"] = error_file
    if "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in environ:
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    if not environ.get("GLOO_SOCKET_IFNAME"):
        env["GLOO_SOCKET_IFNAME"] = iface
    return env


JobVars = tuple[tuple[str, str], ...]  # a job's variables, as data: (name, value) pairs


def job_vars(run_id: str, master_port: int, attempt: int, max_restarts: int,
             extra: JobVars = ()) -> JobVars:
    """The one builder of the variables a rank has for one job (the driver builds them and
    sends them with the job; the rank sets them before the job's code and restores its own
    after): torchrun's that change from job to job - the run id (``TORCHELASTIC_RUN_ID``),
    the job's store's port (``MASTER_PORT``; 0: no store, not set), the attempt
    (``TORCHELASTIC_RESTART_COUNT``) and the restarts allowed
    (``TORCHELASTIC_MAX_RESTARTS``) - then ``extra``, what the job's face asks of every rank
    (``TorchDistributor(use_gpu=False)``: ``CUDA_VISIBLE_DEVICES=""``)."""
    env = {"TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": str(attempt),
           "TORCHELASTIC_MAX_RESTARTS": str(max_restarts)}
    if master_port:
        env["MASTER_PORT"] = str(master_port)
    env.update(dict(extra))
    return tuple(sorted(env.items()))


def worker_env(
    base: Mapping[str, str], rank_vars: Mapping[str, str],
    tuning: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The full environment of a worker: ``base`` (the host's environment: Horovod's tuning
    variables kept; the ones the runner owns, Horovod's and torch.distributed's
    (:data:`TORCH_VARS`), and the run id dropped), then the job's
    ``tuning`` (:mod:`mlflow_hvd.common.horovod_env`), then ``rank_vars``."""
    # MLflow's client settings (credentials) reach rank 0 over the channel, no rank
    # through its environment (mlflow_hvd.protocol.credentials)
    env = {k: v for k, v in base.items()
           if k not in OWNED and k not in TORCH_VARS and k != "MLFLOW_RUN_ID"
           and k not in CREDENTIAL_VARS}
    env.update(tuning or {})
    env.update(rank_vars)
    return env


def worker_command(python: str | None = None) -> list[str]:
    """The command that starts one worker. It carries no secret: that goes through stdin."""
    return [python or sys.executable, "-m", WORKER_MODULE]
