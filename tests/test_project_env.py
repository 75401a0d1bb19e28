"""The MLproject's environment completed in place (mlflow_hvd.cli.project_env), only in
environments MLflow created."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import REPO, run_entry_point

from mlflow_hvd.cli import project_env


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
    proc = run_entry_point("mlflow_hvd.cli.project_env")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    assert sorted(p.name for p in Path(sys.prefix).iterdir()) == before
