"""A shipped environment on a two-node cluster whose nodes lack it (see tests/cluster.py).

The nodes' workers run in mount namespaces where the checkout, the driver's venv, the
environments ``mlflow run`` creates and this project's caches are covered by empty mounts:
each node has Java, Spark and the base Python (as a cluster image would), nothing else. An
executor that used the driver's ``PYSPARK_PYTHON`` or an editable install fails there; one
running the environment shipped with ``spark.archives`` trains. Tracking goes through the
``mlflow server`` (proxied artifacts): nodes and driver share no disk.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster import Cluster, drive, tracking_client
from conftest import REPO
from services import stderr_tail

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
# the archive stored, not compressed: on one machine gzip costs more than the bytes it saves
STORED = {"MLFLOW_HVD_PACK_COMPRESS_LEVEL": "0"}


@pytest.fixture(scope="module")
def bare(namespace_cluster: Cluster) -> Iterator[Cluster]:
    """The session's cluster, its workers restarted on bare nodes (a module that needs
    them with the environment restarts them again)."""
    namespace_cluster.use_nodes(bare=True)
    yield namespace_cluster


@pytest.fixture()
def client(bare: Cluster) -> Iterator[Any]:
    with tracking_client(bare) as c:
        yield c


def test_the_nodes_lack_the_environment_and_executors_fail_naming_the_interpreter(
        bare: Cluster, tmp_path: Path) -> None:
    """Without an archive the executors start the driver's PYSPARK_PYTHON, which their
    node does not have: one error naming the interpreter and what to do (Spark names no
    host for a failed barrier stage)."""
    for node in bare.node_ips:
        seen = bare.run_in(node, "ls", "-A", str(REPO))
        # covered by an empty mount, or absent (a checkout under /tmp: the node's /tmp is
        # its own)
        assert seen.stdout == "" and (seen.returncode == 0 or "No such file" in seen.stderr), (
            seen)
        assert bare.run_in(node, "test", "-e", sys.executable).returncode == 1
    out = drive(bare, """
        runner = HorovodRunner(np=4, tracking=TrackingConfig(track=False))
        result = runner.run(workers.layout_everywhere)
    """, tmp_path)
    assert out["error"] == "BackendError", out
    assert f"cannot start the Python interpreter {sys.executable} (PYSPARK_PYTHON" in (
        out["message"])
    assert "ship_environment=True" in out["message"]


def _mlflow_run(bare: Cluster, project: Path, cwd: Path, *args: str
                ) -> subprocess.CompletedProcess[str]:
    env = bare.driver_env(**STORED)
    env.pop("PYSPARK_PYTHON")  # as a user's shell has it: the entry point sets its own
    cmd = [sys.executable, "-m", "mlflow"]
    return subprocess.run([*cmd, "run", str(project), *args, "-P", "np=4", "-P", "epochs=1"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=1500)


def _check_run(bare: Cluster, client: Any, run_id: str) -> None:
    """FINISHED with its metric, checkpoint and model through the server, the ranks having
    run in the shipped environment on both nodes; nothing of it on a node's disk."""
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["mlflow_hvd.spark_master"] == bare.master_url
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")
    assert [m.step for m in client.get_metric_history(run_id, "val_loss")] == [0]
    ckpts = [a.path for a in client.list_artifacts(run_id, "checkpoints")]
    assert ckpts == ["checkpoints/epoch_0"]
    # on the server's disk, and on no node's (their /tmp is private, the work dirs hold
    # the unpacked environment but no model)
    stored = {p.name for p in bare.artifact_root.rglob("*") if p.is_file()}
    assert {"checkpoint.keras", "checkpoint_metrics.json", "MLmodel"} <= stored
    for node in bare.node_ips:
        found = bare.run_in(node, "find", "/tmp", str(bare.state / node), "(", "-name",
                            "*.keras", "-o", "-name", "MLmodel", ")", "-print")
        assert found.returncode == 0 and found.stdout == "", (found.stdout, found.stderr)
    (model_out,) = run.outputs.model_outputs
    load = subprocess.run(  # in another process, through the server
        [sys.executable, "-c",
         "import sys, mlflow, numpy as np\n"
         f"sys.path.insert(0, {str(REPO / 'examples')!r})\n"
         "import digits_keras\n"
         f"m = mlflow.pyfunc.load_model('models:/{model_out.model_id}')\n"
         "_, _, x, y = digits_keras.load_data()\n"
         "print('SHAPE', np.asarray(m.predict(x)).shape, len(y))\n"],
        env=bare.driver_env(), capture_output=True, text=True, timeout=300)
    assert load.returncode == 0, load.stderr[-3000:]
    shape, rows = load.stdout.split("SHAPE")[-1].rsplit(" ", 1)
    assert shape.strip() == f"({rows.strip()}, 10)", load.stdout


