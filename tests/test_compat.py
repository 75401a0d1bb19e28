"""Unsupported versions are refused before anything runs, with the version found and the
supported range. Versions come from real package metadata: the tests put a distribution of
another version first on ``sys.path`` (a ``.dist-info`` directory, as pip writes it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlflow_hvd.common.compat import PYSPARK, TENSORFLOW
from mlflow_hvd.errors import UnsupportedVersionError


@pytest.mark.parametrize(("spec", "found", "ok"), [
    (PYSPARK, "3.4.1", False), (PYSPARK, "3.5.0", True), (PYSPARK, "3.5.7", True),
    (PYSPARK, "4.3.0", True), (PYSPARK, "4.3.1rc1", True), (PYSPARK, "4.4.0", False),
    (TENSORFLOW, "2.15.1", False), (TENSORFLOW, "2.16.0", True), (TENSORFLOW, "2.18.1", True),
    (TENSORFLOW, "2.19.1", True), (TENSORFLOW, "2.21.0", True), (TENSORFLOW, "2.22.0", False),
    (TENSORFLOW, "not-a-version", False),
])
def test_ranges(spec: object, found: str, ok: bool) -> None:
    assert spec.admits(found) is ok  # type: ignore[attr-defined]


def test_the_refusal_names_the_version_found_and_the_range() -> None:
    with pytest.raises(UnsupportedVersionError, match=(
        r"^pyspark 3\.4\.1 \(the driver's\) is not supported: mlflow_hvd works with pyspark "
        r">=3\.5,<4\.4 \(.*\)\. Install a version in that range$"
    )):
        PYSPARK.check("3.4.1", " (the driver's)")
    PYSPARK.check(None)  # not installed: nothing to check


def _fake_distribution(folder: Path, name: str, version: str) -> Path:
    info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return folder


def _python(code: str, path: Path | None, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    prefix = f"import sys; sys.path.insert(0, {str(path)!r})\n" if path else ""
    import os

    return subprocess.run([sys.executable, "-c", prefix + code], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})}, cwd=cwd)


def test_run_refuses_a_pyspark_outside_the_range_before_starting_anything(
    tmp_path: Path,
) -> None:
    fake = _fake_distribution(tmp_path / "site", "pyspark", "3.4.1")
    proc = _python(
        "from mlflow_hvd import HorovodRunner, UnsupportedVersionError, TrackingConfig\n"
        "try:\n"
        "    HorovodRunner(np=2, tracking=TrackingConfig(track=False)).run(print)\n"
        "except UnsupportedVersionError as exc:\n"
        "    print('REFUSED', exc)\n"
        "import sys; print('SPARK', 'pyspark.sql' in sys.modules)\n", fake, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "REFUSED pyspark 3.4.1 (the driver's) is not supported" in proc.stdout
    assert "SPARK False" in proc.stdout  # refused before any SparkSession


def test_run_refuses_legacy_keras_in_the_drivers_environment(tmp_path: Path) -> None:
    proc = _python(
        "from mlflow_hvd import HorovodRunner, UnsupportedVersionError, TrackingConfig\n"
        "try:\n"
        "    HorovodRunner(np=-2, tracking=TrackingConfig(track=False)).run(print)\n"
        "except UnsupportedVersionError as exc:\n"
        "    print('REFUSED', exc)\n", None, {"TF_USE_LEGACY_KERAS": "1"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("REFUSED TF_USE_LEGACY_KERAS=1 in the driver's environment makes tf.keras Keras 2 "
            "(tf_keras): mlflow_hvd works with Keras 3") in proc.stdout


def test_the_keras_layer_refuses_legacy_keras_before_importing_tensorflow() -> None:
    proc = _python(
        "import sys\n"
        "try:\n"
        "    import mlflow_hvd.keras\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
        "print('TF', 'tensorflow' in sys.modules)\n", None, {"TF_USE_LEGACY_KERAS": "true"})
    assert "UnsupportedVersionError TF_USE_LEGACY_KERAS=true in this process's environment" \
        in proc.stdout, proc.stderr[-2000:]
    assert "TF False" in proc.stdout


def test_a_rank_refuses_a_tensorflow_outside_the_range_at_its_import(tmp_path: Path) -> None:
    """The rank's import guard reads the version when TensorFlow is first imported."""
    fake = _fake_distribution(tmp_path / "site", "tensorflow", "2.22.0")
    proc = _python(
        "from mlflow_hvd.rank import keras_guard\n"
        "keras_guard.install()\n"
        "try:\n"
        "    import tensorflow\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n", fake)
    assert ("IncompatibleImportError TensorFlow 2.22.0 (in this rank) is not supported: "
            "mlflow_hvd works with TensorFlow >=2.16,<2.22") in proc.stdout, proc.stderr[-2000:]


