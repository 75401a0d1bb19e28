"""The MLflow UI as a user sees it, in a real browser.

A real ``mlflow server`` (SQLite store, proxied artifacts) gets one run of the ``main`` entry
point (PyTorch digits on two Spark ranks, data from a Parquet path: the run has dataset
inputs) and a three-trial sweep whose third trial is pruned and whose best model is
registered. Headless Debian ``chromium``, driven by Playwright (no browser download), then
looks at what a user looks at, found by visible text and ARIA roles: the runs table, the
compare view of the trials and its metric chart, the plain run's page, the sweep's plot.
Screenshots go to ``test-output/ui/`` (or ``$MLFLOW_HVD_UI_OUT``) for a person to look at.
The last test breaks the nesting on purpose (a trial loses its parent tag) and shows that
the nesting check then fails.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import pytest
from services import stop_group

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
OUT = Path(os.environ.get("MLFLOW_HVD_UI_OUT") or REPO / "test-output" / "ui")
EPOCHS = 2  # of the plain run: its model is logged at step EPOCHS - 1
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"]
WAIT_MS = 60_000  # every wait for the UI has this deadline


@dataclass(frozen=True)
class Tracked:
    url: str
    experiment_id: str
    plain_id: str
    plain_name: str
    parent_id: str
    trial_ids: tuple[str, ...]  # by trial number


MODEL = "ui-digits"  # the registered model (the server is the suite's: a name of its own)


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory, _loopback_server: Any) -> Iterator[Tracked]:
    """The suite's shared ``mlflow server``, an experiment of this module's own: the main
    entry point's run (a subprocess on its own Spark session) and, while it trains, the
    sweep (local ranks in this process)."""
    from hyperopt import hp

    sys.path.insert(0, str(REPO / "examples"))
    import digits_to_parquet
    import digits_torch

    from mlflow_hvd.sweep import MedianRule, sweep

    root = tmp_path_factory.mktemp("ui")
    if not _loopback_server.is_up():  # an earlier test's outage
        _loopback_server.restart()
    url = _loopback_server.url
    old = mlflow.get_tracking_uri()
    client = mlflow.MlflowClient(tracking_uri=url)
    name = f"ui-{root.name}"
    experiment_id = client.create_experiment(name)
    data = root / "digits_parquet"
    digits_to_parquet.write(str(data))
    # the `main` entry point's command, as MLproject runs it
    log = root / "main.log"
    main = subprocess.Popen(
        [sys.executable, "-m", "mlflow_hvd.cli.train", "--np", "2", "--spark-master",
         "local[2]", "--epochs", str(EPOCHS), "--data", str(data), "--train",
         "examples/digits_torch.py:train"],
        cwd=REPO, env={**os.environ, "MLFLOW_TRACKING_URI": url,
                       "MLFLOW_EXPERIMENT_NAME": name},
        stdout=subprocess.DEVNULL, stderr=log.open("w"), start_new_session=True)
    try:
        mlflow.set_tracking_uri(url)
        mlflow.set_experiment(experiment_id=experiment_id)
        # seed 5 samples learning rates 0.01, 0.01, 1e-6: the third trial cannot learn and
        # the median rule (over the two trials before it) stops it after its first epoch
        space = {"learning_rate": hp.choice("learning_rate", [0.01, 1e-6]),
                 "batch_size": hp.choice("batch_size", [32])}
        result = sweep(digits_torch.train, space, max_evals=3, np=-2, seed=5,
                       prune=MedianRule(min_trials=2), fixed_params={"epochs": 3},
                       register_model=MODEL)
        assert result.pruned_trials == 1 and result.registered_version == "1"
        assert main.wait(timeout=900) == 0, log.read_text(errors="replace")[-3000:]
        trials = sorted(
            client.search_runs([experiment_id],
                               f"tags.mlflow.parentRunId = '{result.parent_run_id}'"),
            key=lambda r: int(r.data.tags["mlflow_hvd.sweep.trial"]))
        assert [t.data.tags.get("mlflow_hvd.sweep.pruned_at_epoch") for t in trials] == [
            None, None, "1"]
        (plain,) = [r for r in client.search_runs([experiment_id])
                    if r.info.run_id != result.parent_run_id
                    and "mlflow.parentRunId" not in r.data.tags]
        yield Tracked(url, experiment_id, plain.info.run_id, plain.info.run_name,
                      result.parent_run_id, tuple(t.info.run_id for t in trials))
    finally:
        if main.poll() is None:
            stop_group(main)
        mlflow.set_tracking_uri(old)
        mlflow.set_experiment(experiment_id="0")  # the session store's default


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    path = os.environ.get("MLFLOW_HVD_CHROMIUM") or shutil.which("chromium")
    if path is None:
        pytest.fail("the UI test needs Debian's chromium: 'apt-get install -y chromium' "
                    "(make setup installs it when run as root), or set MLFLOW_HVD_CHROMIUM")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=BROWSER_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture()
def page(browser: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    context.set_default_timeout(WAIT_MS)
    pg = context.new_page()
    try:
        yield pg
    finally:
        OUT.mkdir(parents=True, exist_ok=True)
        pg.screenshot(path=str(OUT / f"{request.node.name}-last.png"))
        context.close()


def shot(page: Any, name: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(OUT / f"{name}.png"), full_page=True)


def open_runs_table(page: Any, t: Tracked) -> None:
    page.goto(f"{t.url}/#/experiments/{t.experiment_id}/runs")
    page.get_by_role("link", name=t.plain_name, exact=True).wait_for()
    close = page.get_by_role("button", name="Close", exact=True)  # the assistant's panel
    if close.count() and close.first.is_visible():
        close.first.click()


def row_index(page: Any, run_name: str) -> int:
    """The grid row (``aria-rowindex``) whose run-name cell links ``run_name``."""
    row = page.get_by_role("row").filter(
        has=page.get_by_role("link", name=run_name, exact=True))
    return int(row.get_attribute("aria-rowindex"))


def cell_text(page: Any, row: int, column: str) -> str:
    """The text of the cell in grid row ``row`` under the column headed ``column`` (the
    grid draws pinned and scrolling columns as separate rows with the same index)."""
    header = page.get_by_role("columnheader", name=column, exact=True).first
    col = header.get_attribute("aria-colindex")
    cell = page.locator(f'[role="row"][aria-rowindex="{row}"] '
                        f'[role="gridcell"][aria-colindex="{col}"]')
    return str(cell.inner_text()).strip()


def trial_links(page: Any) -> list[str]:
    return sorted(page.get_by_role("link", name=re.compile(r"^trial-\d+$")).all_inner_texts())


def check_nesting(page: Any, t: Tracked) -> None:
    """The sweep's run is one row with its trials folded under it: no trial is shown
    until the sweep's row is expanded, then the three follow it."""
    assert trial_links(page) == [], "a trial is shown outside its sweep"
    parent_row = row_index(page, "sweep")
    page.get_by_role("gridcell").filter(
        has=page.get_by_role("link", name="sweep", exact=True)).get_by_role("button").click()
    page.get_by_role("link", name="trial-2", exact=True).wait_for()
    assert trial_links(page) == ["trial-0", "trial-1", "trial-2"]
    below = sorted(row_index(page, f"trial-{i}") for i in range(3))
    assert below == [parent_row + 1, parent_row + 2, parent_row + 3]


