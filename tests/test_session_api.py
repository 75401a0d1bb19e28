"""The classic/Connect face over sessions (backends/spark/api.py), on stand-ins for what a
Connect client answers: the choices that need no server."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from mlflow_hvd.backends.spark.api import ConnectApi
from mlflow_hvd.common.network import is_local_address, route_source_or_loopback
from mlflow_hvd.errors import BackendError


def connect_session(server_host: str, conf: dict[str, str]) -> Any:
    """What ConnectApi reads of a Connect session: the host its client dials and the
    session's configuration."""
    return SimpleNamespace(client=SimpleNamespace(host=server_host),
                           conf=SimpleNamespace(getAll=conf))


def test_a_server_dialled_on_loopback_on_this_machine_gives_its_own_driver_host() -> None:
    api = ConnectApi(connect_session("localhost", {"spark.driver.host": "127.0.0.1",
                                                   "spark.master": "local-cluster[2,1,1024]"}))
    assert api.driver_host() == "127.0.0.1"
    assert api.master() == "local-cluster[2,1,1024]"
    unsaid = ConnectApi(connect_session("127.0.0.1", {}))
    assert unsaid.driver_host() == "127.0.0.1" and unsaid.master() == "unknown"


def test_a_server_at_the_end_of_a_tunnel_is_refused_naming_both_hosts() -> None:
    # 198.18.0.0/15 (RFC 2544, benchmarking) is no address of this machine
    api = ConnectApi(connect_session("localhost", {"spark.driver.host": "198.18.0.1",
                                                   "spark.master": "spark://m:7077"}))
    with pytest.raises(BackendError, match=r"^the Spark Connect server is dialled on loopback "
                       r"\(localhost\) but is not on this machine \(its driver host is "
                       r"198\.18\.0\.1\): a tunnel\. Its executors \(master spark://m:7077\)"):
        api.driver_host()


def test_addresses_of_this_machine_and_routes() -> None:
    assert is_local_address("127.0.0.1") and is_local_address("localhost")
    assert not is_local_address("198.18.0.1")
    assert not is_local_address("no-such-host.invalid")
    assert route_source_or_loopback("127.0.0.1") == route_source_or_loopback(
        "localhost") == "127.0.0.1"
    # the route's own source address
    assert is_local_address(route_source_or_loopback("198.18.0.1"))
    assert is_local_address("::1") or not socket.has_ipv6


def test_a_generations_servers_listen_where_its_ranks_dial_or_everywhere_behind_nat() -> None:
    """One choice for the channel, the rendezvous and the torch store: the driver's address
    when it is this machine's, every interface when peers dial a NAT's address."""
    from mlflow_hvd.common.network import listen_address
    from mlflow_hvd.driver.generation import Generation

    assert listen_address("127.0.0.1") == "127.0.0.1"
    assert listen_address("198.18.0.1") == ""  # not here: a NAT's or a proxy's
    for dialled, bound in (("127.0.0.1", "127.0.0.1"), ("198.18.0.1", "0.0.0.0")):
        idle = SimpleNamespace(stop=lambda: None, close=lambda: None, wait=lambda t: True)
        generation = Generation(2, idle, dialled, warm=False)  # type: ignore[arg-type]
        try:
            assert generation.bind_host == (dialled if bound != "0.0.0.0" else "")
            assert generation.rendezvous.address == bound
            with socket.create_connection(("127.0.0.1", generation.port), timeout=5):
                pass  # the channel listens where the ranks dial (loopback is here in both)
        finally:
            generation.close(stop_now=True)


def test_a_configuration_snapshot_reads_like_spark_conf() -> None:
    api = ConnectApi(connect_session("h", {"spark.app.id": "app-1", "spark.task.cpus": "2"}))
    conf = api.conf()
    assert conf.get("spark.task.cpus") == "2" and conf.get("unset", "d") == "d"
    assert sorted(conf.getAll()) == [("spark.app.id", "app-1"), ("spark.task.cpus", "2")]
    assert api.application_id() == "app-1" and api.task_slots() is None


