"""End to end on a two-node Spark standalone cluster (see tests/cluster.py).

Ranks run on ``node-a`` and ``node-b`` (own hostnames, addresses and /tmp); the driver,
the master and an ``mlflow server`` with proxied artifacts are on the bridge address. Every
driver is a subprocess whose only cluster settings are Spark's own (``SPARK_CONF_DIR`` with
``spark-defaults.conf``) and ``MLFLOW_TRACKING_URI``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import pytest
from cluster import NODE_IFACE, Cluster, drive, tracking_client
from conftest import REPO
from services import Program, applications, stderr_tail, wait_until

from mlflow_hvd.driver.generation import RETIRE_WAIT

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
TESTS = Path(__file__).resolve().parent
# Deadline assertions are bounds from the configured timeouts, measured inside the driver from
# the call that waits: beyond its deadlines a failing run() submits and cancels a Spark job
# and stops its servers; a lost node also takes Spark's own detection of the dead executor
FAILING_RUN = 20.0
LOST_EXECUTOR = 60.0


@pytest.fixture(scope="module")
def cluster(namespace_cluster: Cluster) -> Iterator[Cluster]:
    """The session's cluster, its nodes holding the driver's environment and checkout."""
    namespace_cluster.use_nodes(bare=False)
    yield namespace_cluster


@pytest.fixture()
def client(cluster: Cluster) -> Iterator[Any]:
    with tracking_client(cluster) as c:
        yield c


@dataclass(frozen=True)
class Batch:
    """What one driver program's six jobs did (:func:`batch`): each case's value or error
    (with the seconds from its ``run()`` to the error), and where they wrote."""

    cases: dict[str, Any]
    store_uri: str  # the SQLite store on the driver's disk (case "driver_disk")
    server_url: str  # a server the nodes cannot reach (case "unreachable")
    experiment: str
    gpu_views: Path


@pytest.fixture(scope="module")
def batch(cluster: Cluster, _loopback_server: Any,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Batch]:
    """Four failure and placement cases, a torch.distributed job and a Petastorm converter's
    job that need no session of their own run as six jobs of one driver program (one Spark
    application: its executors start once), each with the tracking URI its case needs; each
    test below asserts one case."""
    from cluster import STATE

    root = tmp_path_factory.mktemp("cluster-batch")
    views = STATE / "gpu-views"
    shutil.rmtree(views, ignore_errors=True)
    views.mkdir(parents=True)
    store_uri = f"sqlite:///{root}/local.db"
    # reachable from the driver's namespace only: loopback
    if not _loopback_server.is_up():
        _loopback_server.restart()
    experiment = f"unreachable-{root.name}"  # the server is shared with other tests
    out = drive(cluster, f"""
        import mlflow
        from pyspark.sql import SparkSession
        # each node's worker offers two (fake) GPUs: each task is given one
        spark = (SparkSession.builder.config("spark.executor.resource.gpu.amount", "2")
                 .config("spark.task.resource.gpu.amount", "1").getOrCreate())
        result = {{}}

        def case(name, tracking_uri, experiment, runner, fn, **kwargs):
            mlflow.set_tracking_uri(tracking_uri)
            if experiment:
                mlflow.set_experiment(experiment)
            t0 = time.monotonic()
            try:
                result[name] = {{"value": runner.run(fn, **kwargs)}}
            except Exception as exc:
                result[name] = {{"error": type(exc).__name__, "message": str(exc),
                                 "elapsed": time.monotonic() - t0}}

        case("np5", {cluster.mlflow_url!r}, None,
             HorovodRunner(np=5, job=JobConfig(slot_timeout={SLOT_TIMEOUT}), spark=spark),
             workers.collectives)
        case("driver_disk", {store_uri!r}, None, HorovodRunner(np=2, spark=spark),
             workers.metric_then_file)
        case("unreachable", {_loopback_server.url!r}, {experiment!r},
             HorovodRunner(np=2, job=JobConfig(start_timeout={START_TIMEOUT}), spark=spark),
             workers.collectives)
        case("gpus", {cluster.mlflow_url!r}, None,
             HorovodRunner(np=4, spark=spark, tracking=TrackingConfig(track=False)),
             workers.gpu_view, out_dir={str(views)!r})
        ddp = HorovodRunner(np=4, spark=spark)
        case("ddp", {cluster.mlflow_url!r}, "cluster-ddp", ddp, workers.ddp_as_pytorch_writes_it)
        result["ddp_run"] = ddp.last_run_id
        # a Petastorm notebook, imports changed: its cache directory exists on no node, and
        # the converter is a global of this program
        from mlflow_hvd.petastorm import SparkDatasetConverter, make_spark_converter
        from pyspark.sql import functions as F
        spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF,
                       "file:///dbfs/ml/petastorm/cache")
        converter = make_spark_converter(spark.range(0, 4_001, 1, 6).select(
            "id", F.array(*[F.rand(seed=i) for i in range(4)]).alias("x")))
        petastorm = HorovodRunner(np=4, spark=spark)
        case("converter", {cluster.mlflow_url!r}, "cluster-petastorm", petastorm,
             lambda: workers.petastorm_census(converter, batch_size=100, with_tf=False))
        result["converter_run"] = petastorm.last_run_id
        result["driver_host"] = spark.sparkContext.getConf().get("spark.driver.host")
    """, root, timeout=600)
    assert "error" not in out, out  # the program itself, not a case, failed
    yield Batch(out, store_uri, _loopback_server.url, experiment, views)
    shutil.rmtree(views, ignore_errors=True)


def test_ddp_code_on_two_hosts_joins_the_store_on_the_driver_with_torchruns_node_layout(
        batch: Batch, client: Any) -> None:
    """torch.distributed code on four ranks over two hosts (no shared disk): torchrun's
    variables with each host a node (GROUP_RANK), the store on the driver's address, Gloo on
    the interface Horovod's Gloo finds; DDP keeps the ranks equal, and rank 0's checkpoints
    reach the tracking server over HTTP."""
    assert "value" in batch.cases["ddp"], batch.cases["ddp"]
    out = batch.cases["ddp"]["value"]
    ranks = out["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    nodes = sorted({r["host"] for r in ranks}, key=lambda h: min(
        r["rank"] for r in ranks if r["host"] == h))
    assert len(nodes) == 2
    port = ranks[0]["env"]["MASTER_PORT"]
    for r in ranks:
        env = r["env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
            str(r["rank"]), "4", "2"), env
        assert env["GROUP_RANK"] == str(nodes.index(r["host"])), (r["host"], env)
        assert env["GROUP_WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == str(r["local_rank"])
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (batch.cases["driver_host"], port)
        assert env["GLOO_SOCKET_IFNAME"] == NODE_IFACE
    seen = [set(r["seen"]) for r in ranks]
    assert set().union(*seen) == set(range(16)) and sum(len(s) for s in seen) == 16
    assert len({tuple(r["weights"]) for r in ranks}) == 1
    run_id = batch.cases["ddp_run"]
    assert [a.path for a in client.list_artifacts(run_id, "checkpoints")] == [
        "checkpoints/epoch_0", "checkpoints/epoch_1", "checkpoints/epoch_2"]


SLOT_TIMEOUT = 10
START_TIMEOUT = 60  # the job's start deadline (case "unreachable")
REACH = 10  # rank 0's check that it reaches the tracking server


def test_a_petastorm_converter_feeds_each_rank_its_shard_on_its_own_host(
        batch: Batch, client: Any) -> None:
    """The converter a driver program holds as a global, read as Petastorm's converter is
    read: each rank its own shard, written on its own node; the finite passes of all ranks
    read every row once (4,001 rows: the shards cannot all be equal)."""
    assert "value" in batch.cases["converter"], batch.cases["converter"]
    ranks = batch.cases["converter"]["value"]
    assert sorted(r["host"] for r in ranks) == ["node-a", "node-a", "node-b", "node-b"]
    seen = [[i for b in r["torch"] for i in b] for r in ranks]
    assert [len(s) for s in seen] == [r["rows"] for r in ranks]
    assert sorted(i for s in seen for i in s) == list(range(4_001))
    assert all(len(b) == 100 for r in ranks for b in r["torch"][:-1])
    assert ranks[0]["dtypes"] == {"id": "torch.int64", "x": "torch.float32"}
    run_id = batch.cases["converter_run"]
    wait_until(lambda: [d.dataset.name for d in client.get_run(run_id).inputs.dataset_inputs]
               == ["converter_1"], 30, "the converter's dataset input")


def test_np_larger_than_the_cluster_fails_at_once(cluster: Cluster, batch: Batch) -> None:
    out = batch.cases["np5"]
    assert out.get("error") == "InsufficientSlotsError", out
    assert out["elapsed"] < SLOT_TIMEOUT + FAILING_RUN, out
    assert out["message"].startswith(
        f"np=5 needs 5 concurrent barrier task slots but the Spark cluster (master "
        f"{cluster.master_url}) offers 4"
    )


def test_executors_that_cannot_reach_the_tracking_server_fail_before_training(
    batch: Batch,
) -> None:
    out = batch.cases["unreachable"]
    url = batch.server_url
    client = mlflow.MlflowClient(tracking_uri=url)
    (run,) = client.search_runs([client.get_experiment_by_name(batch.experiment).experiment_id])
    assert out.get("error") == "WorkerFailedError", out
    assert out["elapsed"] < START_TIMEOUT + REACH + FAILING_RUN, out
    assert f"cannot reach the MLflow tracking server {url} within {REACH}s" in out["message"]
    assert out["message"].startswith("Rank 0 on host node-")
    assert run.info.status == "FAILED"


def test_a_store_on_the_drivers_disk_gets_metrics_and_refuses_files_clearly(
    batch: Batch,
) -> None:
    """A SQLite store in the driver's /tmp, which the nodes do not see: metrics reach it
    through the driver; a file would land on the node's own disk, so it is refused."""
    out = batch.cases["driver_disk"]
    client = mlflow.MlflowClient(tracking_uri=batch.store_uri)
    (run,) = client.search_runs(["0"])
    folder = run.info.artifact_uri
    assert out.get("error") == "WorkerFailedError", out
    assert out["message"].startswith("Rank 0 on host node-")
    assert (f"cannot see the run's artifact directory {folder}, which is on the driver's disk: "
            "artifacts (checkpoints, the model) would be written to this host's own disk and "
            "lost") in out["message"]
    assert run.data.metrics == {"before_file": 1.0}
    assert run.info.status == "FAILED"


