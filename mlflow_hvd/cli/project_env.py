"""The first step of every MLproject entry point (:func:`complete`, called by ``cli.train``
and ``cli.sweep`` in their own interpreter): completes the environment ``mlflow run`` made
for this project with what a pip requirements list cannot install.

MLflow's ``virtualenv`` and ``uv`` environment managers create an environment from
``python_env.yaml`` (the locked requirements). Two things are left: this project itself
(installed editable from the directory ``mlflow run`` runs in, so ranks import the same code
as the driver) and Horovod, which must be compiled against the TensorFlow just installed
(:mod:`mlflow_hvd.cli.horovod`: built once per Horovod/TensorFlow/Python/CPU and cached, so a
second environment installs the cached wheel). Both are done only in an environment MLflow
created (``$MLFLOW_ENV_ROOT``, default ``~/.mlflow/envs``, named ``mlflow-<hash>``); with
``--env-manager local`` the current environment is the user's and is only checked. When
nothing is missing this takes a fraction of a second and imports neither TensorFlow nor
MLflow.

    python -m mlflow_hvd.cli.project_env
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import sysconfig
from importlib.metadata import distributions
from pathlib import Path

from mlflow_hvd.cli import horovod
from mlflow_hvd.common import compat
from mlflow_hvd.errors import InstallError, MlflowHvdError

PROJECT = Path(__file__).resolve().parents[2]  # the directory holding mlflow_hvd/


def mlflow_managed(prefix: str = sys.prefix) -> bool:
    """Whether ``prefix`` is an environment MLflow's virtualenv/uv manager created."""
    root = os.environ.get("MLFLOW_ENV_ROOT") or os.path.expanduser("~/.mlflow/envs")
    here = Path(prefix).resolve()
    return here.parent == Path(root).resolve() and here.name.startswith("mlflow-")


def installed_from(project: Path) -> bool:
    """Whether mlflow_hvd is installed editable from ``project`` in this environment's
    site-packages (not the ``.egg-info`` an editable build leaves in the checkout, which the
    current directory would show)."""
    site = sysconfig.get_paths()["purelib"]
    found = list(distributions(name="mlflow_hvd", path=[site]))
    if not found:
        return False
    raw = found[0].read_text("direct_url.json")
    try:
        url = json.loads(raw or "{}")
    except ValueError:
        return False
    editable = bool(url.get("dir_info", {}).get("editable"))
    return editable and url.get("url") == project.as_uri()


def install_project(project: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "install", "--quiet",
           "--no-deps", "-e", str(project)]
    done = subprocess.run(cmd, timeout=600, check=False)
    if done.returncode != 0:
        raise InstallError(f"`{' '.join(cmd)}` failed (exit {done.returncode})")


def complete() -> None:
    """In an environment MLflow created: install this project (editable) and Horovod when
    missing, saying what was installed; in the user's own environment: check the Horovod
    there, if any (a training function of torch.distributed code needs none; one that imports
    Horovod where it is missing fails naming the command that builds it). The entry points
    (``cli.train``, ``cli.sweep``) call it first, in their own interpreter.

    Raises:
        MlflowHvdError: An install failed, or the Horovod here is of another version.
    """
    if mlflow_managed():
        if not installed_from(PROJECT):
            install_project(PROJECT)
            print(f"mlflow_hvd: installed {PROJECT} (editable) into {sys.prefix}", flush=True)
        changed, report = horovod.ensure()
        if changed:
            importlib.invalidate_caches()  # this process imports Horovod next
            print(f"mlflow_hvd: {report}", flush=True)
    elif compat.HOROVOD.installed() is not None:  # none is needed by torch.distributed code
        compat.check_horovod(tensorflow=False, where=f" (in {sys.prefix})")


def main(argv: list[str] | None = None) -> int:
    del argv
    try:
        complete()
    except MlflowHvdError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
