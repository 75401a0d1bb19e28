"""Unit tests of the pure builders: rank layout, per-rank environment, worker command."""

from __future__ import annotations

import dataclasses
import itertools
import sys

import pytest

from mlflow_hvd.common.layout import (
    TORCH_VARS,
    assign_slots,
    job_vars,
    rank_env,
    torch_env,
    worker_command,
    worker_env,
)
from mlflow_hvd.protocol.messages import RankSlot


def test_two_tasks_on_one_host_are_local_ranks_of_one_node() -> None:
    slots = assign_slots(["h1", "h1"])
    assert slots == (
        RankSlot("h1", rank=0, local_rank=0, cross_rank=0, size=2, local_size=2, cross_size=1),
        RankSlot("h1", rank=1, local_rank=1, cross_rank=0, size=2, local_size=2, cross_size=1),
    )


def test_interleaved_hosts_get_contiguous_ranks_per_host_like_horovodrun() -> None:
    # Tasks 0..3 landed on a, b, a, b: horovodrun with -H a:2,b:2 gives a ranks 0,1; b 2,3.
    slots = assign_slots(["a", "b", "a", "b"])
    assert [s.rank for s in slots] == [0, 2, 1, 3]
    assert [s.local_rank for s in slots] == [0, 0, 1, 1]
    assert [s.cross_rank for s in slots] == [0, 1, 0, 1]
    assert {(s.local_size, s.cross_size, s.size) for s in slots} == {(2, 2, 4)}


def _every_placement(max_tasks: int) -> list[list[str]]:
    """Every way to place 1..max_tasks tasks on hosts a, b, c (up to renaming)."""
    placements = []
    for n in range(1, max_tasks + 1):
        for hosts in itertools.product("abc", repeat=n):
            placements.append(list(hosts))
    return placements


def test_the_layout_and_variables_are_horovodruns_for_every_placement() -> None:
    """The builders import no Horovod (torch.distributed jobs run without it); what they
    give is what horovod's own functions give, for every placement of up to 6 tasks on 3
    hosts (1,092 layouts)."""
    from horovod.runner.common.util.hosts import HostInfo, SlotInfo, get_host_assignments
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars

    placements = _every_placement(6)
    assert len(placements) == 1092
    for hosts in placements:
        slots = assign_slots(hosts)
        order = list(dict.fromkeys(hosts))
        expected = get_host_assignments([HostInfo(h, hosts.count(h)) for h in order],
                                        len(hosts), len(hosts))
        assert sorted(slots, key=lambda s: s.rank) == [
            RankSlot(**dataclasses.asdict(info)) for info in expected], hosts
        assert slots[0].rank == 0
        for slot in slots:
            info = SlotInfo(**dataclasses.asdict(slot))
            theirs = {k: str(v) for k, v in {**create_slot_env_vars(info),
                                              **create_run_env_vars("10.0.0.5", ["eth0"],
                                                                    41234)}.items()}
            assert rank_env(slot, "10.0.0.5", 41234, "eth0") == {**theirs,
                                                                  "PYTHONUNBUFFERED": "1"}


def test_without_a_rendezvous_server_a_rank_gets_no_rendezvous_address() -> None:
    slot = assign_slots(["a"])[0]
    env = rank_env(slot, "10.0.0.5", 0, "eth0")
    assert not {k for k in env if k.startswith("HOROVOD_GLOO_RENDEZVOUS")}
    assert env["HOROVOD_RANK"] == "0" and env["HOROVOD_GLOO_IFACE"] == "eth0"


def test_uneven_hosts_cross_sizes_match_horovod() -> None:
    slots = assign_slots(["a", "a", "a", "b"])
    by_rank = {s.rank: s for s in slots}
    assert by_rank[3] == RankSlot("b", 3, 0, 1, 4, 1, 2)
    assert by_rank[2] == RankSlot("a", 2, 2, 0, 4, 3, 1)
    assert slots[0].rank == 0


def test_empty_host_list_is_rejected() -> None:
    with pytest.raises(ValueError, match="task_hosts is empty"):
        assign_slots([])


def test_rank_env_has_every_variable_a_gloo_rank_needs() -> None:
    slot = RankSlot("node-1", rank=3, local_rank=1, cross_rank=1, size=4, local_size=2,
                    cross_size=2)
    env = rank_env(slot, "10.0.0.5", 41234, "eth0")
    assert env == {
        "HOROVOD_HOSTNAME": "node-1",
        "HOROVOD_RANK": "3",
        "HOROVOD_SIZE": "4",
        "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "1",
        "HOROVOD_CROSS_SIZE": "2",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.5",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": "41234",
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": "eth0",
        "NCCL_SOCKET_IFNAME": "eth0",
        "PYTHONUNBUFFERED": "1",
    }


def test_worker_env_drops_the_runners_own_variables_and_the_run_keeps_tuning() -> None:
    base = {"PATH": "/bin", "HOROVOD_RANK": "9", "HOROVOD_SIZE": "9",
            "HOROVOD_FUSION_THRESHOLD": "x", "MLFLOW_RUN_ID": "abc"}
    env = worker_env(base, {"HOROVOD_RANK": "1"})
    assert env == {"PATH": "/bin", "HOROVOD_RANK": "1", "HOROVOD_FUSION_THRESHOLD": "x"}


