"""Installing into environments mlflow_hvd did not make: Horovod built against the installed
TensorFlow (mlflow_hvd.cli.horovod) and the MLproject's environment completed in place
(mlflow_hvd.cli.project_env). Real package metadata, real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from test_compat import _fake_distribution

from mlflow_hvd.cli import horovod, project_env


def _cli(module: str, *args: str, path: Path | None = None,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    code = "import sys; " + (f"sys.path.insert(0, {str(path)!r}); " if path else "") + (
        f"from {module} import main; sys.exit(main({list(args)!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_an_environment_with_its_horovod_is_seen_as_ready_without_importing_tensorflow() -> None:
    proc = _cli("mlflow_hvd.cli.horovod")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Horovod 0.28.1 for TensorFlow ")
    assert proc.stdout.rstrip().endswith(f"is installed ({Path(sys.prefix) / horovod.MARKER})")
    marker = json.loads((Path(sys.prefix) / horovod.MARKER).read_text())
    assert marker == {"horovod": "0.28.1", "tensorflow": horovod.target().tensorflow,
                      "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
                      "cpu": horovod.cpu_id()}


def test_check_loads_horovod_as_a_rank_does_and_reports_gloo() -> None:
    proc = _cli("mlflow_hvd.cli.horovod", "--check")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == (
        f"Horovod 0.28.1 with Gloo and TensorFlow {horovod.target().tensorflow}")


def test_a_tensorflow_outside_the_range_is_refused_before_any_build(tmp_path: Path) -> None:
    fake = _fake_distribution(tmp_path / "site", "tensorflow", "2.19.0")
    proc = _cli("mlflow_hvd.cli.horovod", path=fake,
                env={"MLFLOW_HVD_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "error: TensorFlow 2.19.0 (installed here) is not supported: mlflow_hvd works with "
        "TensorFlow >=2.16,<2.19 (2.16 is the first whose tf.keras is Keras 3; 2.18 the last "
        "Horovod 0.28.1 builds against). Install a version in that range")
    assert not (tmp_path / "cache").exists()  # nothing was built


def test_only_environments_mlflow_created_are_completed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MLFLOW_ENV_ROOT", str(tmp_path / "envs"))
    assert project_env.mlflow_managed(str(tmp_path / "envs" / "mlflow-3f2a"))
    assert not project_env.mlflow_managed(str(tmp_path / "envs" / "mine"))
    assert not project_env.mlflow_managed(str(tmp_path / "elsewhere" / "mlflow-3f2a"))
    assert not project_env.mlflow_managed(sys.prefix)  # this venv is the user's


def test_the_project_is_recognised_by_where_it_is_installed_from(tmp_path: Path) -> None:
    assert project_env.PROJECT == REPO
    assert project_env.installed_from(REPO)  # `make setup` installs it editable from here
    assert not project_env.installed_from(tmp_path)


def test_in_the_users_own_environment_the_entry_point_only_checks(tmp_path: Path) -> None:
    before = sorted(p.name for p in Path(sys.prefix).iterdir())
    proc = _cli("mlflow_hvd.cli.project_env")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    assert sorted(p.name for p in Path(sys.prefix).iterdir()) == before
