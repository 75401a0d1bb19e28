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
    (TENSORFLOW, "2.19.0", False), (TENSORFLOW, "not-a-version", False),
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
        "from mlflow_hvd import HorovodRunner, UnsupportedVersionError\n"
        "try:\n"
        "    HorovodRunner(np=2, track=False).run(print)\n"
        "except UnsupportedVersionError as exc:\n"
        "    print('REFUSED', exc)\n"
        "import sys; print('SPARK', 'pyspark.sql' in sys.modules)\n", fake, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "REFUSED pyspark 3.4.1 (the driver's) is not supported" in proc.stdout
    assert "SPARK False" in proc.stdout  # refused before any SparkSession


def test_run_refuses_legacy_keras_in_the_drivers_environment(tmp_path: Path) -> None:
    proc = _python(
        "from mlflow_hvd import HorovodRunner, UnsupportedVersionError\n"
        "try:\n"
        "    HorovodRunner(np=-2, track=False).run(print)\n"
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
    fake = _fake_distribution(tmp_path / "site", "tensorflow", "2.19.0")
    proc = _python(
        "from mlflow_hvd.rank import keras_guard\n"
        "keras_guard.install()\n"
        "try:\n"
        "    import tensorflow\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n", fake)
    assert ("IncompatibleImportError TensorFlow 2.19.0 (in this rank) is not supported: "
            "mlflow_hvd works with TensorFlow >=2.16,<2.19") in proc.stdout, proc.stderr[-2000:]
