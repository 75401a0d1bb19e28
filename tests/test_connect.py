"""HorovodRunner on a Spark Connect session: a real Connect server, started from pyspark's own
``sbin/start-connect-server.sh`` on ``local-cluster[2,2,1024]`` (two executor JVMs of two
cores: room for two jobs of np=2 at once), shared
by this module's tests and stopped on every path. The client is this process, on the
server's host: the executors reach it on loopback.

The session is made by the Connect client's own builder: the process's classic session
(the ``spark`` fixture of other modules) stays untouched beside it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import pytest
import workers
from services import ConnectServer, wait_until

from mlflow_hvd import HorovodRunner, JobConfig, TrackingConfig
from mlflow_hvd.errors import RunTimeoutError, WorkerFailedError

pytestmark = [pytest.mark.slow, pytest.mark.spark]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConnectServer]:
    started = ConnectServer(
        "local-cluster[2,2,1024]", tmp_path_factory.mktemp("connect-server"),
        conf={"spark.executorEnv.TF_CPP_MIN_LOG_LEVEL": "2"})
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def connect(server: ConnectServer) -> Iterator[Any]:
    from pyspark.sql.connect.session import SparkSession

    session = SparkSession.builder.remote(server.url).getOrCreate()
    yield session
    session.stop()


def frame(session: Any, rows: int, partitions: int) -> Any:
    from pyspark.sql.connect.functions import builtin as F

    return session.range(0, rows, 1, partitions).select(
        "id", F.array(*[F.rand(seed=i).cast("float") for i in range(4)]).alias("x"),
        (F.col("id") % 2).cast("int").alias("label"))


def nothing_running(server: ConnectServer) -> bool:
    return server.running_jobs() == []


def test_a_dataframe_job_gets_equal_disjoint_shards_and_one_finished_run(
        server: ConnectServer, connect: Any, store: str) -> None:
    runner = HorovodRunner(np=2, spark=connect)
    ranks = runner.run(workers.shard_census, data=frame(connect, 2_001, 3), batch_size=100)
    rows = ranks[0]["rows"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["rows"] == rows == len(r["ids"]) for r in ranks)
    first, second = (set(r["ids"]) for r in ranks)
    assert not first & second and first | second <= set(range(2_001))
    assert 2_001 - len(first | second) == ranks[0]["dropped"] <= 3
    client = mlflow.MlflowClient()
    (run,) = client.search_runs([client.get_run(runner.last_run_id).info.experiment_id])
    assert run.info.run_id == runner.last_run_id and run.info.status == "FINISHED"
    assert run.data.tags["mlflow_hvd.spark_master"] == "local-cluster[2,2,1024]"
    assert run.data.tags["mlflow_hvd.spark_connect"] == "127.0.0.1"
    wait_until(lambda: [d.dataset.name for d in
                        client.get_run(run.info.run_id).inputs.dataset_inputs] == ["data"],
               30, "the run's dataset input")
    (found,) = client.get_run(run.info.run_id).inputs.dataset_inputs
    assert json.loads(found.dataset.profile)["rows_per_rank"] == rows
    wait_until(lambda: nothing_running(server), 20, "no job left running on the server")


def test_a_petastorm_converter_of_a_connect_dataframe_feeds_each_rank_its_shard(
        connect: Any, store: str) -> None:
    """A notebook's Petastorm converter, imports changed, on a Connect session: doubles made
    float32 with Connect's own functions, the converter held in a closure, the ranks' finite
    passes reading every row once, the run recording the converter's DataFrame."""
    from pyspark.sql.connect.functions import builtin as F

    from mlflow_hvd.petastorm import make_spark_converter

    data = connect.range(0, 1_001, 1, 3).select(
        "id", F.array(*[F.rand(seed=i) for i in range(4)]).alias("x"))
    converter = make_spark_converter(data)
    assert len(converter) == 1_001
    runner = HorovodRunner(np=2, spark=connect)
    ranks = runner.run(lambda: workers.petastorm_census(converter, batch_size=50,
                                                         with_tf=False))
    seen = [[i for b in r["torch"] for i in b] for r in ranks]
    assert [len(s) for s in seen] == [r["rows"] for r in ranks]
    assert sorted(seen[0] + seen[1]) == list(range(1_001))  # 1,001 rows: shards unequal
    assert all(len(b) == 50 for r in ranks for b in r["torch"][:-1])
    client = mlflow.MlflowClient()
    run_id = runner.last_run_id
    assert client.get_run(run_id).info.status == "FINISHED"
    wait_until(lambda: [d.dataset.name for d in client.get_run(run_id).inputs.dataset_inputs]
               == [converter.argument], 30, "the run's dataset input")
    assert ranks[0]["dtypes"] == {"id": "torch.int64", "x": "torch.float32"}


