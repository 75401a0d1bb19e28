"""torch.distributed code as PyTorch users write it (``init_process_group`` from the
environment, DistributedDataParallel, DistributedSampler) under HorovodRunner: torchrun's
worker contract in every rank, the job's store on the driver, a new store per job and per
attempt."""

from __future__ import annotations

import datetime
import os
import socket
import time
from pathlib import Path
from typing import Any

import mlflow
import pytest
import workers
from services import wait_until

from mlflow_hvd import HorovodRunner, JobConfig, WorkerFailedError

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
    # a function that ends with a collective and destroy_process_group() and drops its DDP
    # model on return deadlocked one job in three in Gloo's destructor (pytorch#56297);
    # freed after the job without keeping each model's group past its reducer, rank 1 hung
    # at the 5th to 13th job of a row: twelve more, 0.2 s each here
    ports = {again["MASTER_PORT"]}
    for _ in range(12):
        ports.add(_check_contract(warm_ranks.run(workers.ddp_as_pytorch_writes_it),
                                  "127.0.0.1", "lo")["MASTER_PORT"])
    assert len(ports) == 13


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
    # mlflow_hvd.torch on DDP without Horovod's collectives: epoch 0's checkpoint (of the
    # module DDP wraps) restored on every rank, the rate scaled by the world's size
    assert out["start"] == 1
    assert {r["lr"] for r in out["ranks"]} == {0.002}
    client = mlflow.MlflowClient()
    run = client.get_run(str(runner.last_run_id))
    assert run.data.tags["mlflow_hvd.resumed_from"] == f"{run.info.run_id}@epoch_0"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [0, 1, 2]


def test_a_rank_killed_between_allreduces_is_named_within_seconds_and_no_rank_is_left(
        tmp_path: Path) -> None:
    """Gloo's own timeout is 30 minutes: the job ends on the killed rank's exit, naming it,
    and the rank left inside an allreduce is stopped with it."""
    import psutil

    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as failed:
        HorovodRunner(np=-2, job=JobConfig(stop_grace=2)).run(
            workers.ddp_killed_mid_allreduce, pid_dir=str(tmp_path))
    took = time.monotonic() - started
    assert str(failed.value).startswith(
        "Rank 1 on host localhost failed (killed by signal SIGKILL)"), str(failed.value)
    assert took < 60, took  # the ranks' start included; a Gloo wait would be 30 minutes
    pids = [int((tmp_path / f"rank{r}").read_text()) for r in (0, 1)]
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE], pids


def test_nccl_asked_on_a_rank_without_a_gpu_is_named_with_what_to_use() -> None:
    with pytest.raises(WorkerFailedError) as failed:
        HorovodRunner(np=-2, job=JobConfig(stop_grace=2)).run(workers.nccl_on_cpu)
    text = str(failed.value)
    assert "Distributed package doesn't have NCCL built in" in text, text  # torch's words
    assert ("init_process_group(\"nccl\") needs a GPU for each rank, and this rank has "
            "none") in text, text
    assert "use \"gloo\" on CPUs" in text, text


@pytest.mark.new_end
def test_fsdp2_on_gloo_averages_gradients_and_each_rank_holds_half(warm_ranks: Any) -> None:
    """FSDP2 asks Gloo for an average (pytorch#162338 reports Gloo summing instead): the
    sharded gradient made whole equals the mean of the ranks' own gradients, on this
    torch (2.13 in the main environment, 2.14 in the new end's)."""
    out = warm_ranks.run(workers.fsdp_gradients)
    assert out["worst"] < 1e-5, out
    assert all(abs(r - 1.0) < 1e-5 for r in out["ratios"]), out  # a sum would be 2.0
    assert out["held"] * 2 == out["whole"], out