def _shipped_prefixes(bare: Cluster) -> list[str]:
    """The unpacked archives the nodes' executors hold (``.../environment``)."""
    found = []
    for node in bare.node_ips:
        out = bare.run_in(node, "find", str(bare.state / node / "work"), "-maxdepth", "3",
                          "-name", "environment")
        found += out.stdout.split()
    return found


@pytest.mark.timeout(1500)  # the environment made, packed and unpacked (~5-8 min)
def test_mlflow_run_as_typed_ships_the_environment_it_created_and_pack_env_finds_it(
        bare: Cluster, client: Any, tmp_path: Path) -> None:
    """`mlflow run . -P np=4` (MLflow's virtualenv manager): the environment MLflow made on
    the driver is packed, shipped to both nodes and trains there; then the same
    environment, used as one's own, finds that archive with the documented command."""
    # a path no earlier run installed into MLflow's environment (it outlives the run, and
    # pytest's numbered temporary directories repeat once /tmp is cleaned)
    project = tmp_path / f"project-{uuid.uuid4().hex[:8]}"
    shutil.copytree(REPO, project, ignore=shutil.ignore_patterns(
        ".venv*", ".git", "__pycache__", "*.db", "mlruns", ".*_cache", "*.egg-info"))
    proc = _mlflow_run(bare, project, project)
    assert proc.returncode == 0, stderr_tail(proc.stderr)
    # the entry point completed the environment MLflow made (python_env.yaml's, through
    # pyenv; reused by later runs) with this copy of the project and Horovod
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("mlflow_hvd: installed ")]
    prefix = Path(line.rsplit(" into ", 1)[1])
    assert line == f"mlflow_hvd: installed {project} (editable) into {prefix}"
    assert prefix.name.startswith("mlflow-") and prefix != Path(sys.prefix)
    marker = json.loads((prefix / ".mlflow_hvd-horovod.json").read_text())
    assert (marker["horovod"], marker["python"]) == ("0.28.1", "3.11")
    (run,) = client.search_runs([client.get_experiment_by_name("Default").experiment_id],
                                filter_string="tags.`mlflow.project.env` = 'virtualenv'")
    _check_run(bare, client, run.info.run_id)
    assert run.data.params["ship_environment"] == "auto"
    assert run.data.tags["mlflow_hvd.np"] == "4"
    assert run.data.tags["mlflow_hvd.horovod_version"] == "0.28.1"
    assert len(_shipped_prefixes(bare)) == 2  # one executor per node unpacked it

    # the same environment as a user's own: the pack command finds the archive made above
    # (`--env-manager local -P ship_environment=<archive>` then ships it by path, as the
    # entry point did by itself here)
    pack = subprocess.run([str(prefix / "bin" / "python"), "-m", "mlflow_hvd.cli.pack_env",
                           "--json"], capture_output=True, text=True, timeout=900,
                          env={**os.environ, **STORED})
    assert pack.returncode == 0, pack.stderr
    packed = json.loads(pack.stdout)
    assert packed["reused"] is True, packed
    assert packed["archive"].endswith(".stored.tar.gz"), packed  # as the setting asked
    assert packed["PYSPARK_PYTHON"] == "./environment/bin/python"
