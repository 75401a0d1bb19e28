"""torch.distributed code as PyTorch users write it (``init_process_group`` from the
environment, DistributedDataParallel, DistributedSampler) under HorovodRunner: torchrun's
worker contract in every rank, the job's store on the driver, a new store per job and per
attempt."""

from __future__ import annotations

import datetime
import socket
from typing import Any

import pytest
import workers

from mlflow_hvd import HorovodRunner, JobConfig

pytestmark = pytest.mark.slow


def _check_contract(out: dict[str, Any], host: str, iface: str, attempt: int = 0,
                    max_restarts: int = 0) -> dict[str, str]:
    """Every rank got torchrun's variables, consistent with its torch.distributed rank; the
    sampler gave each a distinct half; DDP left them with equal weights. Returns rank 0's
    variables."""
    ranks = out["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and {r["world"] for r in ranks} == {2}
    port = ranks[0]["env"]["MASTER_PORT"]
    run_id = ranks[0]["env"]["TORCHELASTIC_RUN_ID"]
    for r in ranks:
        assert r["env"] == {
            "RANK": str(r["rank"]), "WORLD_SIZE": "2", "LOCAL_RANK": str(r["local_rank"]),
            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
            "ROLE_RANK": str(r["rank"]), "ROLE_WORLD_SIZE": "2", "ROLE_NAME": "default",
            "MASTER_ADDR": host, "MASTER_PORT": port, "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts), "GLOO_SOCKET_IFNAME": iface,
        }, r["rank"]
        assert r["local_rank"] == r["rank"]  # one host: local ranks are the ranks
    assert run_id.startswith("mlflow-hvd-")
    first, second = (set(r["seen"]) for r in ranks)
    assert not first & second and first | second == set(range(16))  # the sampler's halves
    assert ranks[0]["weights"] == ranks[1]["weights"]  # DDP: the same step everywhere
    return dict(ranks[0]["env"])


def test_ddp_code_runs_unchanged_on_warm_local_ranks_each_job_with_a_store_of_its_own(
        warm_ranks: Any) -> None:
    """Two jobs on the same warm ranks: each joins a new store (a new port, a new run id:
    the last job's keys cannot mislead it), and the process group the first left is gone
    before the second's init_process_group; Horovod in the same function agrees on ranks."""
    first = warm_ranks.run(workers.ddp_as_pytorch_writes_it, with_horovod=True)
    env = _check_contract(first, "127.0.0.1", "lo")
    for r in first["ranks"]:
        assert r["horovod"] == {"rank": r["rank"], "size": 2, "local_rank": r["rank"],
                                "sum": [3.0]}
    second = warm_ranks.run(workers.ddp_as_pytorch_writes_it)
    again = _check_contract(second, "127.0.0.1", "lo")
    assert again["MASTER_PORT"] != env["MASTER_PORT"]
    assert again["TORCHELASTIC_RUN_ID"] != env["TORCHELASTIC_RUN_ID"]


def test_ddp_on_spark_barrier_tasks_joins_the_store_on_the_drivers_address_again_on_restart(
        spark: Any) -> None:
    """Spark tasks' ranks find the store where they reach the driver (spark.driver.host);
    rank 1 fails the first attempt after joining its group, and the restarted attempt joins
    a new store (TORCHELASTIC_RESTART_COUNT=1) and trains."""
    host = spark.sparkContext.getConf().get("spark.driver.host")
    runner = HorovodRunner(np=2, job=JobConfig(max_failures=1, stop_grace=2))
    out = runner.run(workers.ddp_as_pytorch_writes_it, with_horovod=True,
                     fail_attempt_on_rank_1=0)
    iface = out["ranks"][0]["env"]["GLOO_SOCKET_IFNAME"]
    assert iface == ("lo" if host.startswith("127.") else iface) and iface
    _check_contract(out, host, iface, attempt=1, max_restarts=1)
    assert [r["horovod"]["rank"] for r in out["ranks"]] == [0, 1]


def test_the_drivers_store_binds_a_port_at_once_serves_when_asked_and_releases_it() -> None:
    """The port exists before torch is imported (it goes to the ranks with their
    environment); a rank that connects before the store serves waits in the backlog and is
    answered; closing releases the port."""
    from torch.distributed import TCPStore

    from mlflow_hvd.driver.torch_store import TorchStore

    store = TorchStore("127.0.0.1")
    try:
        assert not store.serving
        store.serve()
        client = TCPStore("127.0.0.1", store.port, None, False,
                          datetime.timedelta(seconds=30))
        client.set("key", "value")
        assert client.get("key") == b"value" and store.serving
        store.serve()  # idempotent
        del client
    finally:
        store.close()
    store.close()  # idempotent
    with socket.create_server(("127.0.0.1", store.port)):  # free again
        pass