class _Stage:
    """A stand-in for ``session.range(...).mapInArrow(...)``: ``collect`` returns at once,
    or blocks until the stage is interrupted (a cluster without room for the stage)."""

    def __init__(self, fits: bool) -> None:
        self.fits, self.interrupted, self.tags = fits, threading.Event(), []

    def range(self, *args: Any) -> _Stage:
        return self

    def mapInArrow(self, *args: Any, **kwargs: Any) -> _Stage:
        return self

    def collect(self) -> list[Any]:
        if not self.fits:
            self.interrupted.wait(30)
            raise RuntimeError("interrupted")
        return []

    def addTag(self, tag: str) -> None:
        self.tags.append(tag)

    def removeTag(self, tag: str) -> None:
        pass

    def interruptTag(self, tag: str) -> None:
        assert tag in self.tags
        self.interrupted.set()


def test_a_probe_stage_confirms_np_slots_once_or_names_the_wait_and_is_interrupted() -> None:
    from mlflow_hvd.backends.spark.session import probe_slots
    from mlflow_hvd.errors import InsufficientSlotsError

    conf = {"spark.app.id": f"app-{id(object())}", "spark.master": "spark://m:7077"}
    stage = _Stage(fits=True)
    session = connect_session("h", conf)
    session.range, session.addTag, session.removeTag = stage.range, stage.addTag, stage.removeTag
    assert probe_slots(ConnectApi(session), 3, 5) == 3
    assert probe_slots(ConnectApi(session), 3, 5) == 3 and len(stage.tags) == 1  # once
    stuck = _Stage(fits=False)
    session = connect_session("h", {**conf, "spark.app.id": "app-stuck"})
    session.range, session.addTag = stuck.range, stuck.addTag
    session.removeTag, session.interruptTag = stuck.removeTag, stuck.interruptTag
    with pytest.raises(InsufficientSlotsError, match=r"^np=4 needs 4 concurrent barrier task "
                       r"slots, and a barrier stage of 4 no-op tasks on the Spark cluster "
                       r"\(master spark://m:7077\) did not run: not done within 0\.2s"):
        probe_slots(ConnectApi(session), 4, 0.2)
    assert stuck.interrupted.is_set()  # the probe is not left running


class _Uploads:
    """A stand-in Connect session's artifact upload: answers at once, fails, or hangs
    (a network that stalls); remembers the session settings made after it."""

    def __init__(self, how: str, session_id: str) -> None:
        self.how, self.session_id, self.added, self.settings = how, session_id, [], {}
        self.client = SimpleNamespace(host="server")
        self.conf = SimpleNamespace(getAll={"spark.app.id": "app-1"},
                                    set=self.settings.__setitem__)
        self.release = threading.Event()

    def addArtifacts(self, *paths: str, archive: bool = False) -> None:
        if self.how == "hangs":
            self.release.wait(30)
        if self.how == "fails":
            raise RuntimeError("ARTIFACT_TOO_LARGE")
        self.added.append((paths, archive))


def test_an_environment_goes_to_a_connect_session_once_and_its_upload_has_a_deadline(
        tmp_path: Any) -> None:
    from mlflow_hvd.backends.spark.environment import ship_to_connect
    from mlflow_hvd.errors import ConfigurationError

    archive, other = tmp_path / "env.tar.gz", tmp_path / "other.tar.gz"
    archive.write_bytes(b"not one of ours")
    other.write_bytes(b"")
    session = _Uploads("answers", "s-1")
    assert ship_to_connect(ConnectApi(session), str(archive), 10) is None  # unchecked
    assert ship_to_connect(ConnectApi(session), str(archive), 10) is None
    assert session.added == [((f"{archive}#environment",), True)]  # once per session
    assert session.settings == {"spark.sql.execution.pyspark.python":
                                "./environment/bin/python"}
    with pytest.raises(ConfigurationError, match=(
            rf"^this Spark Connect session was given the environment {archive} before")):
        ship_to_connect(ConnectApi(session), str(other), 10)

    hangs = _Uploads("hangs", "s-2")
    try:
        with pytest.raises(BackendError, match=(
                rf"^uploading the environment {archive} to the Spark Connect server server "
                r"did not end within 0\.2s \(environment_timeout\)")):
            ship_to_connect(ConnectApi(hangs), str(archive), 0.2)
    finally:
        hangs.release.set()
    assert hangs.settings == {}  # the workers keep the server's interpreter
    with pytest.raises(BackendError, match=r"^the Spark Connect server server refused the "
                       rf"environment {archive}: ARTIFACT_TOO_LARGE"):
        ship_to_connect(ConnectApi(_Uploads("fails", "s-3")), str(archive), 10)