def test_gpus_spark_assigns_on_each_host_are_what_the_ranks_see(batch: Batch) -> None:
    """Each node's worker offers two (fake) GPUs with its own addresses; four ranks, two
    per node, each task given one: every rank's `gpus[local_rank]` is its own task's GPU,
    and no two ranks on a node share one."""
    from cluster import GPUS

    assert batch.cases["gpus"] == {"value": None}, batch.cases["gpus"]
    views = [json.loads((batch.gpu_views / f"rank{r}.json").read_text()) for r in range(4)]
    for node, gpus in GPUS.items():
        here = [v for v in views if v["host"] == node]
        assert sorted(v["MLFLOW_HVD_TASK_DEVICES"] for v in here) == sorted(gpus)
        for view in here:
            visible = view["CUDA_VISIBLE_DEVICES"].split(",")
            assert sorted(visible) == sorted(gpus)
            assert visible[int(view["HOROVOD_LOCAL_RANK"])] == view["MLFLOW_HVD_TASK_DEVICES"]


def test_four_ranks_on_two_hosts_get_horovodrun_s_layout_and_train_on_a_dataframe(
        cluster: Cluster, client: Any, tmp_path: Path) -> None:
    """One driver program, two jobs: horovodrun's layout (and rank 0's timeline through the
    server), then a DataFrame the driver built: each barrier task writes its partition on
    its own node (no shared disk); every rank has the same rows, none twice; the run
    (through the server) records the dataset."""
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments

    out = drive(cluster, """
        from mlflow_hvd import HorovodOptions
        from pyspark.sql import SparkSession, functions as F
        runner = HorovodRunner(np=4, horovod=HorovodOptions(timeline=True))
        result = {"ranks": runner.run(workers.layout_everywhere), "run_id": runner.last_run_id}
        spark = SparkSession.builder.getOrCreate()
        data = spark.range(0, 20_001, 1, 6).select(
            "id", F.array(*[F.rand(seed=i).cast("float") for i in range(4)]).alias("x"))
        runner = HorovodRunner(np=4)
        result["census"] = runner.run(workers.shard_census, data=data, batch_size=100)
        result["data_run_id"] = runner.last_run_id
    """, tmp_path)
    ranks = out["ranks"]
    expected = get_host_assignments([HostInfo("node-a", 2), HostInfo("node-b", 2)], 4)
    got = sorted((r["hostname"], r["rank"], r["local_rank"], r["cross_rank"], r["local_size"],
                  r["cross_size"]) for r in ranks)
    # which physical node hosts task 0 is Spark's choice: compare up to renaming the nodes
    first = ranks[0]["hostname"]
    rename = {first: "node-a", ({"node-a", "node-b"} - {first}).pop(): "node-b"}
    assert sorted((rename[h], *rest) for h, *rest in got) == sorted(
        (s.hostname, s.rank, s.local_rank, s.cross_rank, s.local_size, s.cross_size)
        for s in expected
    )
    assert {r["hostname"] for r in ranks} == {"node-a", "node-b"}
    assert {r["sum"] for r in ranks} == {10.0}  # 1+2+3+4 across both hosts
    assert {r["gloo_iface"] for r in ranks} == {NODE_IFACE}  # found without being told
    run = client.get_run(out["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["mlflow_hvd.spark_master"] == cluster.master_url
    # rank 0's timeline, written on its node (no shared disk), reached the server
    assert [a.path for a in client.list_artifacts(run.info.run_id, "horovod")] == [
        "horovod/timeline.json"]
    timeline = client.download_artifacts(run.info.run_id, "horovod/timeline.json",
                                         str(tmp_path))
    assert any(e.get("name") == "ALLREDUCE" for e in json.loads(Path(timeline).read_text()))
    assert any(app["name"] == "mlflow_hvd" for app in applications(cluster.master_ui))

    census = out["census"]
    assert {r["host"] for r in census} == {"node-a", "node-b"}
    rows = census[0]["rows"]
    assert [r["rows"] for r in census] == [rows] * 4 and {r["steps"] for r in census} == {
        rows // 100}
    seen = [i for r in census for i in r["ids"]]
    assert len(seen) == len(set(seen)) == 4 * rows == 20_001 - census[0]["dropped"]
    run_id = out["data_run_id"]
    assert client.get_run(run_id).data.tags["mlflow_hvd.data.data.rows_per_rank"] == str(rows)
    wait_until(lambda: [d.dataset.name for d in client.get_run(run_id).inputs.dataset_inputs]
               == ["data"], 30, "the run's dataset input")


def test_executors_that_cannot_reach_the_driver_fail_within_the_start_deadline(
    cluster: Cluster, tmp_path: Path
) -> None:
    # the driver binds its own address but tells executors an address nobody has
    start_timeout = slot_timeout = 10
    out = drive(cluster, f"""
        from pyspark.sql import SparkSession
        spark = (SparkSession.builder.config("spark.driver.host", "198.51.100.250")
                 .getOrCreate())
        runner = HorovodRunner(np=2, tracking=TrackingConfig(track=False), spark=spark,
                               job=JobConfig(start_timeout={start_timeout},
                                             slot_timeout={slot_timeout}))
        t0 = time.monotonic()
        result = runner.run(workers.collectives)
    """, tmp_path, timeout=400)
    assert out.get("error") in {"StartTimeoutError", "InsufficientSlotsError", "BackendError"}, out
    assert out["elapsed"] < slot_timeout + start_timeout + FAILING_RUN, out


class Driver(Program):
    """A driver subprocess whose output is read as it comes (to act mid-job), with deadlines;
    use it in a ``with`` block so that it and its ranks end on every exit path."""

    def __init__(self, cluster: Cluster, body: str, cwd: Path, log: Path | None = None,
                 **env: str) -> None:
        script = "\n".join([
            "import json, sys",
            f"sys.path.insert(0, {str(TESTS)!r})",
            "import workers",
            "from mlflow_hvd import ClusterConfig, HorovodRunner, JobConfig, TrackingConfig",
            "runner = HorovodRunner(np=4, job=JobConfig(stop_grace=2))",
            "try:",
            textwrap.indent(textwrap.dedent(body).strip("\n"), "    "),
            "except Exception as exc:",
            "    print('RESULT ' + json.dumps({'error': type(exc).__name__, 'message': str(exc),",
            "                                 'run_id': runner.last_run_id}), flush=True)",
        ])
        # the driver's own log (its lifecycle lines) in ``log``, if given
        self.log = log
        stderr = log.open("w") if log is not None else subprocess.DEVNULL
        try:
            super().__init__([sys.executable, "-c", script], cwd=cwd,
                             env=cluster.driver_env(**env), stderr=stderr)
        finally:
            if log is not None:
                stderr.close()

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the driver's log (for a failing assertion's message)."""
        if self.log is None or not self.log.exists():
            return "(no driver log)"
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def result(self, timeout: float) -> Any:
        code = self.finish(timeout)
        found = [ln for ln in self.lines if ln.startswith("RESULT ")]
        assert found, f"no result; exit {code}; output {self.lines[-20:]}"
        return json.loads(found[-1][len("RESULT "):])


def _no_rank_left(cluster: Cluster) -> None:
    for node in cluster.node_ips:
        assert cluster.rank_pids(node) == [], node


def test_the_rendezvous_answers_only_the_jobs_hosts_and_a_node_lost_mid_job_fails_the_run(
        cluster: Cluster, client: Any, tmp_path: Path) -> None:
    """While 4 ranks on node-a and node-b hold their job, the rendezvous server answers a
    job host and refuses (403) the driver's own host, which runs no rank; the job's
    torch.distributed store keeps a job host's connection open and closes, unread, those
    of the driver's own host and of a third namespace host routed to the driver (a
    "laptop"). Then node-b dies: the run fails naming it."""
    from cluster import PREFIX, laptop_host

    with Driver(cluster, "runner.run(workers.sleep_after_init, store=True)",
                tmp_path) as driver:
        for _ in range(4):  # every rank joined the job
            line = driver.wait_for_line(" up", 240)
        host, port = line.split("rendezvous at ", 1)[1].split(";")[0].rsplit(":", 1)
        assert host == cluster.driver_ip  # where it listens: the driver's address
        ask = ("import http.client as h; c = h.HTTPConnection({!r}, {}, timeout=10); "
               "c.request('GET', '/global/none'); print('STATUS', c.getresponse().status)")
        job_host = cluster.run_in("node-a", sys.executable, "-c", ask.format(host, port))
        assert "STATUS 404" in job_host.stdout, job_host.stderr  # answered: not there
        stranger = subprocess.run([sys.executable, "-c", ask.format(host, port)],
                                  capture_output=True, text=True, timeout=60)
        assert "STATUS 403" in stranger.stdout, stranger.stderr
        # the store: a job host's connection waits for its request (open after 3 s)
        store_host, store_port = line.split("store at ", 1)[1].rsplit(":", 1)
        assert store_host == cluster.driver_ip
        knock = ("import socket; s = socket.create_connection("
                 f"({store_host!r}, {int(store_port)}), timeout=10); "
                 "s.settimeout(3)\ntry: print('READ', s.recv(1))\n"
                 "except TimeoutError: print('OPEN')")
        member = cluster.run_in("node-a", sys.executable, "-c", knock)
        assert "OPEN" in member.stdout, (member.stdout, member.stderr)
        here = subprocess.run([sys.executable, "-c", knock], capture_output=True, text=True,
                              timeout=60)
        assert "READ b''" in here.stdout, (here.stdout, here.stderr)  # closed unread
        with laptop_host() as (host_ip, laptop_ip):
            subprocess.run(["ip", "-n", f"{PREFIX}-laptop", "route", "add",
                            f"{cluster.driver_ip}/32", "via", host_ip], check=True, timeout=30)
            laptop = subprocess.run(["ip", "netns", "exec", f"{PREFIX}-laptop",
                                     sys.executable, "-c", knock], capture_output=True,
                                    text=True, timeout=60)
        assert "READ b''" in laptop.stdout, (laptop_ip, laptop.stdout, laptop.stderr)
        t0 = time.monotonic()
        cluster.kill_node("node-b")
        try:
            out = driver.result(timeout=180)
            elapsed = time.monotonic() - t0
        finally:
            cluster.restart_node("node-b")
    # stop_grace=2 (Driver) for the surviving ranks, after Spark saw the executor die
    assert elapsed < 2 + RETIRE_WAIT + LOST_EXECUTOR + FAILING_RUN, elapsed
    assert out["error"] in {"WorkerFailedError", "BackendError"}, out
    assert "on node-b" in out["message"], out["message"]
    assert client.get_run(out["run_id"]).info.status == "FAILED"
    assert not [a for a in applications(cluster.master_ui) if a.get("state") == "RUNNING"]
    _no_rank_left(cluster)


def test_a_rank_killed_on_node_b_and_the_run_resumed_on_two_ranks(
        cluster: Cluster, client: Any, tmp_path: Path) -> None:
    run = client.create_run(client.get_experiment_by_name("Default").experiment_id)
    run_id = run.info.run_id
    body = f"""
        sys.path.insert(0, {str(REPO / 'examples')!r})
        import digits_keras
        runner.run(digits_keras.train, epochs=4, log_model=False)
        print('RESULT ' + json.dumps({{'ok': True}}), flush=True)
    """
    with Driver(cluster, body, tmp_path, MLFLOW_RUN_ID=run_id) as driver:
        driver.wait_for_line("<log>: epoch 2/4", 400)  # epoch index 1 ended...
        # ...and its checkpoint is on the server (it is queued when the line prints; the
        # victim may be rank 0 itself, whose queue a SIGKILL takes with it)
        wait_until(lambda: len(client.get_metric_history(run_id, "loss")) >= 2, 120,
                   "epoch index 1's metrics and checkpoint on the server")
        victims = cluster.rank_pids("node-b")
        assert len(victims) == 2, victims  # two ranks per node
        os.kill(victims[0], signal.SIGKILL)
        out = driver.result(timeout=180)
    assert out["error"] == "WorkerFailedError", out
    assert "on host node-b failed (killed by signal SIGKILL) [root cause]" in out["message"]
    assert client.get_run(run_id).info.status == "FAILED"
    done = client.get_metric_history(run_id, "loss")
    assert len(done) >= 2

    # resumed on 2 ranks: the Keras checkpoint of 4 comes back with its learning rate
    # halved, as scale_learning_rate gives 2 ranks (what an elastic job's resize does)
    # (a new Spark application: its executors and their Python workers start again, slowly
    # while the other CI tiers share the two cores, hence the start deadline)
    on_two = body.replace("runner.run(", "HorovodRunner(np=2, driver_log_verbosity='all', "
                                         "job=JobConfig(start_timeout=180)).run(")
    with Driver(cluster, on_two, tmp_path, log=tmp_path / "resumed.log",
                MLFLOW_RUN_ID=run_id, MLFLOW_HVD_LOG_LEVEL="INFO") as resumed:
        out = resumed.result(timeout=600)
        assert out == {"ok": True}, (out, resumed.log_tail())
    assert any("was written by 4 ranks; the learning rate it restored is scaled by 0.5 for 2"
               in line for line in resumed.lines), resumed.lines[-20:]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["mlflow_hvd.resumed_from"].startswith(f"{run_id}@epoch_")
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [0, 1, 2, 3]


def test_an_elastic_job_loses_a_host_goes_on_with_fewer_ranks_and_grows_back(
        cluster: Cluster, client: Any, tmp_path: Path) -> None:
    """np=4, min_np=2, an FSDP2 job (torch.distributed) on a DataFrame, paced epoch by epoch
    through a gate file, with sharded checkpoints (a file per rank, sent through rank 0 to
    the server: the hosts share no disk). node-b dies for good after epoch 1: the job goes
    on on node-a's 2 ranks from epoch 1's checkpoint, resharded (its data split in halves,
    its learning rate halved); node-b comes back: the job grows back to 4 ranks at the next
    checkpoint. Every epoch is logged once, each with the size it ran on; the run FINISHED
    with rank 0's value of the last attempt."""
    from cluster import STATE

    gate = STATE / "elastic-gate"
    gate.write_text("1")
    epochs = 8
    body = f"""
        from pyspark.sql import SparkSession, functions as F
        spark = SparkSession.builder.getOrCreate()
        data = spark.range(0, 2_000, 1, 4).select(
            F.array(*[F.rand(seed=i).cast("float") for i in range(4)]).alias("x"),
            (F.col("id") % 2).cast("int").alias("label"))
        runner = HorovodRunner(np=4, job=JobConfig(min_np=2, max_failures=2, slot_timeout=10,
                                                   grow_interval=1, stop_grace=2))
        value = runner.run(workers.gated_elastic_torch, data=data, epochs={epochs},
                           gate={str(gate)!r})
        print('RESULT ' + json.dumps({{'value': value, 'run_id': runner.last_run_id}}),
              flush=True)
    """

    def history(run_id: str, key: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))

    with Driver(cluster, body, tmp_path, log=tmp_path / "driver.log",
                MLFLOW_HVD_LOG_LEVEL="INFO") as driver:
        driver.wait_for_line("epoch 1 done on 4 ranks", 300)
        run_id = wait_until(lambda: [r.info.run_id for r in client.search_runs(
            ["0"], "tags.`mlflow_hvd.np` = '4'", order_by=["start_time DESC"],
            max_results=1)], 30, "the job's run")[0]
        wait_until(lambda: len(history(run_id, "loss")) == 2, 60, "epoch 1's checkpoint")
        cluster.kill_node("node-b")
        wait_until(lambda: len(history(run_id, "mlflow_hvd.world_size")) >= 2
                   and history(run_id, "mlflow_hvd.world_size")[-1][1] == 2, 240,
                   "an attempt on node-a's 2 ranks")
        gate.write_text("2")
        driver.wait_for_line("epoch 2 done on 2 ranks", 240)
        before = cluster.executor_logs("node-b")
        cluster.restart_node("node-b")
        # the new executor on node-b registered with the driver: Spark counts its slots
        cluster.wait_for_new_executor("node-b", before, 120)
        # and a look of the driver (every grow_interval) found them, as the run records:
        # the next checkpoint (epoch 3's, held at the gate until now) is where it grows back
        wait_until(lambda: [v for _, v in history(run_id, "mlflow_hvd.slots_back")] == [1.0],
                   60, "a look of the driver finding node-b's slots back")
        gate.write_text(str(epochs))
        out = driver.result(timeout=300)
    assert out["value"] == {"size": 4, "rows": [500] * 4}, (out, driver.log_tail())
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [s for s, _ in history(run_id, "loss")] == list(range(epochs))  # each once
    world = [int(v) for _, v in history(run_id, "world")]
    shrunk = world.index(2)
    grown = shrunk + world[shrunk:].index(4)
    assert world == [4] * shrunk + [2] * (grown - shrunk) + [4] * (epochs - grown), world
    assert shrunk == 2 and grown == 4, (world, driver.log_tail())  # at epoch 3's checkpoint
    rows = {4: 500.0, 2: 1000.0}
    assert [v for _, v in history(run_id, "rows")] == [rows[w] for w in world]
    lrs = [v for _, v in history(run_id, "lr")]
    assert lrs == [pytest.approx(0.01 * w) for w in world]  # rescaled on each resume
    sizes = [int(v) for _, v in history(run_id, "mlflow_hvd.world_size")]
    assert sizes[0] == 4 and sizes[-1] == 4 and sizes[-2] == 2, sizes
    for epoch, size in enumerate(world):  # each checkpoint: a file per rank that wrote it
        files = {os.path.basename(a.path) for a in client.list_artifacts(
            run_id, f"checkpoints/epoch_{epoch}/checkpoint.dcp")}
        assert files == {".metadata"} | {f"__{r}_0.distcp" for r in range(size)}, files
    assert not [a for a in applications(cluster.master_ui) if a.get("state") == "RUNNING"]
    _no_rank_left(cluster)