def test_tensorflow_2_20_beside_protobuf_7_is_refused_naming_the_fix(tmp_path: Path) -> None:
    """2.20's metadata admits protobuf 7; its generated protos (protobuf 5.28) do not."""
    site = _fake_distribution(tmp_path / "site", "tensorflow", "2.20.0")
    _fake_distribution(site, "protobuf", "7.36.2")
    proc = _python(
        "from mlflow_hvd.common import compat\n"
        "try:\n"
        "    compat.check_driver(-2)\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n", site)
    assert proc.stdout.strip() == (
        "UnsupportedVersionError TensorFlow 2.20.0 (the driver's, which local ranks share) does "
        "not work with protobuf 7.36.2: its protos were generated by protobuf 5.28, two majors "
        "older than the runtime. Install 'protobuf<7' (pip install 'protobuf>=5.28,<7'), or "
        "TensorFlow 2.21"), proc.stderr[-2000:]
    for fine in ("6.33.5", "5.29.6"):
        ok = _fake_distribution(tmp_path / fine, "tensorflow", "2.20.0")
        _fake_distribution(ok, "protobuf", fine)
        proc = _python("from mlflow_hvd.common import compat\n"
                       "compat.check_tensorflow(compat.TENSORFLOW.installed()); print('ok')", ok)
        assert proc.stdout.strip() == "ok", proc.stderr[-2000:]


def _fake_horovod(site: Path, version: str, gloo: bool, launcher: bool = True) -> Path:
    """A Horovod package of ``version`` whose ``horovod.tensorflow`` reports ``gloo`` from
    ``gloo_built()`` and has no compiled extension; with the real ``horovod.runner`` (the
    launcher the driver uses) if ``launcher``."""
    import importlib.util

    _fake_distribution(site, "horovod", version)
    (site / "horovod" / "tensorflow").mkdir(parents=True)
    if launcher:
        real = importlib.util.find_spec("horovod")
        assert real is not None and real.submodule_search_locations
        for name in ("runner", "common"):  # the launcher and what it imports
            (site / "horovod" / name).symlink_to(
                Path(next(iter(real.submodule_search_locations))) / name)
    (site / "horovod" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (site / "horovod" / "tensorflow" / "__init__.py").write_text(
        f"def gloo_built():\n    return {gloo}\n")
    return site


def test_run_refuses_a_horovod_it_cannot_drive_naming_the_build_command(
    tmp_path: Path,
) -> None:
    fake = _fake_horovod(tmp_path / "site", "0.27.0", gloo=True)
    proc = _python(
        "from mlflow_hvd import HorovodRunner, UnsupportedVersionError, TrackingConfig\n"
        "try:\n"
        "    HorovodRunner(np=-2, tracking=TrackingConfig(track=False)).run(print)\n"
        "except UnsupportedVersionError as exc:\n"
        "    print('REFUSED', exc)\n", fake, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("REFUSED Horovod 0.27.0 (the driver's) is not supported: mlflow_hvd works with "
            "Horovod >=0.28.1,<0.28.2") in proc.stdout, proc.stdout
    assert "Run `python -m mlflow_hvd.cli.horovod`" in proc.stdout


def test_a_rank_refuses_a_horovod_built_without_gloo_at_its_import(tmp_path: Path) -> None:
    fake = _fake_horovod(tmp_path / "site", "0.28.1", gloo=False)
    proc = _python(
        "from mlflow_hvd.rank import keras_guard\n"
        "keras_guard.install()\n"
        "try:\n"
        "    import horovod.tensorflow\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n", fake)
    assert (f"IncompatibleImportError Horovod at {tmp_path / 'site' / 'horovod' / 'tensorflow'} "
            "was built without Gloo, which mlflow_hvd's ranks use (no MPI). Rebuild it with "
            "`python -m mlflow_hvd.cli.horovod --rebuild`") in proc.stdout, proc.stderr[-2000:]
    with_gloo = _fake_horovod(tmp_path / "other", "0.28.1", gloo=True)
    proc = _python("from mlflow_hvd.rank import keras_guard\nkeras_guard.install()\n"
                   "import horovod.tensorflow as hvd\nprint('LOADED', hvd.gloo_built())\n",
                   with_gloo)
    assert "LOADED True" in proc.stdout, proc.stderr[-2000:]


def test_the_runner_imports_no_horovod_until_a_job_needs_its_rendezvous(
    tmp_path: Path,
) -> None:
    """Importing the runner (and the distributor) imports neither Horovod nor TensorFlow, so
    a foreign Horovod beside it is named only when run() is called (above)."""
    fake = _fake_horovod(tmp_path / "site", "0.27.0", gloo=True, launcher=False)
    proc = _python("import sys\nfrom mlflow_hvd import HorovodRunner, TorchDistributor\n"
                   "print('LOADED', sorted(m for m in sys.modules\n"
                   "                       if m.split('.')[0] in ('horovod', 'tensorflow')))\n",
                   fake)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LOADED []" in proc.stdout, proc.stdout