def test_the_runs_table_nests_the_trials_under_the_sweep_and_marks_the_pruned_one(
    tracked: Tracked, page: Any
) -> None:
    open_runs_table(page, tracked)
    shot(page, "1-runs-table")
    check_nesting(page, tracked)
    # the best trial's row names its registered model version
    best = row_index(page, "trial-0")
    assert re.fullmatch(rf"{MODEL}\s+v1", cell_text(page, best, "Models")), cell_text(
        page, best, "Models")
    # the pruned trial's tag, shown as a column chosen from the column selector
    page.get_by_role("button", name="Columns", exact=True).click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_placeholder("Search columns").fill("pruned_at")
    dialog.get_by_text("mlflow_hvd.sweep.pruned_at_epoch", exact=True).click()
    page.keyboard.press("Escape")
    tag = "mlflow_hvd.sweep.pruned_at_epoch"
    page.get_by_role("columnheader", name=tag, exact=True).first.wait_for()
    shot(page, "2-runs-table-trials-and-pruned-tag")
    marks = [cell_text(page, row_index(page, f"trial-{i}"), tag) for i in range(3)]
    assert marks == ["-", "-", "1"]


def test_the_compare_view_shows_each_trials_params_and_the_metric_across_epochs(
    tracked: Tracked, page: Any
) -> None:
    open_runs_table(page, tracked)
    page.get_by_role("gridcell").filter(
        has=page.get_by_role("link", name="sweep", exact=True)).get_by_role("button").click()
    for i in range(3):
        row = row_index(page, f"trial-{i}")
        page.locator(f'[role="row"][aria-rowindex="{row}"]').get_by_role("checkbox").click()
    page.get_by_role("button", name="Compare", exact=True).click()
    page.get_by_text("Comparing 3 Runs", exact=False).wait_for()
    shot(page, "3-compare-trials")

    def table_row(label: str) -> list[str]:
        row = page.get_by_role("row").filter(
            has=page.get_by_role("rowheader", name=label, exact=True)).first
        return [c.strip() for c in row.inner_text().split("\t")[1:]]

    assert [c.split()[0] for c in table_row("Run Name:")] == ["trial-0", "trial-1", "trial-2"]
    assert table_row("learning_rate") == ["0.01", "0.01", "1e-06"]
    assert table_row("batch_size") == ["32", "32", "32"]
    # the sweep's metric across epochs: its chart, one line per trial
    page.get_by_role("link", name="val_loss", exact=True).click()
    page.get_by_text("trial-2 (val_loss)", exact=True).wait_for()
    assert page.get_by_text("Step", exact=True).first.is_visible()
    shot(page, "4-val-loss-chart")
    for i in range(3):
        assert page.get_by_text(f"trial-{i} (val_loss)", exact=True).is_visible()

    def latest_and_max(name: str) -> tuple[str, str]:
        row = page.get_by_role("row").filter(
            has=page.get_by_role("link", name=name, exact=True)).first
        cells = [c.strip() for c in row.inner_text().split("\t")]
        return cells[1].split()[-1], cells[3].split()[-1]

    # trials that trained 3 epochs end at step 2 (their highest loss at step 0); the pruned
    # one stopped after its first
    assert latest_and_max("trial-0") == ("(step=2)", "(step=0)")
    assert latest_and_max("trial-2") == ("(step=0)", "(step=0)")


