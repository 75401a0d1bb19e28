"""The environment archive for executors without the driver's environment
(common/env_archive.py, cli/pack_env.py), made from a real venv with a real
editable install and unpacked where the venv and the editable source are not."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from mlflow_hvd.errors import EnvironmentArchiveError
from mlflow_hvd.protocol.environment import FINGERPRINT_FILE, EnvironmentFingerprint

REPO = Path(__file__).resolve().parents[1]
BASE = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
SITE = Path(__import__("venv_pack").__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def venv_with_editable(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A venv (of the base interpreter) with ``demo`` installed editable from a source
    directory, and that directory."""
    root = tmp_path_factory.mktemp("packing")
    source = root / "demo-src"
    (source / "demo").mkdir(parents=True)
    (source / "demo" / "__init__.py").write_text("ANSWER = 42\n")
    (source / "pyproject.toml").write_text(
        '[project]\nname = "demo"\nversion = "0.1"\n'
        '[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n')
    venv = root / "venv"
    subprocess.run([BASE, "-m", "venv", str(venv)], check=True, timeout=300)
    # the build uses this environment's setuptools (the venv's own is too old to build an
    # editable wheel without `wheel`); nothing is downloaded
    build = root / "build-tools"
    build.mkdir()
    for name in ("setuptools", "pkg_resources", "_distutils_hack", "wheel"):
        (build / name).symlink_to(SITE / name)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                    "--no-build-isolation", "--no-index", "--no-deps", "-e", str(source)],
                   check=True, timeout=300, env={**os.environ, "PYTHONPATH": str(build)})
    return venv, source


def _pack(venv: Path, cache: Path) -> dict[str, object]:
    """The pack command, run by the venv's own interpreter (mlflow_hvd, venv-pack and
    packaging visible through PYTHONPATH only: the venv's site-packages is what is
    packed)."""
    shim = cache.parent / "shim"
    if not shim.exists():
        shim.mkdir()
        for name in ("venv_pack", "packaging"):
            (shim / name).symlink_to(SITE / name)
        (shim / "mlflow_hvd").symlink_to(REPO / "mlflow_hvd")
    env = {**os.environ, "PYTHONPATH": str(shim), "MLFLOW_HVD_CACHE": str(cache)}
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "mlflow_hvd.cli.pack_env",
                           "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_the_archive_runs_where_neither_the_venv_nor_the_editable_source_is(
        venv_with_editable: tuple[Path, Path], tmp_path: Path) -> None:
    venv, source = venv_with_editable
    cache = tmp_path / "cache"
    first = _pack(venv, cache)
    assert first["reused"] is False and first["bytes"] > 0
    assert first["spark_conf"] == {"spark.archives": f"{first['archive']}#environment"}
    assert first["base_python"] == BASE and first["PYSPARK_PYTHON"] == "./environment/bin/python"
    with tarfile.open(str(first["archive"])) as tar:
        names = set(tar.getnames())
        tar.extractall(tmp_path / "node" / "environment", filter="tar")
    assert not any("__editable__" in n for n in names), "editable hooks were packed"
    site = next(n for n in names if n.endswith("site-packages/demo/__init__.py"))
    assert site.startswith("lib/python3")
    recorded = EnvironmentFingerprint.loads(
        (tmp_path / "node" / "environment" / FINGERPRINT_FILE).read_text())
    assert recorded.base_python == BASE
    assert "demo==0.1" in recorded.packages and recorded.horovod == ""

    # as on a node without them: the venv and the source moved away
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    shutil.move(str(venv), hidden / "venv")
    shutil.move(str(source), hidden / "demo-src")
    try:
        done = subprocess.run(["./environment/bin/python", "-c",
                               "import sys, demo; print(demo.ANSWER, sys.prefix)"],
                              cwd=tmp_path / "node", capture_output=True, text=True,
                              env={"PATH": os.environ["PATH"]}, timeout=60)
    finally:
        shutil.move(str(hidden / "venv"), venv)
        shutil.move(str(hidden / "demo-src"), source)
    assert done.returncode == 0, done.stderr
    answer, prefix = done.stdout.split()
    assert answer == "42" and prefix.endswith("node/environment")