def test_stop_ends_an_environments_upload_to_a_connect_session_at_once(tmp_path: Any) -> None:
    """Shipping is a start phase: HorovodRunner.stop() (the runner's stop event) ends a
    stalled upload within a fraction of a second, long before environment_timeout; the
    session keeps the server's interpreter."""
    from mlflow_hvd.backends.spark.environment import ship_to_connect
    from mlflow_hvd.errors import JobStopped

    archive = tmp_path / "env.tar.gz"
    archive.write_bytes(b"not one of ours")
    hangs = _Uploads("hangs", "s-stop")
    stop = threading.Event()
    timer = threading.Timer(0.3, stop.set)
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(JobStopped, match=r"^stopped while shipping the environment to the "
                                             r"executors, after 0\.\ds"):
            ship_to_connect(ConnectApi(hangs), str(archive), 60, stop)
        assert time.monotonic() - started < 2
    finally:
        hangs.release.set()
        timer.join()
    assert hangs.settings == {}


class _Option:
    def __init__(self, value: str | None) -> None:
        self._value = value

    def isDefined(self) -> bool:
        return self._value is not None

    def get(self) -> str:
        assert self._value is not None
        return self._value


class _StandInJvm:
    """What the removal watch reads of a classic context's JVM (``_jsc.sc()``): whether it
    stopped, and its status store's executors, which Spark clears when it stops it."""

    def __init__(self) -> None:
        self.executors: list[tuple[str, str, str | None]] = []  # id, host:port, reason
        self.is_stopped = False

    def sc(self) -> Any:
        return self

    def isStopped(self) -> bool:
        return self.is_stopped

    def statusStore(self) -> Any:
        return self

    def executorList(self, active_only: bool) -> Any:
        rows = [SimpleNamespace(id=lambda e=e: e[0], hostPort=lambda e=e: e[1],
                                removeReason=lambda e=e: _Option(e[2]))
                for e in self.executors if not active_only or e[2] is None]
        return SimpleNamespace(size=lambda: len(rows), apply=rows.__getitem__)


class _StandInContext:
    """A classic SparkContext as the watch and ClassicApi read it."""

    master = "spark://m:7077"

    def __init__(self) -> None:
        self._jsc = _StandInJvm()

    def getConf(self) -> Any:
        return SimpleNamespace(get=lambda key, default=None: default, getAll=lambda: [])