def test_the_fsdp_example_resumes_from_sharded_checkpoints_on_as_many_ranks_and_on_more(
        store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """examples/digits_fsdp.py with sharded checkpoints (each rank's part, sent to the run
    through rank 0) under HorovodRunner(np=-2): rank 1 fails at epoch 1 of the first
    attempt, the second loads epoch 0's checkpoint, each rank its part, and goes on; each
    rank held half of the parameters, of the gradients and of Adam's state. The run's last
    checkpoint, read with torch.distributed.checkpoint alone, is the model the job logged.
    The same run continued on 3 ranks reads it resharded (a third each) and logs the same
    model again."""
    import digits_fsdp
    import torch
    import torch.distributed.checkpoint as dcp

    runner = HorovodRunner(np=-2, job=JobConfig(max_failures=1, stop_grace=2))
    out = runner.run(digits_fsdp.train, epochs=2, fail_at_epoch=1, sharded_checkpoints=True)
    assert out["start_epoch"] == 1 and out["test_accuracy"] > 0.8, out
    whole = out["full_bytes"]
    for held in out["held"]:
        assert held == {"params": whole // 2, "grads": whole // 2, "optimizer": whole}, out
    client = mlflow.MlflowClient()
    run_id = str(runner.last_run_id)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["mlflow_hvd.resumed_from"] == f"{run_id}@epoch_0"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [0, 1]
    latest = run.data.tags["mlflow.latest_checkpoint_artifact"]
    assert latest == "checkpoints/epoch_1/checkpoint.dcp"
    assert {Path(a.path).name for a in client.list_artifacts(run_id, latest)} == {
        ".metadata", "__0_0.distcp", "__1_0.distcp"}
    (logged,) = run.outputs.model_outputs
    trained = mlflow.pytorch.load_model(f"models:/{logged.model_id}").state_dict()
    files = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=latest,
                                                dst_path=str(tmp_path))
    state = {"model": {k: torch.zeros_like(v) for k, v in trained.items()}}
    dcp.load(state, checkpoint_id=files)  # no process group: this process reads it all
    assert all(torch.equal(state["model"][k], trained[k]) for k in trained)

    # the run continued on 3 ranks: nothing left to train, the checkpoint read resharded
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    more = HorovodRunner(np=-3, driver_log_verbosity="all").run(
        digits_fsdp.train, epochs=2, sharded_checkpoints=True)
    assert more["start_epoch"] == 2 and more["test_loss"] == pytest.approx(
        out["test_loss"], abs=1e-6), (more, out)
    assert sum(h["params"] for h in more["held"]) == whole
    assert max(h["params"] for h in more["held"]) < whole // 2, more  # a third each
    told = capfd.readouterr()  # the ranks' streams, forwarded by the driver
    assert ("the checkpoint of epoch 1 was written by 2 ranks; the learning rate it "
            "restored is scaled by 1.5 for 3") in told.out + told.err
    models = client.get_run(run_id).outputs.model_outputs
    again = next(m for m in models if m.model_id != logged.model_id)
    resumed = mlflow.pytorch.load_model(f"models:/{again.model_id}").state_dict()
    assert all(torch.equal(resumed[k], trained[k]) for k in trained)


def test_sharded_checkpoint_files_move_to_rank_0_and_back_a_chunk_at_a_time(
        warm_ranks: Any) -> None:
    """The transfers under sharded checkpoints, with 1000-byte messages: rank 0 hands on
    every rank's files, its own first, each byte intact, and keeps only its own; then every
    rank receives rank 0's files intact (an empty file, files ending on a message's end and
    just past or before one)."""
    out = warm_ranks.run(workers.sharded_files_moved, chunk=1000)
    first, second = out["ranks"]
    assert out["names"] == [*sorted(first["written"]), *sorted(second["written"])]
    assert out["uploaded"] == {**first["written"], **second["written"]}
    assert out["kept"] == sorted(first["written"])  # received files deleted once handed on
    assert first["received"] == second["received"] == first["written"]


def test_a_hundred_sharded_transfers_leave_no_descriptor_or_thread_behind(
        warm_ranks: Any) -> None:
    """Each transfer's Gloo side group (an NCCL job's sharded checkpoints move over one) is
    destroyed after it: a rank's open descriptors and threads stay flat over 100 (kept,
    each left a full mesh of sockets and Gloo's threads for the job's life)."""
    for counts in warm_ranks.run(workers.side_groups_leave_nothing, transfers=100):
        assert counts["fds_after"] - counts["fds_before"] <= 2, counts
        assert counts["threads_after"] - counts["threads_before"] <= 1, counts


def test_the_store_serves_only_the_jobs_hosts(caplog: pytest.LogCaptureFixture) -> None:
    """A Spark job's store (bound on an address of this machine that is not loopback)
    forwards no connection before the layout is known, then only from the layout's hosts:
    anyone else is closed before a byte is read or written, counted and named."""
    from torch.distributed import TCPStore

    from mlflow_hvd.driver.admission import Admission, local_addresses
    from mlflow_hvd.driver.torch_store import TorchStore

    here = sorted(a for a in local_addresses() if ":" not in a and not a.startswith("127."))[0]
    admission = Admission(here)
    store = TorchStore(here, admission)
    try:
        store.serve()
        wait_until(lambda: store.serving, 60, "the store serving")

        def stranger() -> bytes:
            with socket.create_connection((here, store.port), timeout=10) as sock:
                return sock.recv(1)  # closed unread: b""

        with caplog.at_level("WARNING", logger="mlflow_hvd.driver.torch_store"):
            assert stranger() == b""  # no layout yet: nobody
            admission.admit_hosts({"198.51.100.99"})  # the job runs elsewhere
            assert stranger() == b""
        assert store.refused == 2
        assert f"refused a connection from {here}, not a host of this job" in caplog.text
        admission.admit_hosts({here})  # a task on this machine
        client = TCPStore(here, store.port, None, False, datetime.timedelta(seconds=30))
        client.set("key", "value")
        assert client.get("key") == b"value" and store.refused == 2
        del client
    finally:
        store.close()


def test_a_store_that_cannot_start_fails_the_job_at_once_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's store fails to start (its port taken): the job fails at once, naming
    it, instead of its ranks waiting in init_process_group for torch's 30 minutes."""
    from mlflow_hvd.driver.torch_store import TorchStore
    from mlflow_hvd.errors import BackendError

    def port_taken(self: TorchStore) -> Any:
        raise OSError(98, "Address already in use")

    monkeypatch.setattr(TorchStore, "_open_store", port_taken)
    runner = HorovodRunner(np=-2, job=JobConfig(stop_grace=2))
    started = time.monotonic()
    with pytest.raises(BackendError) as info:
        runner.run(workers.ddp_as_pytorch_writes_it, steps=2)
    took = time.monotonic() - started
    assert took < 30, took  # the ranks' start, then at once; not torch's 30 minutes
    assert "the driver's torch.distributed store (port " in str(info.value)
    assert str(info.value).endswith("could not start: OSError: [Errno 98] Address already "
                                    "in use")


def test_the_drivers_store_binds_a_port_at_once_serves_when_asked_and_releases_it() -> None:
    """The port exists before torch is imported (it goes to the ranks with their
    environment); a rank that connects before the store serves waits in the backlog and is
    answered; closing releases the port."""
    from torch.distributed import TCPStore

    from mlflow_hvd.driver.admission import Admission
    from mlflow_hvd.driver.torch_store import TorchStore

    store = TorchStore("127.0.0.1", Admission("127.0.0.1"))
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
    # a driver host that is not an address of this machine (behind NAT; 198.51.100.0/24 is
    # a documentation range): the generation's one choice is every interface, for the store
    # as for the job's channel
    from mlflow_hvd.common.network import listen_address

    admission = Admission(listen_address("198.51.100.250"))
    elsewhere = TorchStore(listen_address("198.51.100.250"), admission)
    try:
        assert elsewhere.host == ""
        admission.admit_hosts({"127.0.0.1"})  # the layout: a task on this machine
        elsewhere.serve()
        client = TCPStore("127.0.0.1", elsewhere.port, None, False,
                          datetime.timedelta(seconds=30))
        client.set("key", "value")
        assert client.get("key") == b"value"
        del client
    finally:
        elsewhere.close()


def test_a_jobs_variables_are_set_before_its_code_loads_and_gone_for_the_next_job(
        warm_ranks: Any) -> None:
    """The variables a job's face asks of every rank (TorchDistributor(use_gpu=False) hides
    the GPUs) come with the job, as data: set before its code is unpickled (an import that
    initialises CUDA sees them) and given back after it, so the warm ranks' next job sees
    the host's own again."""
    from mlflow_hvd.runner import RunHooks

    names = ("CUDA_VISIBLE_DEVICES", "MLFLOW_HVD_TEST_PROBE", "TORCHELASTIC_RUN_ID")
    hidden = RunHooks(rank_env=(("CUDA_VISIBLE_DEVICES", ""), ("MLFLOW_HVD_TEST_PROBE", "1")))
    first = warm_ranks.run_with(hidden, workers.job_variables,
                                probe=workers.SeesAtUnpickling(names))
    run_id = first["running"]["TORCHELASTIC_RUN_ID"]
    assert run_id == warm_ranks.last_job_id
    assert first["unpickled"] == first["running"] == {
        "CUDA_VISIBLE_DEVICES": "", "MLFLOW_HVD_TEST_PROBE": "1", "TORCHELASTIC_RUN_ID": run_id}
    second = warm_ranks.run(workers.job_variables, probe=workers.SeesAtUnpickling(names))
    assert second["running"] == second["unpickled"] == {
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "MLFLOW_HVD_TEST_PROBE": None, "TORCHELASTIC_RUN_ID": warm_ranks.last_job_id}
