"""MLflow finds mlflow_hvd's tracking store, artifact repository and rank registry through
its entry points: declared by the installed package, or by a rank itself when mlflow_hvd is
not installed as a distribution (on PYTHONPATH)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from mlflow_hvd.rank.tracking import plugin

PROBE = textwrap.dedent("""
    import importlib.metadata, json, sys
    import mlflow_hvd.rank.tracking.plugin as plugin

    plugin.registered = lambda: False  # as if mlflow_hvd were not an installed distribution
    plugin.ensure_registered(sys.argv[1])
    ours = sorted((group, ep.name) for group in plugin.ENTRY_POINTS
                  for ep in importlib.metadata.entry_points(group=group)
                  if ep.dist is not None and ep.dist.name == "mlflow_hvd_rank_plugins")
    import mlflow  # reads the entry points now
    from mlflow_hvd import TrackingError

    try:
        mlflow.MlflowClient("mlflow-hvd://abc").get_run("abc")
    except TrackingError as exc:
        said = str(exc)
    print(json.dumps({"ours": ours, "said": said}))
""")


def test_the_installed_package_declares_the_entry_points() -> None:
    assert plugin.registered()


def test_a_rank_declares_them_itself_when_mlflow_hvd_is_not_installed(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    seen = json.loads(out.splitlines()[-1])
    assert seen["ours"] == [["mlflow.artifact_repository", "mlflow-hvd-artifacts"],
                            ["mlflow.model_registry_store", "mlflow-hvd"],
                            ["mlflow.tracking_store", "mlflow-hvd"]]
    # MLflow built mlflow_hvd's store for the scheme: outside a job it says what it is for
    assert seen["said"] == (
        "the MLflow tracking URI mlflow-hvd://abc names the run of a HorovodRunner job that is "
        "not running in this process: mlflow_hvd sets it in ranks while a job runs. Outside a "
        "job, set MLFLOW_TRACKING_URI to your tracking server")