def test_why_spark_removed_executors_is_kept_after_it_stops_the_context_and_clears_it() -> None:
    """A master that gives up on an application makes Spark stop the context, whose status
    store (where the reasons were) is cleared a moment later: the watch kept them, and a
    stopped context fails the job with them at once."""
    from mlflow_hvd.backends.spark import removals
    from mlflow_hvd.backends.spark.api import ClassicApi
    from mlflow_hvd.backends.spark.session import refuse_stopped, stopped_message, wait_for_slots

    sc = _StandInContext()
    jvm = sc._jsc
    api = ClassicApi(SimpleNamespace(sparkContext=sc))
    watch = removals.watch(sc)
    assert removals.watch(sc) is watch  # one per context
    assert api.removed_executors() == [] and stopped_message(api, "ran") is None
    refuse_stopped(api, "ran")  # a running context: nothing to refuse
    jvm.executors = [("0", "10.0.0.5:40000", "Unable to create executor due to tar: x: "
                      "Wrote only 3584 of 10240 bytes"), ("1", "10.0.0.6:40000", None)]
    deadline = threading.Event()
    for _ in range(100):  # the watch's own thread looks every PERIOD seconds
        if watch._seen:
            break
        deadline.wait(removals.PERIOD / 4)
    assert watch._seen == {"0": ("10.0.0.5", jvm.executors[0][2])}
    jvm.is_stopped, jvm.executors = True, []  # Spark stops the context and clears the store
    assert api.removed_executors() == [("10.0.0.5", "Unable to create executor due to tar: "
                                        "x: Wrote only 3584 of 10240 bytes")]
    message = ("the Spark application on spark://m:7077 was stopped while the job waited for "
               "2 task slots: Spark could not start executors on 10.0.0.5 (1 tried): Unable "
               "to create executor due to tar: x: Wrote only 3584 of 10240 bytes. The disk of "
               "10.0.0.5 where Spark unpacks the environment shipped to the executors is full")
    with pytest.raises(BackendError) as raised:
        wait_for_slots(api, 2, 600)  # at once, not after the 600 s
    assert str(raised.value).startswith(message)
    other = _StandInContext()
    other._jsc.is_stopped = True
    quiet = ClassicApi(SimpleNamespace(sparkContext=other))
    assert stopped_message(quiet, "ran its barrier stage") == (
        "the Spark application on spark://m:7077 was stopped while the job ran its barrier "
        "stage (a standalone master removes an application whose executors keep failing to "
        "start: the master's and workers' logs say why)")


class _Tagging:
    """What run_stage asks of a session: tagging its work and cancelling it by tag. The
    work here waits until cancelled, as a Spark stage unpacking a large environment does."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.release = threading.Event()

    @contextlib.contextmanager
    def tagged(self, tag: str, description: str) -> Iterator[None]:
        yield

    def cancel(self, tag: str) -> None:
        self.cancelled.append(tag)
        self.release.set()


def test_a_stage_before_the_job_ends_on_stop_and_on_its_deadline_cancelling_its_work() -> None:
    """Shipping and unpacking an environment, probing slots: Spark stages the driver runs
    before the job's own (run_stage). HorovodRunner.stop() (the runner's stop event) ends
    one within a poll, its work cancelled (before, only its deadline did); its deadline
    ends it too, cancelled, with no outcome."""
    from mlflow_hvd.backends.spark.api import run_stage
    from mlflow_hvd.errors import JobStopped

    api, stop = _Tagging(), threading.Event()
    timer = threading.Timer(0.2, stop.set)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(JobStopped, match=r"^stopped while Spark ran 'unpack it' "
                                         r"\(HorovodRunner.stop\)$"):
        run_stage(api, "environment", "unpack it",  # type: ignore[arg-type]
                  lambda: api.release.wait(30), 60, stop)
    assert time.monotonic() - t0 < 5
    assert len(api.cancelled) == 1 and api.cancelled[0].startswith("mlflow-hvd-environment-")
    late = _Tagging()
    outcome = run_stage(late, "slots", "probe", lambda: late.release.wait(30),  # type: ignore[arg-type]
                        0.2, threading.Event())
    assert not outcome.finished and len(late.cancelled) == 1


def test_a_wait_for_task_slots_ends_on_stop() -> None:
    """HorovodRunner.stop() while run() waits for slots a cluster has not registered yet
    (a standalone master declares no size): JobStopped within a poll (before, the wait ran
    to slot_timeout, out of stop()'s reach). A classic session as the wait reads it: its
    master, its settings, its registered slots (none yet), its context running."""
    from mlflow_hvd.backends.spark.session import wait_for_slots
    from mlflow_hvd.errors import JobStopped

    api = SimpleNamespace(remote=False, master=lambda: "spark://master:7077",
                          conf=lambda: {}, task_slots=lambda: 0, stopped=lambda: False)
    stop = threading.Event()
    timer = threading.Timer(0.3, stop.set)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(JobStopped, match=r"^stopped while waiting for 4 task slots "
                                         r"\(HorovodRunner.stop\)$"):
        wait_for_slots(api, 4, 120, stop)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 5