def test_the_plain_runs_page_shows_its_model_checkpoints_and_datasets(
    tracked: Tracked, page: Any
) -> None:
    open_runs_table(page, tracked)
    page.get_by_role("link", name=tracked.plain_name, exact=True).click()
    page.get_by_text("Logged models (1)", exact=True).wait_for()
    shot(page, "5-plain-run")
    # the model, logged at the final epoch's step
    header = page.get_by_role("row").filter(
        has=page.get_by_role("columnheader", name="Step", exact=True))
    columns = [c.strip() for c in header.get_by_role("columnheader").all_inner_texts()]
    model_row = page.get_by_role("row").filter(has_text="Ready").filter(
        has=page.get_by_role("link", name="model", exact=True))
    values = [c.strip() for c in model_row.get_by_role("gridcell").all_inner_texts()]
    logged = dict(zip(columns, values, strict=True))
    assert (logged["Type"], logged["Step"], logged["Status"]) == (
        "Output", str(EPOCHS - 1), "Ready"), logged
    # the Spark DataFrames it trained and validated on, as dataset inputs
    # (the validation split behind "+1")
    text = page.locator("body").inner_text()
    assert re.search(r"Datasets\s+data \([0-9a-f]{8}\)\s+Training\s+\+1", text), text[-2000:]
    # its checkpoints, one per epoch
    page.get_by_role("tab", name="Artifacts").click()
    page.get_by_text("checkpoints", exact=True).click()
    page.get_by_text(f"epoch_{EPOCHS - 1}", exact=True).wait_for()
    assert page.get_by_text("epoch_0", exact=True).is_visible()
    shot(page, "6-plain-run-checkpoints")


def test_the_sweeps_plot_artifact_opens(tracked: Tracked, page: Any) -> None:
    open_runs_table(page, tracked)
    page.get_by_role("link", name="sweep", exact=True).click()
    page.get_by_role("tab", name="Artifacts").click()
    page.get_by_text("loss_per_trial.png", exact=True).click()
    image = page.get_by_role("img", name="loss_per_trial.png")
    image.wait_for()
    # decoded, not a broken image
    page.wait_for_function("img => img.complete && img.naturalWidth > 0",
                           arg=image.element_handle(), timeout=WAIT_MS)
    shot(page, "7-sweep-plot")


def test_the_nesting_check_fails_when_a_trial_loses_its_parent_tag(
    tracked: Tracked, page: Any
) -> None:
    """Broken on purpose: without ``mlflow.parentRunId`` trial 1 is a top-level row, and
    the check the first test relies on says so."""
    client = mlflow.MlflowClient(tracking_uri=tracked.url)
    client.delete_tag(tracked.trial_ids[1], "mlflow.parentRunId")
    try:
        open_runs_table(page, tracked)
        with pytest.raises(AssertionError, match="a trial is shown outside its sweep"):
            check_nesting(page, tracked)
        shot(page, "8-broken-nesting")
    finally:
        client.set_tag(tracked.trial_ids[1], "mlflow.parentRunId", tracked.parent_id)