def test_ddp_code_on_a_connect_sessions_ranks_gets_torchruns_variables_and_trains(
        connect: Any, store: str) -> None:
    """PyTorch's DDP tutorial code on the ranks of a Connect session: torchrun's variables
    on every rank, the store on an address of this machine (where the client runs the job),
    the sampler's halves, equal weights, its checkpoints in the job's run."""
    import psutil
    from test_torch_distributed import _check_contract

    runner = HorovodRunner(np=2, spark=connect)
    out = runner.run(workers.ddp_as_pytorch_writes_it)
    env = out["ranks"][0]["env"]
    ours = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    assert env["MASTER_ADDR"] in ours and env["GLOO_SOCKET_IFNAME"]
    _check_contract(out, env["MASTER_ADDR"], env["GLOO_SOCKET_IFNAME"])
    client = mlflow.MlflowClient()
    history = client.get_metric_history(str(runner.last_run_id), "loss")
    assert [m.step for m in history] == [0, 1, 2]


def test_a_sweep_of_two_trials_runs_on_one_generation_of_ranks(
        connect: Any, store: str) -> None:
    from hyperopt import hp

    from mlflow_hvd.sweep import sweep

    result = sweep(workers.shard_trial, {"lr": hp.uniform("lr", 0.0, 1.0)}, max_evals=2, np=2,
                   fixed_params={"data": frame(connect, 1_000, 4)}, spark=connect)
    client = mlflow.MlflowClient()
    trials = client.search_runs(
        [client.get_run(result.parent_run_id).info.experiment_id],
        f"tags.mlflow.parentRunId = '{result.parent_run_id}'")
    assert len(trials) == 2 and {t.info.status for t in trials} == {"FINISHED"}
    assert len({t.data.params["rank0_pid"] for t in trials}) == 1  # warm ranks, fed once
    assert result.best_loss == min(t.data.metrics["val_loss"] for t in trials)


def test_two_trials_run_at_once_each_its_own_tagged_stage_of_one_session(
        server: ConnectServer, connect: Any, store: str) -> None:
    """parallelism='auto' on Connect: the master's declared 4 slots hold two trials of
    np=2; their barrier stages overlap on the server, each under its own operation tag of
    the one session (tags are per thread)."""
    from hyperopt import hp

    from mlflow_hvd.sweep import sweep

    result = sweep(workers.paced_trial, {"x": hp.uniform("x", 0.0, 1.0)}, max_evals=2, np=2,
                   parallelism="auto", seed=1, fixed_params={"epochs": 3, "seconds": 1.0},
                   spark=connect)
    client = mlflow.MlflowClient()
    parent = client.get_run(result.parent_run_id)
    assert parent.data.params["parallelism"] == "2"
    first, second = sorted(
        client.search_runs([parent.info.experiment_id],
                           f"tags.mlflow.parentRunId = '{result.parent_run_id}'"),
        key=lambda r: int(r.data.tags["mlflow_hvd.sweep.trial"]))
    assert {first.info.status, second.info.status} == {"FINISHED"}
    assert max(first.info.start_time, second.info.start_time) < min(
        first.info.end_time, second.info.end_time)  # at once
    for trial in (first, second):  # each its own trial's result
        x = float(trial.data.params["x"])
        assert trial.data.metrics["val_loss"] == pytest.approx((x - 0.3) ** 2 + 1 / 3,
                                                               abs=1e-5)
    wait_until(lambda: nothing_running(server), 20, "no job left running on the server")


def test_an_elastic_job_runs_on_the_slots_probes_find_and_splits_its_data_over_them(
        connect: Any, store: str) -> None:
    """np=6, min_np=3 on the server's 4 slots: a Connect client cannot count slots, so
    barrier probes of 3 and 4 no-op tasks find them; the attempt runs on 4 ranks, each
    with a quarter of the rows."""
    runner = HorovodRunner(np=6, spark=connect,
                           job=JobConfig(min_np=3, max_failures=1, slot_timeout=5))
    ranks = runner.run(workers.shard_census, data=frame(connect, 400, 4), batch_size=10)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["rows"] for r in ranks] == [100] * 4
    history = mlflow.MlflowClient().get_metric_history(runner.last_run_id,
                                                       "mlflow_hvd.world_size")
    assert [(m.step, m.value) for m in history] == [(0, 4.0)]


def test_a_failed_attempt_is_retried_with_new_ranks_fed_again(connect: Any) -> None:
    runner = HorovodRunner(np=2, spark=connect, job=JobConfig(max_failures=1),
                           tracking=TrackingConfig(track=False))
    ranks = runner.run(workers.census_after_a_failed_attempt, data=frame(connect, 300, 3))
    assert [r["rows"] for r in ranks] == [ranks[0]["rows"]] * 2
    assert len(set(ranks[0]["ids"]) | set(ranks[1]["ids"])) == 2 * ranks[0]["rows"]