def test_worker_command_carries_no_secret() -> None:
    assert worker_command() == [sys.executable, "-m", "mlflow_hvd.rank.worker"]
    assert worker_command("/opt/py") == ["/opt/py", "-m", "mlflow_hvd.rank.worker"]


def test_torch_env_is_torchruns_contract_with_horovods_ranks_and_hosts_as_nodes() -> None:
    slots = assign_slots(["a", "a", "a", "b"])  # host a: ranks 0-2; b: rank 3
    by_rank = {s.rank: s for s in slots}
    env = torch_env(by_rank[3], slots, "10.0.0.5", "eth0", {})
    assert env == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",  # torchrun's node rank: b is the 2nd
        "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4", "ROLE_NAME": "default",
        "MASTER_ADDR": "10.0.0.5", "TORCHELASTIC_USE_AGENT_STORE": "True",
        "GLOO_SOCKET_IFNAME": "eth0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    first = torch_env(by_rank[2], slots, "10.0.0.5", "eth0", {})
    assert (first["GROUP_RANK"], first["LOCAL_RANK"], first["LOCAL_WORLD_SIZE"]) == (
        "0", "2", "3")
    # a driver without torch offers no store: no address, and torch says so at once
    storeless = torch_env(by_rank[0], slots, "", "eth0",  # the host's own settings kept
                          {"GLOO_SOCKET_IFNAME": "ib0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    assert not {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
                "GLOO_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING"} & set(storeless)
    assert torch_env(by_rank[0], slots, "", "eth0", {}, error_file="/s/e.json")[
        "TORCHELASTIC_ERROR_FILE"] == "/s/e.json"  # where torch's @record writes


def test_tasks_as_torchrun_nodes_number_processes_as_pyspark_torchdistributor_does() -> None:
    """pyspark's TorchDistributor runs one torchrun node per barrier task: every process is
    LOCAL_RANK 0 of 1, its task is its RANK, GROUP_RANK and NODE_RANK, whatever host it is
    on (two tasks on one host are two nodes, where HorovodRunner's numbering makes them
    local ranks 0 and 1 of one)."""
    slots = assign_slots(["a", "b", "a", "b"])  # Horovod: a holds ranks 0-1, b ranks 2-3
    for task, slot in enumerate(slots):
        env = torch_env(slot, slots, "10.0.0.5", "eth0", {}, task)
        assert env == {
            "RANK": str(task), "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(task), "GROUP_WORLD_SIZE": "4", "NODE_RANK": str(task),
            "ROLE_RANK": str(task), "ROLE_WORLD_SIZE": "4", "ROLE_NAME": "default",
            "MASTER_ADDR": "10.0.0.5", "TORCHELASTIC_USE_AGENT_STORE": "True",
            "GLOO_SOCKET_IFNAME": "eth0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert torch_env(slots[2], slots, "10.0.0.5", "eth0", {})["LOCAL_RANK"] == "1"
    assert slots[0].rank == 0  # torch's rank 0 is Horovod's: the rank that logs and returns


def test_a_jobs_variables_are_torchruns_per_run_ones_and_nothing_a_rank_keeps() -> None:
    """What changes from job to job is built once, as data: torchrun's run id, the store's
    port and the attempt, then what the job's face adds; the start-time variables never
    carry them, so a warm rank's next job cannot see the last job's."""
    assert dict(job_vars("job-1", 41235, 2, 3, (("CUDA_VISIBLE_DEVICES", ""),))) == {
        "TORCHELASTIC_RUN_ID": "job-1", "MASTER_PORT": "41235",
        "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "3",
        "CUDA_VISIBLE_DEVICES": ""}
    assert "MASTER_PORT" not in dict(job_vars("job-1", 0, 0, 0))  # no store, no port
    slots = assign_slots(["a", "b"])
    per_job = {name for name, _ in job_vars("job-1", 41235, 2, 3)}
    assert not per_job & set(torch_env(slots[1], slots, "10.0.0.5", "eth0", {}))
    assert per_job <= TORCH_VARS  # a driver's own torchrun values never reach a rank


def test_worker_env_drops_a_torchrun_of_the_drivers_own() -> None:
    """A driver started by torchrun (or a Spark executor given RANK) must not hand its own
    rank and store to the ranks."""
    base = {"PATH": "/bin", "RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "elsewhere",
            "MASTER_PORT": "29500", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x"}
    assert worker_env(base, {"RANK": "1"}) == {"PATH": "/bin", "RANK": "1"}


def test_a_rank_asking_nccl_without_a_gpu_is_told_to_use_gloo() -> None:
    from mlflow_hvd.rank.torch_dist import hint

    for said in (RuntimeError("Distributed package doesn't have NCCL built in"),  # CPU build
                 ValueError("ProcessGroupNCCL is only supported with GPUs, no GPUs found!")):
        assert hint(said) == (
            " - init_process_group(\"nccl\") needs a GPU for each rank, and this rank has "
            "none (a CPU-only host, a CPU build of torch, or TorchDistributor(use_gpu=False)):"
            " use \"gloo\" on CPUs, e.g. init_process_group(\"nccl\" if "
            "torch.cuda.is_available() else \"gloo\")")
    assert hint(RuntimeError("something else")) == ""
    assert hint(KeyError("Distributed package doesn't have NCCL built in")) == ""