def test_an_unchanged_environment_reuses_its_archive_and_a_changed_source_packs_again(
        venv_with_editable: tuple[Path, Path], tmp_path: Path) -> None:
    venv, source = venv_with_editable
    cache = tmp_path / "cache"
    first = _pack(venv, cache)
    again = _pack(venv, cache)
    assert again["reused"] is True and again["archive"] == first["archive"]
    init = source / "demo" / "__init__.py"
    original = init.read_text()
    try:
        init.write_text("ANSWER = 43\n")
        changed = _pack(venv, cache)
        init.write_text("ANSWER = 44\n")
        third = _pack(venv, cache)
    finally:
        init.write_text(original)
    assert changed["reused"] is False and changed["archive"] != first["archive"]
    # the two newest archives are kept
    kept = sorted(p.name for p in cache.joinpath("envs").glob("env-*.tar.gz"))
    assert kept == sorted({Path(str(changed["archive"])).name, Path(str(third["archive"])).name})
    with tarfile.open(str(third["archive"])) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("demo/__init__.py"))
        assert tar.extractfile(member).read() == b"ANSWER = 44\n"  # type: ignore[union-attr]
        assert FINGERPRINT_FILE in tar.getnames()


def test_a_python_that_is_not_a_venv_is_refused_naming_it(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLFLOW_HVD_CACHE": str(tmp_path)}
    done = subprocess.run([BASE, "-c", "from mlflow_hvd.common.env_archive import "
                           "pack_environment; pack_environment()"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1
    assert (f"{sys.base_prefix} is not a virtual environment: venv-pack packs venvs"
            in done.stderr), done.stderr[-2000:]


def test_the_driver_reads_what_an_archive_needs_and_a_host_names_what_it_lacks(
        venv_with_editable: tuple[Path, Path], tmp_path: Path) -> None:
    from mlflow_hvd.common.env_archive import fingerprint_of_archive, shipped_archive

    venv, _ = venv_with_editable
    packed = _pack(venv, tmp_path / "cache")
    archive = str(packed["archive"])
    with tarfile.open(archive) as tar:
        assert tar.next().name == FINGERPRINT_FILE  # type: ignore[union-attr]
    needs = fingerprint_of_archive(archive)
    assert needs is not None and needs.base_python == BASE
    with tarfile.open(archive) as tar:  # the space unpacking takes: its files, as recorded
        files = [m for m in tar.getmembers() if m.isfile() and m.name != FINGERPRINT_FILE]
    unpacked = sum(m.size for m in files)
    # counted before packing: venv-pack rewrites the venv's path in its scripts on the way
    assert unpacked > 0 and abs(needs.unpacked_bytes - unpacked) < unpacked / 1000, (
        needs.unpacked_bytes, unpacked)
    assert shipped_archive(f"a.zip#other, file:{archive}#environment") == archive
    assert shipped_archive("a.zip#other") is None
    plain = tmp_path / "plain.tar.gz"
    with tarfile.open(plain, "w:gz") as tar:
        tar.add(__file__, arcname="x.py")
    assert fingerprint_of_archive(str(plain)) is None  # not one of ours: unchecked

    host = dataclasses.replace(needs, python="3.12.3", platform="linux-aarch64 glibc 2.39",
                               extensions=())
    shipped = dataclasses.replace(needs, extensions=("tensorflow",))
    assert shipped.differences(host) == [
        f"python: expected {needs.python}, found 3.12.3",
        f"platform: expected {needs.platform}, found linux-aarch64 glibc 2.39",
        "Horovod's extensions: expected tensorflow, found none",
    ]
    assert needs.differences(needs) == []


def test_a_task_not_running_the_shipped_interpreter_says_so_and_one_shipping_none_checks_nothing(
) -> None:
    from mlflow_hvd.agent.host_check import environment_differences
    from mlflow_hvd.common.environment import current

    assert environment_differences(current(with_packages=False)) == (
        f"interpreter: expected the shipped ./environment/bin/python, found {sys.executable} "
        "(PYSPARK_PYTHON was not the shipped one when the session started)",)
    assert environment_differences(None) == ()


def test_horovods_extensions_are_loaded_once_per_executor_and_a_failure_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host check loads the shipped environment's extensions in a fresh interpreter
    (here: this venv's, which has both), keeps the answer in the executor's working
    directory for the other tasks, and names an extension that does not load."""
    from mlflow_hvd.agent import host_check
    from mlflow_hvd.common.environment import current
    from mlflow_hvd.common.horovod_probe import load_extensions

    shipped = current(with_packages=False)
    assert set(shipped.extensions) == {"tensorflow", "torch"}
    assert host_check.extension_failures(shipped, tmp_path) == ()
    (kept,) = tmp_path.glob(".mlflow-hvd-extensions-*.json")
    assert json.loads(kept.read_text()) == []

    def must_not_load(*args: object) -> None:
        raise AssertionError("loaded again: the executor's answer was not reused")

    monkeypatch.setattr(host_check, "load_extensions", must_not_load)
    assert host_check.extension_failures(shipped, tmp_path) == ()

    ok, missing = load_extensions(("tensorflow", "nosuch"), 300)
    assert ok.ok and ok.describe().startswith("Horovod 0.28.1 with Gloo and TensorFlow 2.")
    assert not missing.ok
    assert missing.describe() == ("horovod.nosuch does not load: ModuleNotFoundError: No "
                                  "module named 'horovod.nosuch'")
    monkeypatch.setattr(host_check, "load_extensions",
                        lambda names, timeout: (missing,) if names == ("nosuch",) else ())
    odd = dataclasses.replace(shipped, extensions=("nosuch",))
    assert host_check.extension_failures(odd, tmp_path) == (
        "Horovod's nosuch extension: horovod.nosuch does not load: ModuleNotFoundError: No "
        "module named 'horovod.nosuch'",)


def test_an_interpreter_that_cannot_start_reports_every_extension_as_not_loaded(
        tmp_path: Path) -> None:
    from mlflow_hvd.common.horovod_probe import load_extensions

    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'no base interpreter here' >&2\nexit 127\n")
    broken.chmod(0o755)
    (check,) = load_extensions(("tensorflow",), 60, python=str(broken))
    assert not check.ok
    assert check.describe() == ("horovod.tensorflow does not load: the interpreter exited "
                                "127: no base interpreter here")


class _FakeContext:
    """Just enough of a SparkContext for the preparation stage's driver-side logic: what
    its tasks answer (or that they never answer) is given."""

    def __init__(self, answers: list[tuple[str, list[str]]] | Exception | None) -> None:
        from types import SimpleNamespace

        self.applicationId = f"app-{id(self)}"
        self.answers, self.cancelled, self.stages = answers, [], 0
        self.release = threading.Event()
        self.jvm_stopped = False  # the JVM's SparkContext.isStopped
        self._jsc = SimpleNamespace(sc=lambda: SimpleNamespace(isStopped=lambda: self.jvm_stopped))

    def setJobGroup(self, group: str, description: str, interruptOnCancel: bool) -> None:
        self.group = group

    def cancelJobGroup(self, group: str) -> None:
        self.cancelled.append(group)
        self.release.set()

    def parallelize(self, items: range, slices: int) -> _FakeContext:
        self.stages += 1
        return self

    def mapPartitions(self, fn: object) -> _FakeContext:
        return self

    def collect(self) -> list[tuple[str, list[str]]]:
        if isinstance(self.answers, Exception):
            raise self.answers
        if self.answers is None:  # an executor still unpacking
            self.release.wait(30)
            raise RuntimeError("cancelled")
        return self.answers


def _classic(context: _FakeContext) -> object:
    from types import SimpleNamespace

    from mlflow_hvd.backends.spark.api import ClassicApi

    return ClassicApi(SimpleNamespace(sparkContext=context))


def test_a_context_spark_stopped_itself_is_not_cancelled_and_hides_no_error() -> None:
    """A standalone master that removes the application (its executors could not start)
    stops the JVM's context; cancelling the job's group there raised IllegalStateException
    in the backend's clean-up, in place of the error that ended the job."""
    live = _FakeContext([])
    api = _classic(live)
    assert not api.stopped()
    api.cancel("job-1")
    assert live.cancelled == ["job-1"]

    def refuse(group: str) -> None:
        raise RuntimeError("Cannot call methods on a stopped SparkContext.")

    ended = _FakeContext([])
    ended.jvm_stopped = True
    ended.cancelJobGroup = refuse  # type: ignore[method-assign]
    api = _classic(ended)
    assert api.stopped()
    api.cancel("job-1")  # nothing left to cancel, nothing raised


def test_executors_unpack_a_shipped_environment_once_under_its_own_deadline() -> None:
    from mlflow_hvd.backends.spark.environment import prepare_executors
    from mlflow_hvd.common.environment import current
    from mlflow_hvd.errors import BackendError, EnvironmentArchiveError

    shipped = current(with_packages=False)
    ready = _FakeContext([("node-a", []), ("node-b", [])])
    prepare_executors(_classic(ready), shipped, 4, 10)
    prepare_executors(_classic(ready), shipped, 4, 10)
    assert ready.stages == 1  # once per application and environment

    unfit = _FakeContext([("node-a", []), ("node-b", ["python: expected 3.11.7, found 3.12.1"])])
    with pytest.raises(EnvironmentArchiveError) as info:
        prepare_executors(_classic(unfit), shipped, 4, 10)
    assert str(info.value) == (
        "the environment shipped to the executors does not fit node-b: python: expected "
        "3.11.7, found 3.12.1. Pack it where the executors' Python and platform are the same "
        "(python -m mlflow_hvd.cli.pack_env), or give the nodes that interpreter")

    stuck = _FakeContext(None)
    with pytest.raises(BackendError) as info:
        prepare_executors(_classic(stuck), shipped, 4, 0.2)
    assert stuck.cancelled == [stuck.group]  # the stage is cancelled, not left running
    assert str(info.value).startswith(
        "the executors did not fetch, unpack and check the shipped environment within 0.2s "
        "(environment_timeout): raise "
        "HorovodRunner(cluster=ClusterConfig(environment_timeout=...))")

    no_base = _FakeContext(RuntimeError(
        'Job aborted due to stage failure: ...\njava.io.IOException: Cannot run program '
        '"./environment/bin/python": error=2, No such file or directory'))
    with pytest.raises(BackendError) as info:
        prepare_executors(_classic(no_base), shipped, 4, 10)
    assert str(info.value).startswith(
        "preparing the shipped environment failed: an executor cannot start the shipped "
        f"environment's interpreter ./environment/bin/python: it is a link to "
        f"{shipped.base_python}, which venv-pack does not copy")


def test_the_compression_level_comes_from_the_environment_and_is_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlflow_hvd.common.env_archive import COMPRESS_ENV, compress_level_setting, suffix

    monkeypatch.delenv(COMPRESS_ENV, raising=False)
    assert compress_level_setting() == 1 and suffix(1) == ".tar.gz"
    monkeypatch.setenv(COMPRESS_ENV, "0")
    assert compress_level_setting() == 0 and suffix(0) == ".stored.tar.gz"
    for bad in ("10", "-1", "fast", "1.5"):
        monkeypatch.setenv(COMPRESS_ENV, bad)
        with pytest.raises(EnvironmentArchiveError, match=(
                rf"^{COMPRESS_ENV}='{re.escape(bad)}': must be a gzip level from 0 to 9")):
            compress_level_setting()


def _archive_of_zeros(path: Path, unpacked: int, recorded: int | None = None) -> Path:
    """An archive as pack_env writes one (its fingerprint first, recording the space it
    takes unpacked, or ``recorded``) holding ``unpacked`` bytes of zeros: kilobytes on
    disk."""
    import io

    from mlflow_hvd.common.environment import current

    record = dataclasses.replace(current(with_packages=False), unpacked_bytes=(
        unpacked if recorded is None else recorded)).dumps()
    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        info = tarfile.TarInfo(FINGERPRINT_FILE)
        info.size = len(record.encode())
        tar.addfile(info, io.BytesIO(record.encode()))
        zeros = tarfile.TarInfo("zeros.bin")
        zeros.size = unpacked
        tar.addfile(zeros, io.BytesIO(bytes(unpacked)))
    return path


def test_a_driver_without_room_to_unpack_the_shipped_environment_is_refused_at_once(
        tmp_path: Path) -> None:
    from mlflow_hvd.backends.spark.boot import check_room_to_unpack

    free = shutil.disk_usage(tmp_path).free
    fits = _archive_of_zeros(tmp_path / "fits.tar.gz", 1 << 20)
    check_room_to_unpack(str(fits), str(tmp_path))
    check_room_to_unpack(str(fits), str(tmp_path / "not-yet"))  # Spark makes it
    # what the archive records, not its bytes, is compared: a record larger than the disk
    huge = _archive_of_zeros(tmp_path / "huge.tar.gz", 1 << 20, recorded=free * 2)
    with pytest.raises(EnvironmentArchiveError) as info:
        check_room_to_unpack(str(huge), str(tmp_path))
    text = str(info.value)
    assert text.startswith(
        f"the environment shipped to the executors ({huge}) takes {free * 2 / 1e9:.2f} GB "
        f"unpacked, and Spark unpacks it on the driver too, in {tmp_path}, where "), text
    assert text.endswith(" GB there, or point SPARK_LOCAL_DIRS at a disk with room"), text
    assert re.search(r"where \d+\.\d\d GB are free: free \d+\.\d\d GB there", text), text
    plain = tmp_path / "plain.tar.gz"  # not packed by mlflow_hvd: nothing recorded, unchecked
    with tarfile.open(plain, "w:gz") as tar:
        tar.add(__file__, arcname="x.py")
    check_room_to_unpack(str(plain), str(tmp_path))


@pytest.mark.slow  # a standalone master and worker of its own (~20 s)
@pytest.mark.timeout(240)  # a hang until environment_timeout (600 s) fails here
def test_a_worker_without_room_for_the_shipped_environment_fails_the_job_at_once_naming_it(
        tmp_path: Path) -> None:
    """A standalone worker unpacks spark.archives for each new executor; on a full disk the
    executor never starts, the master gives up on the application, and Spark says only
    'Master removed our application: FAILED'. The job's error names the host, tar's words
    and the space the environment needs, long before environment_timeout."""
    from services import (
        alive_workers,
        free_port,
        spark_class,
        start,
        start_spark_master,
        stop_group,
        wait_until,
    )

    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("a worker's small disk is a tmpfs mounted by the test: run as root")
        pytest.skip("mounts a tmpfs: needs root")  # local runs only
    work = tmp_path / "work"
    work.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(work)], check=True,
                   timeout=30)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        archive = _archive_of_zeros(tmp_path / "env.tar.gz", 48 << 20)
        master, url, ui = start_spark_master("127.0.0.1", tmp_path)
        procs.append(master)
        procs.append(start([spark_class(), "org.apache.spark.deploy.worker.Worker", url,
                            "--host", "127.0.0.1", "--cores", "1", "--memory", "1g",
                            "--work-dir", str(work), "--webui-port", str(free_port())],
                           tmp_path / "worker.log"))
        wait_until(lambda: alive_workers(ui), 60, "the standalone worker", procs[-1])
        script = f"""
from mlflow_hvd import HorovodRunner
from mlflow_hvd.common.config import ClusterConfig, TrackingConfig
try:
    HorovodRunner(np=1, cluster=ClusterConfig(spark_master={url!r},
                  ship_environment={str(archive)!r}, environment_timeout=600),
                  tracking=TrackingConfig(track=False)).run(lambda: 1)
except Exception as exc:
    print("ERROR", type(exc).__name__, exc)
"""
        env = {**os.environ, "SPARK_LOCAL_DIRS": str(tmp_path / "driver")}
        done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=200)
        (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("ERROR ")]
        assert line.startswith("ERROR BackendError "), line
        # where Spark gives up depends on the machine's speed: during the environment's
        # stage (the job's error is Spark's "Master removed our application"), or before
        # (the session being built, the wait for slots: Spark stopped the application)
        assert ("Master removed our application" in line
                or re.search(r"the Spark application on spark://127\.0\.0\.1:\d+ was stopped ",
                             line)), line
        assert "Spark could not start executors on 127.0.0.1 (" in line, line
        assert re.search(r"Wrote only \d+ of \d+ bytes|No space left on device", line), line
        assert (f"The disk of 127.0.0.1 where Spark unpacks the environment shipped to the "
                f"executors is full: the environment needs {(48 << 20) / 1e9:.2f} GB there. "
                "Free that much in the worker's directory for executors") in line, line
    finally:
        for proc in reversed(procs):
            stop_group(proc)
        subprocess.run(["umount", "--lazy", str(work)], check=False, timeout=30)
