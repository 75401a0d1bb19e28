"""Look at runs in the real MLflow UI: a plain run and a sweep, screenshotted headless.

Starts ``mlflow server`` (SQLite store, proxied artifacts) on a free loopback port, runs the
``main`` entry point (np=-2, 2 epochs) and a 2-trial sweep against it, then takes headless
Chromium screenshots (Debian's ``chromium`` package) of the runs table (trials nested under
their sweep, sharing columns with the plain run), the plain run's model page (its metrics
are the final epoch's) and the compare view of the trials. Not part of CI: a person looks at
the PNGs. Also prints the API-level facts the pictures should show.

    .venv/bin/python scripts/ui_check.py [--out ui-screenshots]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def screenshot(url: str, path: Path) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("no chromium: apt-get install -y chromium")
    subprocess.run(
        [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--window-size=1600,1000", "--virtual-time-budget=60000", f"--screenshot={path}",
         url],
        check=True, capture_output=True, timeout=300,
    )
    print(f"  {path}  <- {url}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="ui-screenshots")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    import mlflow
    from services import start_mlflow_server, stop_group

    work = Path(tempfile.mkdtemp(prefix="mlflow-hvd-ui-"))
    server, url = start_mlflow_server("127.0.0.1", work / "server")
    try:
        env = {**os.environ, "MLFLOW_TRACKING_URI": url, "TF_CPP_MIN_LOG_LEVEL": "2"}
        py = sys.executable
        subprocess.run([py, "-m", "mlflow_hvd.cli.train", "--np", "-2", "--epochs", "2"],
                       cwd=ROOT, env=env, check=True, timeout=900)
        subprocess.run([py, "-m", "mlflow_hvd.cli.sweep", "--np", "-2", "--max-evals", "2",
                        "--epochs", "1"], cwd=ROOT, env=env, check=True, timeout=1800)
        client = mlflow.MlflowClient(tracking_uri=url)
        runs = client.search_runs(["0"], order_by=["attributes.start_time ASC"])
        plain = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags
                     and "mlflow_hvd.sweep.trial" not in r.data.tags
                     and r.outputs.model_outputs)
        trials = [r for r in runs if "mlflow_hvd.sweep.trial" in r.data.tags]
        (model_out,) = plain.outputs.model_outputs
        model = client.get_logged_model(model_out.model_id)
        print(f"plain run {plain.info.run_id}: params {sorted(plain.data.params)}")
        for t in trials:
            print(f"trial {t.data.tags['mlflow_hvd.sweep.trial']}: params {sorted(t.data.params)}")
        at_step = [m.value for m in client.get_metric_history(plain.info.run_id, "val_loss")
                   if m.step == model_out.step]
        print(f"model {model.model_id}: linked at step {model_out.step} (val_loss there: "
              f"{at_step}), source {model.tags.get('mlflow.source.name')}")
        base = url
        screenshot(f"{base}/#/experiments/0/runs", out / "runs_table.png")
        screenshot(f"{base}/#/experiments/0/models/{model.model_id}", out / "model_page.png")
        ids = json.dumps([t.info.run_id for t in trials])
        query = urllib.parse.urlencode({"runs": ids, "experiments": json.dumps(["0"])})
        screenshot(f"{base}/#/compare-runs?{query}", out / "compare_trials.png")
    finally:
        stop_group(server)


if __name__ == "__main__":
    main()
