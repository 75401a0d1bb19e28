"""docs/quickstart.md as a newcomer runs it: its ``bash`` blocks, as written, in one shell,
in a fresh copy of the repository, with a ``python3`` that is not this test's venv. The
page builds the wheel and the sdist, installs the wheel into a new venv, builds (or finds in
the cache) Horovod for it and runs examples/quickstart.py; the MLflow run it made is then
read back. (The page's ``console`` block, ``mlflow ui``, is a server: not run.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from services import stderr_tail

# shares nothing with the session (its own copy, venv and job): beside the other tiers
pytestmark = [pytest.mark.slow, pytest.mark.beside]


def page_commands() -> str:
    page = (REPO / "docs" / "quickstart.md").read_text()
    blocks = re.findall(r"^```bash\n(.*?)^```$", page, re.M | re.S)
    assert len(blocks) >= 3, blocks
    return "".join(blocks)


def newcomer_env() -> dict[str, str]:
    """This machine's environment without what the test session adds: no venv on PATH or
    active, no Spark or MLflow settings of the tests."""
    venv_bin = str(Path(sys.prefix) / "bin")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLFLOW_", "PYSPARK_", "SPARK_", "PYTEST", "HOROVOD_"))
           and k not in ("VIRTUAL_ENV", "PYTHONPATH", "COVERAGE_PROCESS_START")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != venv_bin)
    return env


@pytest.mark.timeout(1800)  # the first run on a machine compiles Horovod (~5 min)
def test_the_quickstart_page_installs_the_wheel_and_runs_a_first_job(tmp_path: Path) -> None:
    clone = tmp_path / "mlflow_hvd"
    shutil.copytree(REPO, clone, ignore=shutil.ignore_patterns(
        ".venv*", ".git", "__pycache__", "*.db", "mlruns", ".*_cache", "*.egg-info", "dist",
        "build", "site", "test-output", "hvd-env"))
    try:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", page_commands()], cwd=clone,
                              env=newcomer_env(), capture_output=True, text=True,
                              timeout=1700)
        assert done.returncode == 0, stderr_tail(done.stdout + done.stderr, 6000)
        (line,) = [ln for ln in done.stdout.splitlines()
                   if ln.startswith("rank 0's training accuracy: ")]
        accuracy, run_id = re.fullmatch(
            r"rank 0's training accuracy: ([\d.]+); MLflow run (\w+)", line).groups()
        assert 0.5 < float(accuracy) <= 1.0, line  # 3 epochs of digits learn something

        dist = sorted(p.name for p in (clone / "dist").iterdir())
        assert [n for n in dist if n.endswith(".whl")] == ["mlflow_hvd-0.1.0-py3-none-any.whl"]
        assert "mlflow_hvd-0.1.0.tar.gz" in dist
        # the license travels with both (pyproject's license-files)
        import tarfile
        import zipfile

        with zipfile.ZipFile(clone / "dist" / "mlflow_hvd-0.1.0-py3-none-any.whl") as wheel:
            assert "mlflow_hvd-0.1.0.dist-info/licenses/LICENSE" in wheel.namelist()
        with tarfile.open(clone / "dist" / "mlflow_hvd-0.1.0.tar.gz") as sdist:
            assert "mlflow_hvd-0.1.0/LICENSE" in sdist.getnames()
        python = clone / "hvd-env" / "bin" / "python"
        # -I: the checkout's directory is not on sys.path, as it is not in the job's
        # processes (sys.path[0] is examples/ there): mlflow_hvd is the installed wheel's
        read = subprocess.run([str(python), "-I", "-c", f"""
import json, mlflow, mlflow_hvd
c = mlflow.MlflowClient("sqlite:///mlflow.db")
r = c.get_run({run_id!r})
print(json.dumps({{"module": mlflow_hvd.__file__, "status": r.info.status,
    "np": r.data.tags.get("mlflow_hvd.np"),
    "epochs": [m.step for m in c.get_metric_history(r.info.run_id, "loss")],
    "checkpoints": [a.path for a in c.list_artifacts(r.info.run_id, "checkpoints")]}}))
"""], cwd=clone, env=newcomer_env(), capture_output=True, text=True, timeout=300)
        assert read.returncode == 0, read.stderr[-3000:]
        run = json.loads(read.stdout.splitlines()[-1])
        # the wheel's copy, not the checkout's source
        assert run["module"].startswith(str(clone / "hvd-env" / "lib")), run
        assert run["status"] == "FINISHED" and run["np"] == "2", run
        assert run["epochs"] == [0, 1, 2], run
        assert run["checkpoints"] == ["checkpoints/epoch_0", "checkpoints/epoch_1",
                                      "checkpoints/epoch_2"], run
    finally:
        shutil.rmtree(clone, ignore_errors=True)  # a venv of gigabytes
