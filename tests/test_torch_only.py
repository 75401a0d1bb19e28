"""A PyTorch user's first steps: ``pip install "<checkout>[torch]"`` into a fresh venv (CPU
PyTorch, no TensorFlow, no Horovod, nothing compiled), then DDP and FSDP jobs under
``HorovodRunner(np=-2)`` and ``HorovodRunner(np=2)`` on a local-cluster Spark session, a
``TorchDistributor`` job, and a function that imports ``horovod.torch``
(tests/torch_only/jobs.py runs them there); then the project's entry point in that
environment (``mlflow run <checkout> --env-manager local -P train=examples/digits_fsdp.py:
train``). Each job's MLflow run is read back; neither Horovod nor TensorFlow may be imported
by the driver or by a rank."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from conftest import REPO
from services import stderr_tail
from test_quickstart import newcomer_env

# shares nothing with the session (its own venv, Spark session and store): beside the others
pytestmark = [pytest.mark.slow, pytest.mark.beside]

# the CPU build of PyTorch this project's lock pins (pip takes it from the machine's links)
TORCH = "torch==2.13.0"


def _torch_only_venv(where: Path) -> Path:
    source = where / "mlflow_hvd"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".venv*", ".git", "__pycache__", "*.db", "mlruns", ".*_cache", "*.egg-info", "dist",
        "build", "site", "test-output", "hvd-env", "tests", "docs", "benchmarks"))
    venv = where / "torch-env"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    done = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet",
                           f"{source}[torch]", TORCH], env=newcomer_env(),
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return venv


@pytest.mark.timeout(1800)
def test_a_pytorch_user_installs_with_pip_and_trains_ddp_and_fsdp_without_horovod(
    tmp_path: Path,
) -> None:
    venv = _torch_only_venv(tmp_path)
    try:
        python = str(venv / "bin" / "python")
        listed = subprocess.run([python, "-m", "pip", "list", "--format=json"],
                                capture_output=True, text=True, timeout=120, check=True)
        names = {p["name"].lower() for p in json.loads(listed.stdout)}
        assert {"torch", "mlflow", "pyspark", "mlflow_hvd"} <= names | {"mlflow-hvd"}
        assert not {n for n in names if n.startswith(("tensorflow", "horovod", "keras"))}
        work = tmp_path / "work"
        work.mkdir()
        done = subprocess.run([python, str(REPO / "tests" / "torch_only" / "jobs.py")],
                              cwd=work, env=newcomer_env(), capture_output=True, text=True,
                              timeout=1500)
        assert done.returncode == 0, stderr_tail(done.stdout + done.stderr, 6000)
        (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        out = json.loads(line.removeprefix("RESULT "))

        for where in ("local", "spark"):
            ddp, fsdp = out[f"{where}_ddp"], out[f"{where}_fsdp"]
            assert ddp == {"world": 2, "start": 0, "same_weights": True, "loaded": []}, ddp
            assert fsdp["loaded"] == [] and fsdp["test_accuracy"] > 0.8, fsdp
            # FSDP: each rank holds half of the parameters' bytes
            assert [h["params"] * 2 for h in fsdp["held"]] == [fsdp["full_bytes"]] * 2, fsdp
        # the local FSDP job's second attempt resumed after epoch 0's sharded checkpoint
        assert (out["local_fsdp"]["start"], out["spark_fsdp"]["start"]) == (1, 0), out
        assert out["distributor"] == {"world": 2, "start": 0, "same_weights": True,
                                      "loaded": []}, out["distributor"]
        assert out["driver_loaded"] == [], out["driver_loaded"]
        # whichever rank fails first is the root cause
        assert re.match(re.escape(
            "Rank X on host localhost failed (exit code 1) [root cause]: ModuleNotFoundError: "
            "No module named 'horovod' - Horovod is not installed in this rank's environment "
            f"({venv}): the training function imports it. Build it there with `python -m "
            "mlflow_hvd.cli.horovod`").replace("X", "[01]"), out["horovod_error"]), \
            out["horovod_error"]

        # the project's entry point in the user's own (this) environment, a PyTorch example
        store = f"sqlite:///{work / 'mlflow.db'}"
        project = subprocess.run(
            [str(venv / "bin" / "mlflow"), "run", str(REPO), "--env-manager", "local",
             "-P", "np=-2", "-P", "epochs=1", "-P", "train=examples/digits_fsdp.py:train"],
            cwd=work, env={**newcomer_env(), "MLFLOW_TRACKING_URI": store,
                           "PATH": f"{venv / 'bin'}:{newcomer_env()['PATH']}"},
            capture_output=True, text=True, timeout=900)
        assert project.returncode == 0, stderr_tail(project.stdout + project.stderr, 4000)
        (project_run,) = re.findall(r"^run (\w+) finished in", project.stdout, re.M)

        client = mlflow.MlflowClient(store)
        assert client.get_run(project_run).info.status == "FINISHED"
        for key, np, backend in (("local_ddp_run", "-2", "local"),
                                 ("spark_ddp_run", "2", "spark"),
                                 ("local_fsdp_run", "-2", "local"),
                                 ("spark_fsdp_run", "2", "spark")):
            run = client.get_run(out[key])
            tags = run.data.tags
            if key == "local_fsdp_run":  # two attempts, the first failed: one run
                assert tags["mlflow_hvd.resumed_from"] == f"{out[key]}@epoch_0", tags
                assert [m.value for m in client.get_metric_history(
                    out[key], "mlflow_hvd.attempt")] == [0.0, 1.0]
            assert run.info.status == "FINISHED", key
            assert (tags["mlflow_hvd.np"], tags["mlflow_hvd.backend"]) == (np, backend), key
            assert (tags["mlflow_hvd.horovod_version"], tags["mlflow_hvd.tensorflow_version"],
                    tags["mlflow_hvd.torch_version"]) == ("", "", "2.13.0+cpu"), key
            assert [m.step for m in client.get_metric_history(out[key], "loss")] == [0, 1], key
            if key == "spark_fsdp_run":  # trained on the DataFrame's shards, every row used
                assert tags["mlflow_hvd.data.data.total_rows"] == str(out["spark_fsdp_rows"])
            kind = "checkpoint.dcp" if "fsdp" in key else "checkpoint.pt"  # FSDP: sharded
            for epoch in (0, 1):
                files = {a.path.rsplit("/", 1)[1]
                         for a in client.list_artifacts(out[key], f"checkpoints/epoch_{epoch}")}
                assert files == {kind, "checkpoint_metrics.json"}, (key, files)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)  # a venv of gigabytes