def test_a_failing_rank_is_named_and_its_stage_interrupted_on_the_server(
        server: ConnectServer, connect: Any) -> None:
    runner = HorovodRunner(np=2, spark=connect, tracking=TrackingConfig(track=False))
    with pytest.raises(WorkerFailedError) as info:
        runner.run(workers.raise_on_rank_1)
    assert str(info.value).startswith("Rank 1 on host "), info.value
    assert "ValueError: boom from rank 1" in str(info.value)
    wait_until(lambda: nothing_running(server), 20, "the server's barrier stage to end")


def test_a_job_past_its_timeout_is_interrupted_on_the_server(
        server: ConnectServer, connect: Any) -> None:
    import threading

    runner = HorovodRunner(np=2, spark=connect, tracking=TrackingConfig(track=False),
                           job=JobConfig(timeout=10, stop_grace=2))
    ended: dict[str, Any] = {}

    def run() -> None:
        started = time.monotonic()
        try:
            runner.run(workers.sleep_forever)
        except Exception as exc:
            ended["error"] = exc
        ended["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_until(server.running_jobs, 10, "the barrier stage running on the server")
    thread.join(60)
    assert isinstance(ended.get("error"), RunTimeoutError), ended
    assert ended["seconds"] < 10 + 20
    wait_until(lambda: nothing_running(server), 20, "the server's barrier stage to end")


@pytest.fixture()
def thin_archive(tmp_path: Path) -> str:
    """A real venv packed by ``python -m mlflow_hvd.cli.pack_env``, made from the base
    interpreter: its site-packages holds one ``.pth`` that adds this venv's (the server's
    executors are on this machine), so the archive is kilobytes, not this venv's gigabytes."""
    venv = tmp_path / "thin"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)],
                   check=True, timeout=120)
    site = sysconfig.get_paths()["purelib"]
    (venv / Path(site).relative_to(sys.prefix) / "driver.pth").write_text(
        f"import site; site.addsitedir({site!r})\n")
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "mlflow_hvd.cli.pack_env",
                           "--json"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MLFLOW_HVD_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    return str(json.loads(done.stdout)["archive"])


def test_an_environment_shipped_to_a_connect_session_is_what_its_ranks_run(
        server: ConnectServer, connect: Any, thin_archive: str, tmp_path: Path) -> None:
    """The archive goes up as the session's artifact, every executor unpacks it in the
    session's directory and the session's Python workers (so the ranks) run its
    interpreter; the server's other sessions keep theirs. Once per session: a second run
    uploads nothing, another archive for the same session is refused."""
    from pyspark.sql.connect.session import SparkSession

    from mlflow_hvd import ClusterConfig
    from mlflow_hvd.errors import ConfigurationError

    session = SparkSession.builder.remote(server.url).create()
    try:
        runner = HorovodRunner(np=2, spark=session, tracking=TrackingConfig(track=False),
                               cluster=ClusterConfig(ship_environment=thin_archive))
        ranks = runner.run(workers.interpreter_everywhere)
        assert [r["rank"] for r in ranks] == [0, 1]
        for rank in ranks:
            # <executor work dir>/<the session's directory>/environment: the artifact
            assert Path(rank["prefix"]).name == "environment", rank
            assert rank["executable"] == str(Path(rank["prefix"]) / "bin" / "python")
        again_ranks = runner.run(workers.interpreter_everywhere)  # nothing uploaded again
        assert {r["prefix"] for r in again_ranks} == {r["prefix"] for r in ranks}
        other = tmp_path / "other.tar.gz"
        shutil.copy(thin_archive, other)
        again = HorovodRunner(np=2, spark=session, tracking=TrackingConfig(track=False),
                              cluster=ClusterConfig(ship_environment=str(other)))
        with pytest.raises(ConfigurationError, match=(
                rf"^this Spark Connect session was given the environment {thin_archive} "
                rf"before and a session's artifacts cannot be replaced: ship {other} with a "
                r"new session")):
            again.run(workers.interpreter_everywhere)
    finally:
        session.stop()

    def where(batches: Any) -> Any:
        import os
        import sys

        import pyarrow as pa

        for _ in batches:
            yield pa.RecordBatch.from_pylist([{"prefix": sys.prefix, "cwd": os.getcwd()}])

    # the module's session: the server's interpreter, in a directory of its own
    seen = connect.range(0, 2, 1, 2).mapInArrow(where, "prefix string, cwd string").collect()
    assert {row.prefix for row in seen} == {sys.prefix}
    assert not {row.cwd for row in seen} & {str(Path(r["prefix"]).parent) for r in ranks}
