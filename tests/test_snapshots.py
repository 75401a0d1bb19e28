"""Snapshots every N steps (``mlflow_hvd.torch.Snapshots``, examples/digits_snapshots.py): a
rank killed mid-epoch costs fewer than N steps of training, not the epoch since the last
checkpoint, and the resumed job ends with exactly the weights of one that was never killed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow
import pytest
import workers

from mlflow_hvd import HorovodRunner, JobConfig
from mlflow_hvd.errors import ConfigurationError

BATCHES = 43  # per rank and epoch: 673 of the 1347 training rows, batches of 16


@pytest.mark.slow
def test_a_rank_killed_mid_epoch_resumes_from_the_newest_snapshot_as_if_never_killed(
        store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """Two jobs of the DDP example on the same two local ranks: one uninterrupted, one whose
    rank 1 is SIGKILLed after 67 steps (snapshots every 10 steps, the last at step 60:
    epoch 1, batch 16; epoch checkpoints in the run; step_loss logged every 5 steps). The
    second attempt starts at batch 17 of epoch 1, repeats 7 steps, logs each epoch's loss
    and each step_loss once (step 65's value is the first attempt's, equal to the
    uninterrupted job's), removes the host's snapshots at the end, and ends with the
    uninterrupted job's parameters, bit for bit on every rank (model, Adam's state, the
    sampler's position and the dropout RNG all restored)."""
    import digits_snapshots

    folder = tmp_path / "snapshots"
    monkeypatch.setenv("MLFLOW_HVD_SNAPSHOT_DIR", str(folder))
    with HorovodRunner(np=-2, job=JobConfig(max_failures=1, stop_grace=2)) as runner:
        clean = runner.run(digits_snapshots.train, epochs=3, log_every_n_steps=5)
        clean_run = str(runner.last_run_id)
        killed = runner.run(digits_snapshots.train, epochs=3, kill_at_step=67,
                            log_every_n_steps=5)
        killed_run = str(runner.last_run_id)
    assert (clean["resumed_from"], clean["steps"]) == ("start", 3 * BATCHES), clean
    assert killed["resumed_from"] == "snapshot" and killed["resumed_at"] == [1, 17], killed
    assert killed["steps"] == 3 * BATCHES - 60, killed  # of the second attempt
    assert len(set(clean["checksums"])) == 1 and killed["checksums"] == clean["checksums"]

    client = mlflow.MlflowClient()
    run = client.get_run(killed_run)
    assert run.info.status == "FINISHED"
    assert run.data.tags["mlflow_hvd.resumed_from"] == f"{killed_run}@epoch_1_batch_16"
    assert [m.value for m in client.get_metric_history(killed_run, "mlflow_hvd.attempt")] == [
        0.0, 1.0]
    assert [m.step for m in client.get_metric_history(killed_run, "loss")] == [0, 1, 2]
    assert [m.step for m in client.get_metric_history(clean_run, "loss")] == [0, 1, 2]
    every_5 = {m.step: m.value for m in client.get_metric_history(clean_run, "step_loss")}
    once = client.get_metric_history(killed_run, "step_loss")
    assert sorted(m.step for m in once) == sorted(every_5) == list(range(5, 3 * BATCHES, 5))
    assert {m.step: m.value for m in once} == every_5
    # the snapshots stayed on the host: none is an artifact of the run
    assert {a.path for a in client.list_artifacts(killed_run)} == {"attempts", "checkpoints"}
    # each job's folder went when its loop ended without an error
    assert sorted(p.name for p in folder.iterdir()) == []
    told = capfd.readouterr()
    seen = told.out + told.err
    assert ("resuming from the snapshot of step 60 (epoch 1, after batch 16) held on "
            in seen), seen[-3000:]
    assert ("the run's latest checkpoint is of epoch 0; metric values at steps the run "
            "already has are not logged again (latest: loss 0, step_loss 65)") in seen
    assert f"snapshots every 10 steps in {folder / clean_run} on each host: " in seen


def test_snapshots_refuse_a_step_count_that_is_not_a_positive_integer() -> None:
    from mlflow_hvd.torch import Snapshots

    for every in (0, -3, 2.5, True, "10"):
        with pytest.raises(ConfigurationError, match=r"Snapshots\(every=.*positive integer"):
            Snapshots(None, None, every=every)  # type: ignore[arg-type]


@pytest.mark.slow
def test_horovod_torch_snapshots_are_one_file_per_host_and_restore_every_rank(
        store: str, warm_ranks: Any, tmp_path: Path) -> None:
    """Under ``horovod.torch`` (warm local ranks: one host) only rank 0 writes, the two
    newest snapshots are kept, and resume() gives both ranks the model and Adam's state of
    the newest one and each its RNG state; the folder goes at the block's end."""
    out = warm_ranks.run(workers.snapshot_round_trip, folder=str(tmp_path / "snapshots"))
    run_id = warm_ranks.last_run_id
    assert out["written"] == ["step-0000000002-epoch-0-batch-1.pt",
                              "step-0000000004-epoch-0-batch-3.pt"], out
    assert out["position"] == [0, 4, "snapshot"], out
    assert out["restored"] == [True, True] and out["rng"] and out["adam_steps"] == 4, out
    assert out["left"] == [], out  # this run's folder, removed
    assert mlflow.MlflowClient().get_run(run_id).data.tags["mlflow_hvd.resumed_from"] == (
        f"{run_id}@epoch_0_batch_3")


@pytest.mark.slow
def test_a_write_cut_short_is_ignored_and_a_full_disk_skips_the_snapshot(
        store: str, warm_ranks: Any, tmp_path: Path,
        capfd: pytest.CaptureFixture[str]) -> None:
    """Faults: the ``.partial`` file of a writer killed mid-write is removed and the newest
    complete snapshot restored; a snapshot the disk refuses is skipped and said, the
    training step returns, and the next snapshot is written."""
    out = warm_ranks.run(workers.snapshot_faults, folder=str(tmp_path / "snapshots"))
    assert out["position"] == [0, 2, "snapshot"] and out["restored"] == [True, True], out
    assert out["partial_left"] is False, out
    assert out["skipped"] == 1, out  # rank 0's: the step of batch 2
    assert out["files"] == ["step-0000000002-epoch-0-batch-1.pt",
                            "step-0000000004-epoch-0-batch-3.pt"], out
    told = capfd.readouterr()
    assert ("snapshot step-0000000003-epoch-0-batch-2.pt skipped on "
            in told.out + told.err), (told.out + told.err)[-3000:]
    assert "File too large" in told.out + told.err
