"""Shared fixtures: one local-cluster SparkSession per test session, process helpers."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
# The examples are imported by the tests as top-level modules (as their scripts do).
sys.path.insert(0, str(REPO / "examples"))

# Workers and Spark's Python workers must use this interpreter (the project's venv).
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Every JVM the tests start (sessions' drivers and executors, the standalone masters and
# workers, the namespace cluster's nodes, Spark Connect servers) with C1 only and the serial
# collector: the JVMs schedule tasks and pipe bytes for ranks that run on the same two cores,
# and C2's compiler threads and G1's concurrent threads took CPU from them (an A/B of
# tests/test_connect.py: 110 s -> 95 s). Test-only: the product sets C1 for the drivers of
# the sessions it creates (backends/spark/jvm.py) and leaves users' clusters alone.
TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
if TEST_JVM_OPTIONS not in os.environ.get("JAVA_TOOL_OPTIONS", ""):
    os.environ["JAVA_TOOL_OPTIONS"] = " ".join(
        filter(None, [os.environ.get("JAVA_TOOL_OPTIONS"), TEST_JVM_OPTIONS]))

# Count the processes that import TensorFlow (tests/audit/sitecustomize.py); printed at the end.
_TF_LOG = Path(os.environ.setdefault(
    "MLFLOW_HVD_TEST_TF_LOG", f"{os.environ.get('TMPDIR', '/tmp')}/mlflow-hvd-tf-{os.getpid()}.log"
))
_TF_LOG.unlink(missing_ok=True)
# Marks the processes this test session starts: ranks inherit it with the host's environment
# (local ranks from this process, Spark's executors from the JVM started here, drivers and
# nodes from the commands the tests run), so a tier running beside this one, with the same
# interpreter, has workers of its own that :func:`worker_processes` does not count.
SESSION_MARK = "MHVD_TEST_SESSION"
os.environ[SESSION_MARK] = f"{os.getpid()}-{os.urandom(4).hex()}"
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(REPO / "tests" / "audit"), *filter(None, [os.environ.get("PYTHONPATH")])]
)


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """Two real executor JVMs with one core each: ``local-cluster[2,1,1024]``."""
    from pyspark.sql import SparkSession

    from mlflow_hvd.backends.spark import jvm

    session = (
        SparkSession.builder.master("local-cluster[2,1,1024]")
        .appName("mlflow_hvd-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.executorEnv.TF_CPP_MIN_LOG_LEVEL", "2")
        # a Horovod tuning variable set the Spark way: it reaches every rank (test_horovod_knobs)
        .config("spark.executorEnv.HOROVOD_STALL_CHECK_TIME_SECONDS", "120")
        # as HorovodRunner's own sessions start (backends/spark/jvm.py); the executors get
        # the C1-only JIT too: less CPU taken from the ranks on 2 cores
        .config("spark.driver.defaultJavaOptions", jvm.driver_java_options())
        .config("spark.executor.defaultJavaOptions", jvm.C1_ONLY)
        .getOrCreate()
    )
    yield session
    session.stop()


@pytest.fixture(scope="session")
def warm_ranks() -> Iterator[Any]:
    """Two local ranks kept warm for the success-path jobs of the modules that use them
    (``with HorovodRunner``): TensorFlow and Horovod are imported once per tier, not once
    per test or module. Each ``run`` is still its own job and MLflow run (into the store
    current at the call); a job that fails replaces the ranks. The modules that use them
    run last in their tier (:func:`pytest_collection_modifyitems`), so the pair outlives no
    test that checks that no worker is left."""
    from mlflow_hvd import HorovodRunner

    with HorovodRunner(np=-2) as runner:
        yield runner


@pytest.fixture(scope="session")
def namespace_cluster() -> Iterator[Any]:
    """The two-node namespace cluster (tests/cluster.py), started once for the session: the
    cluster modules share it (each picks its nodes: with the driver's environment, or bare)."""
    from cluster import cluster_for_tests

    with cluster_for_tests() as c:
        yield c


@pytest.fixture(scope="session")
def _loopback_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from services import MlflowServer

    server = MlflowServer("127.0.0.1", tmp_path_factory.mktemp("loopback-server"))
    yield server
    server.stop()


@pytest.fixture()
def loopback_server(_loopback_server: Any) -> Iterator[Any]:
    """A real ``mlflow server`` on 127.0.0.1 (SQLite backend, artifacts proxied over HTTP),
    shared by the session: starting one costs 5-20 s here. A test may kill it; it is up
    again for the next test."""
    yield _loopback_server
    if not _loopback_server.is_up():
        _loopback_server.restart()


_EMPTY_STORE: list[tuple[Path, str]] = []  # (database, its experiment 0's artifact root)


def _empty_store() -> tuple[Path, str]:
    """A store as MLflow creates it (every migration run, experiment 0 in it), made once per
    test process: creating one costs 1-2 s of migrations, copying its file milliseconds."""
    if not _EMPTY_STORE:
        import atexit
        import shutil
        import tempfile

        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        folder = Path(tempfile.mkdtemp(prefix="mlflow-hvd-empty-store-"))
        atexit.register(shutil.rmtree, folder, True)
        made = SqlAlchemyStore(f"sqlite:///{folder}/mlflow.db", str(folder / "artifacts"))
        root = made.get_experiment("0").artifact_location
        made.engine.dispose()
        _EMPTY_STORE.append((folder / "mlflow.db", root))
    return _EMPTY_STORE[0]


def sqlite_store(folder: Path) -> str:
    """A new SQLite store in ``folder`` whose artifacts go to ``folder/artifacts``, never into
    the checkout (a SQLite store's default artifact root is ``./mlruns`` of the process that
    creates it; the namespace cluster's nodes see the checkout). It is a copy of an empty
    store MLflow made, experiment 0's artifact location set to this folder's, as MLflow
    would have written it."""
    import shutil
    import sqlite3

    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    empty, empty_root = _empty_store()
    database = folder / "mlflow.db"
    shutil.copyfile(empty, database)
    root = empty_root.replace(str(empty.parent / "artifacts"), str(folder / "artifacts"))
    with contextlib.closing(sqlite3.connect(database)) as db, db:
        changed = db.execute("UPDATE experiments SET artifact_location = ? WHERE "
                             "experiment_id = 0", (root,)).rowcount
    if changed != 1 or root == empty_root:
        raise RuntimeError(f"the empty store's experiment 0 ({empty_root}) was not moved to "
                           f"{folder}")
    uri = f"sqlite:///{database}"
    opened = SqlAlchemyStore(uri, str(folder / "artifacts"))  # MLflow's check of the schema
    assert opened.get_experiment("0").artifact_location == root
    opened.engine.dispose()
    return uri


@pytest.fixture(scope="session", autouse=True)
def session_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Tests that do not pick a store track into one SQLite file of the test session,
    never into the checkout (MLflow's default is ``./mlflow.db`` and ``./mlruns``)."""
    uri = sqlite_store(tmp_path_factory.mktemp("session-store"))
    old = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    yield uri
    mlflow.set_tracking_uri(old)


@pytest.fixture(autouse=True)
def restore_tracking_uri(session_store: str) -> Iterator[None]:
    """Whatever a test sets as the tracking URI ends with it."""
    yield
    mlflow.set_tracking_uri(session_store)


@pytest.fixture()
def store(tmp_path: Path) -> Iterator[str]:
    """A fresh SQLite MLflow store for one test, set as the tracking URI."""
    uri = sqlite_store(tmp_path)
    old = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    yield uri
    mlflow.set_tracking_uri(old)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    every = _TF_LOG.read_text().splitlines() if _TF_LOG.exists() else []
    kinds = (("PyTorch", "torch "), ("PyTorch Lightning", "lightning "))
    tensorflow = [ln for ln in every if not ln.startswith(tuple(p for _, p in kinds))]
    for name, lines in (("TensorFlow", tensorflow),
                        *((n, [ln for ln in every if ln.startswith(p)]) for n, p in kinds)):
        ranks = sum("rank/worker.py" in line or "rank.worker" in line for line in lines)
        terminalreporter.write_line(
            f"{name} was imported by {len(lines)} processes of this session ({ranks} of them "
            f"rank workers); list: {_TF_LOG}"
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In CI (``CI`` set) a skipped test fails the run: every tier must run there. The
    namespace cluster's opt-out (``MLFLOW_HVD_NO_NAMESPACES=1``) is for local runs only."""
    if not os.environ.get("CI"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped:
        names = ", ".join(sorted({r.nodeid for r in skipped})[:20])
        sys.stderr.write(f"\nCI: {len(skipped)} test(s) skipped, which CI counts as failures: "
                         f"{names}\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# Markers follow fixtures: a test that uses one of these is marked without anyone
# remembering to (the tiers of scripts/test_tiers.sh select by marker).
MARKED_BY_FIXTURE = {
    "spark": "spark",  # the shared local-cluster session: JVMs
    "warm_ranks": "ranks",  # Horovod ranks that import TensorFlow
    "namespace_cluster": "cluster",  # the two-node namespace cluster
}


# tests that need a build or devices of their own: run only in their tier, deselected in
# every other (never skipped: a skip would read as a pass nowhere and a failure in CI)
ONLY_IN_TIER = {"gpu_wheel": "new-end-gpu", "gpu": "gpu"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tier = os.environ.get("MLFLOW_HVD_TIER", "")
    elsewhere = [item for item in items
                 if any(item.get_closest_marker(marker) and tier != own
                        for marker, own in ONLY_IN_TIER.items())]
    if elsewhere:
        config.hook.pytest_deselected(items=elsewhere)
        dropped = set(elsewhere)
        items[:] = [item for item in items if item not in dropped]
        config.stash[_ELSEWHERE] = len(elsewhere)
    warm_modules = set()
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            marker = MARKED_BY_FIXTURE.get(fixture)
            if marker is not None and item.get_closest_marker(marker) is None:
                item.add_marker(marker)
            if fixture == "warm_ranks":
                warm_modules.add(item.nodeid.split("::")[0])
    # the modules on the session's warm ranks last, whole and in their order (a stable sort)
    items.sort(key=lambda item: item.nodeid.split("::")[0] in warm_modules)


_ELSEWHERE = pytest.StashKey[int]()


def pytest_report_collectionfinish(config: pytest.Config) -> str | None:
    count = config.stash.get(_ELSEWHERE, 0)
    if not count:
        return None
    return (f"{count} tests of other tiers deselected: the NCCL build's (gpu_wheel: "
            "scripts/end_tier.sh new) and the GPU tier's (gpu: make test-gpu)")


FAST_TIER = os.environ.get("MLFLOW_HVD_TIER") == "fast"


@pytest.fixture(autouse=True)
def _fast_tier_guard() -> Iterator[None]:
    """In the fast tier (``MLFLOW_HVD_TIER=fast``) a test fails when it leaves a JVM running
    under this process (a SparkSession) or when a rank it started imported TensorFlow or
    PyTorch (the audit log grew), naming the marker that moves it to a later tier."""
    if not FAST_TIER:
        yield
        return
    before = len(rank_imports())
    yield
    jvms = [p.pid for p in psutil.Process().children(recursive=True) if _is_java(p)]
    if jvms:
        pytest.fail(f"the fast tier runs no JVM, but this test left one running (pids "
                    f"{jvms}): use the `spark` fixture or mark it `spark`")
    new = rank_imports()[before:]
    if new:
        pytest.fail(f"the fast tier starts no rank that imports TensorFlow or PyTorch, but "
                    f"{len(new)} of this test's did: mark it `ranks` (or use warm_ranks); "
                    f"{new[0]}")


def _is_java(proc: psutil.Process) -> bool:
    try:
        return proc.name() == "java"
    except psutil.Error:
        return False


def rank_imports() -> list[str]:
    """The audit log's lines of rank processes that imported TensorFlow or PyTorch."""
    every = _TF_LOG.read_text().splitlines() if _TF_LOG.exists() else []
    return [ln for ln in every if ("rank/worker.py" in ln or "rank.worker" in ln)
            and not ln.startswith("lightning ")]


def worker_processes() -> list[psutil.Process]:
    """Live mlflow_hvd worker processes of this checkout's interpreter started under this
    test session (another checkout's suite, or another tier, may run at the same time);
    orphans included: the mark is in their environment, not in their parentage."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = proc.info["cmdline"] or []
            ours = bool(cmd) and cmd[0] == sys.executable and "mlflow_hvd.rank.worker" in cmd
            if (ours and proc.info["status"] != psutil.STATUS_ZOMBIE
                    and proc.environ().get(SESSION_MARK) == os.environ[SESSION_MARK]):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def assert_no_workers_left(timeout: float = 20.0) -> None:
    """Poll until no worker process is alive; fail with their pids after ``timeout``."""
    from services import wait_until

    try:
        wait_until(lambda: not worker_processes(), timeout, "the workers to end")
    except TimeoutError:
        pytest.fail(f"worker processes survived the run: {[p.pid for p in worker_processes()]}")


def run_entry_point(module: str, *args: str, path: Path | None = None,
                    env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``module``'s ``main(args)`` in a fresh interpreter (``path`` first on its
    ``sys.path``), as its console script would."""
    code = "import sys; " + (f"sys.path.insert(0, {str(path)!r}); " if path else "") + (
        f"from {module} import main; sys.exit(main({list(args)!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})