def _holding_the_password(cluster: Cluster, password: str) -> dict[int, str]:
    """Processes on the worker nodes whose command line or environment holds ``password``:
    pid -> their HOROVOD_RANK."""
    import psutil

    found = {}
    for node in cluster.node_ips:
        for pid in cluster.pids(node):
            try:
                proc = psutil.Process(pid)
                env = proc.environ()
                if password in " ".join(proc.cmdline()) or password in "\0".join(
                        f"{k}={v}" for k, v in env.items()):
                    found[pid] = env.get("HOROVOD_RANK", "?")
            except psutil.Error:
                continue
    return found


def test_a_basic_auth_tls_server_from_workers_that_hold_no_credentials(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PyTorch job on 4 ranks over both hosts. The driver alone has the credentials and
    the CA bundle; rank 0 gets them over the job's channel, no other process on the worker
    nodes has them (command lines, environments), nor does the Spark UI's environment
    page. A CA the driver trusts only through REQUESTS_CA_BUNDLE (not a setting rank 0
    receives) fails rank 0 before training."""
    from services import ADMIN_PASSWORD, start_mlflow_server, stop_group

    server, url = start_mlflow_server(cluster.driver_ip, tmp_path / "auth-tls", auth=True,
                                      tls=True)
    ca = tmp_path / "auth-tls" / "tls" / "ca.pem"
    creds = {"MLFLOW_TRACKING_URI": url, "MLFLOW_TRACKING_USERNAME": "admin",
             "MLFLOW_TRACKING_PASSWORD": ADMIN_PASSWORD}
    body = f"""
        sys.path.insert(0, {str(REPO / 'examples')!r})
        import digits_torch, urllib.request
        from pyspark.sql import SparkSession
        spark = SparkSession.builder.config("spark.ui.enabled", "true").getOrCreate()
        runner = HorovodRunner(np=4, spark=spark)
        held = runner.run(workers.log_and_hold, seconds=5)
        held_run = runner.last_run_id
        trained = runner.run(digits_torch.train, epochs=1)
        sc = spark.sparkContext
        page = urllib.request.urlopen(
            f"{{sc.uiWebUrl}}/api/v1/applications/{{sc.applicationId}}/environment").read()
        run_id = runner.last_run_id
        # the same CA through REQUESTS_CA_BUNDLE instead (read at each run, like the rest)
        import os
        os.environ["REQUESTS_CA_BUNDLE"] = os.environ.pop("MLFLOW_TRACKING_SERVER_CERT_PATH")
        print("REFUSAL NEXT", flush=True)
        try:
            runner.run(workers.log_and_hold, seconds=0)
            refused = {{}}
        except Exception as exc:
            refused = {{"error": type(exc).__name__, "message": str(exc)}}
        print('RESULT ' + json.dumps({{"held_run": held_run, "run_id": run_id,
                                      "checksums": trained["checksums"],
                                      "ui_bytes": len(page),
                                      "ui_has_password": {ADMIN_PASSWORD!r}.encode() in page,
                                      "refused": refused}}),
              flush=True)
    """
    try:
        with Driver(cluster, body, tmp_path, MLFLOW_TRACKING_SERVER_CERT_PATH=str(ca),
                    **creds) as driver:
            driver.wait_for_line("<log>: holding", 300)
            holders = _holding_the_password(cluster, ADMIN_PASSWORD)
            import psutil  # the scan sees an environment that holds it: the driver's

            assert psutil.Process(driver.proc.pid).environ()["MLFLOW_TRACKING_PASSWORD"] == (
                ADMIN_PASSWORD)
            out = driver.result(timeout=600)
        assert "error" not in out, out
        # horovod.torch on 4 ranks over two hosts: every rank ends with the same parameters
        assert len(out["checksums"]) == 4 and len(set(out["checksums"])) == 1, out
        # rank 0 set it in its own process (after start: not in its /proc environment)
        assert set(holders.values()) <= {"0"}, holders
        lines = driver.lines[:driver.lines.index("REFUSAL NEXT")]
        said = [ln.split("<log>: ", 1)[1] for ln in lines if "password here" in ln]
        assert sorted(said) == ["password here: False"] * 3 + ["password here: True"]
        assert "[0]<log>: password here: True" in lines
        assert out["ui_bytes"] > 1000 and not out["ui_has_password"]

        # the CA through REQUESTS_CA_BUNDLE: the driver verifies the server, rank 0 cannot
        refused = out["refused"]
        assert refused.get("error") == "WorkerFailedError", (refused, driver.lines[-10:])
        assert "[root cause]: TrackingError: rank 0 on host node-" in refused["message"]
        assert "cannot verify the TLS certificate of the MLflow tracking server" in (
            refused["message"])
        assert "Set MLFLOW_TRACKING_SERVER_CERT_PATH on the driver" in refused["message"]
        # rank 0 stopped before its function ran (the others do not wait for it)
        after = driver.lines[driver.lines.index("REFUSAL NEXT"):]
        assert "[0]<log>: password here" not in " ".join(after)

        for key, value in {**creds, "MLFLOW_TRACKING_SERVER_CERT_PATH": str(ca)}.items():
            monkeypatch.setenv(key, value)  # this process: a third one, with the credentials
        mlflow.set_tracking_uri(url)
        client = mlflow.MlflowClient()
        held = client.get_run(out["held_run"])
        assert held.info.status == "FINISHED" and held.data.metrics["held"] == 1.0
        run = client.get_run(out["run_id"])
        assert run.info.status == "FINISHED"
        assert run.data.tags["mlflow.latest_checkpoint_artifact"] == (
            "checkpoints/epoch_0/checkpoint.pt")
        (model_out,) = run.outputs.model_outputs
        import torch

        model = mlflow.pytorch.load_model(f"models:/{model_out.model_id}")
        assert tuple(model(torch.zeros(2, 1, 8, 8)).shape) == (2, 10)
    finally:
        stop_group(server)
        mlflow.set_tracking_uri(cluster.mlflow_url)


def test_a_pruning_sweep_on_the_cluster(cluster: Cluster, client: Any, tmp_path: Path) -> None:
    """`mlflow run . -e sweep -P prune=median` as documented, with 4 ranks on two hosts,
    tracking over HTTP: a parent run with four nested trials, rank
    0's epoch reports reach the driver from another host, and Keras' fit is stopped on every
    rank by MlflowCallback in the one trial whose learning rate cannot learn; the best
    trial's model becomes the registry's champion."""
    space = tmp_path / "space.json"  # seed 2: 0.01 for trials 0-2, 1e-6 for trial 3
    space.write_text(json.dumps({"learning_rate": ["choice", [0.01, 1e-6]],
                                 "batch_size": ["choice", [32]]}))
    cmd = [sys.executable, "-m", "mlflow", "run", str(REPO), "-e", "sweep", "--env-manager",
           "local", "-P", "max_evals=4", "-P", "np=4", "-P", "epochs=2", "-P", "seed=2",
           "-P", f"space={space}", "-P", "prune=median", "-P", "register_model=digits"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=cluster.driver_env(), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, stderr_tail(proc.stderr)
    assert "registered as version 1 of 'digits': models:/digits@champion" in proc.stdout
    assert "1 pruned, 7 epochs trained, 1 saved" in proc.stdout, proc.stdout[-2000:]
    exp = client.get_experiment_by_name("Default").experiment_id
    (parent,) = client.search_runs([exp], filter_string="tags.`mlflow_hvd.sweep.role` = 'parent'")
    children = sorted(client.search_runs(
        [exp], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"),
        key=lambda r: int(r.data.tags["mlflow_hvd.sweep.trial"]))
    assert parent.info.status == "FINISHED"
    assert parent.data.params["max_evals"] == "4" and parent.data.params["np"] == "4"
    assert parent.data.params["prune"] == "median"
    assert [c.data.tags["mlflow_hvd.sweep.trial"] for c in children] == ["0", "1", "2", "3"]
    assert [c.info.status for c in children] == ["FINISHED"] * 4
    assert {c.data.tags["mlflow_hvd.spark_master"] for c in children} == {cluster.master_url}
    assert [c.data.params["learning_rate"] for c in children] == ["0.01"] * 3 + ["1e-06"]
    assert [c.data.tags.get("mlflow_hvd.sweep.pruned_at_epoch") for c in children] == [
        None, None, None, "1"]
    for child in children:
        steps = [m.step for m in client.get_metric_history(child.info.run_id, "val_loss")]
        assert steps == ([0, 1] if child is not children[3] else [0])
    assert children[3].outputs is None or not children[3].outputs.model_outputs  # skipped
    assert parent.data.metrics["trials_pruned"] == 1
    assert parent.data.metrics["epochs_saved"] == 1
    losses = {c.info.run_id: c.data.metrics["val_loss"] for c in children[:3]}
    best = min(losses, key=losses.__getitem__)
    assert parent.data.tags["mlflow_hvd.sweep.best_run_id"] == best
    assert parent.data.metrics["best_val_loss"] == pytest.approx(losses[best])
    arts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"loss_per_trial.png", "search_space.json", "hyperopt"} <= arts
    # the best trial's model is the registry's champion, served through the tracking server
    champion = client.get_model_version_by_alias("digits", "champion")
    assert (champion.run_id, champion.tags["mlflow_hvd.sweep.run_id"]) == (
        best, parent.info.run_id)
    assert float(champion.tags["mlflow_hvd.sweep.metric_value"]) == pytest.approx(
        parent.data.metrics["best_val_loss"])
    load = subprocess.run(
        [sys.executable, "-c",
         "import sys, mlflow, numpy as np\n"
         f"sys.path.insert(0, {str(REPO / 'examples')!r})\n"
         "import digits_keras\n"
         "m = mlflow.pyfunc.load_model('models:/digits@champion')\n"
         "_, _, x, y = digits_keras.load_data()\n"
         "print('SHAPE', np.asarray(m.predict(x)).shape, len(y))\n"],
        env=cluster.driver_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert load.returncode == 0, load.stderr[-3000:]
    shape, rows = load.stdout.split("SHAPE")[-1].rsplit(" ", 1)
    assert shape.strip() == f"({rows.strip()}, 10)", load.stdout


CONNECT_START = 30  # the Connect client's start deadline (its executors cannot reach it)


def test_a_spark_connect_client_the_executors_cannot_reach_fails_naming_its_address(
        cluster: Cluster, tmp_path: Path) -> None:
    """A laptop (its own namespace, linked to the driver's host only) dials a Spark Connect
    server on the driver's host, whose executors are on the nodes: they have no route to
    the laptop, where the job's channel listens. The job fails within its start deadline,
    naming the laptop's address and what to do. The session is made as users make it,
    and found as the active one (no ``spark=``)."""
    from cluster import PREFIX, laptop_host
    from services import ConnectServer

    server = ConnectServer(cluster.master_url, tmp_path / "connect", host=cluster.driver_ip, conf={
        "spark.driver.host": cluster.driver_ip, "spark.driver.bindAddress": cluster.driver_ip,
        "spark.executor.cores": "2", "spark.executor.memory": "1g",
        "spark.executorEnv.TF_CPP_MIN_LOG_LEVEL": "2"})
    try:
        with laptop_host() as (host_ip, laptop_ip):
            script = textwrap.dedent(f"""
                import json, sys, time
                sys.path.insert(0, {str(TESTS)!r})
                import workers
                from pyspark.sql import SparkSession
                from mlflow_hvd import HorovodRunner, JobConfig, TrackingConfig
                spark = SparkSession.builder.remote("sc://{host_ip}:{server.port}").getOrCreate()
                # a first query, as a laptop's first cell runs: the server's executors are up
                # (on a loaded machine they took longer than the job's slot_timeout, and the
                # job failed for want of slots instead of the address this test is about)
                spark.range(0, 100, 1, 4).count()
                t0 = time.monotonic()
                try:
                    HorovodRunner(np=2, job=JobConfig(start_timeout={CONNECT_START}),
                                  tracking=TrackingConfig(track=False)).run(workers.echo, x=1)
                    out = {{"value": "ran"}}
                except Exception as exc:
                    out = {{"error": type(exc).__name__, "message": str(exc),
                            "elapsed": time.monotonic() - t0}}
                print("RESULT " + json.dumps(out))
            """)
            env = {k: v for k, v in os.environ.items()
                   if k not in ("SPARK_CONF_DIR", "PYSPARK_SUBMIT_ARGS", "MASTER")}
            proc = subprocess.run(["ip", "netns", "exec", f"{PREFIX}-laptop", sys.executable,
                                   "-c", script], capture_output=True, text=True, timeout=300,
                                  env=env, cwd=tmp_path)
    finally:
        server.stop()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, stderr_tail(proc.stderr)
    out = json.loads(lines[-1][len("RESULT "):])
    assert "error" in out, out
    assert out["elapsed"] < CONNECT_START + FAILING_RUN, out
    assert f"cannot reach the mlflow_hvd driver at {laptop_ip}:" in out["message"], out
    assert "network is unreachable" in out["message"], out
    assert (f"On Spark Connect that driver is this client process, at {laptop_ip} (its "
            f"address on the route to the Connect server {host_ip})") in out["message"], out
