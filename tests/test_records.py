"""Tracking records and their one codec (rank 0's spill file, the driver's replay bundle)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlflow_hvd.driver.tracking import undelivered
from mlflow_hvd.protocol import records as rec

EVERY_KIND = [
    rec.Metric("loss", 0.25, 1000, 3),
    rec.Metric("nan", float("nan"), 1001, 4),
    rec.Metric("acc", 0.9, 1003, 5, model_id="m-1", dataset_name="digits",
               dataset_digest="abc"),
    rec.Param("lr", "0.1"),
    rec.Tag("phase", "train"),
    rec.Artifact("files/0/model.keras", "checkpoints/epoch_1"),
    rec.Artifact("error.txt", ""),
    rec.Commit((rec.Metric("val_loss", 0.5, 1002, 1),),
               (rec.Tag("mlflow.latest_checkpoint_artifact", "checkpoints/epoch_1/c.keras"),)),
    rec.Inputs((rec.Dataset("digits", "abc", "spark", '{"path": "/d"}', '{"s": 1}', None,
                            (("mlflow.data.context", "train"),)),), ("m-0",)),
    rec.Outputs((("m-1", 3),)),
    rec.Status("FINISHED"),
]


def test_every_kind_of_record_survives_the_codec() -> None:
    back = [rec.decode(rec.encode(r)) for r in EVERY_KIND]
    assert repr(back) == repr(EVERY_KIND)  # repr: nan != nan, but prints the same
    assert rec.count(back) == {"metric": 4, "param": 1, "tag": 2, "artifact": 2, "inputs": 1,
                               "outputs": 1, "status": 1}
    assert rec.describe(rec.count(back)) == (
        "4 metric values, 1 param, 2 tags, 2 artifact files, 1 input record, 1 output record "
        "and 1 run status")


def test_lines_that_are_not_records_are_refused_quoting_them() -> None:
    for line in ['{"x": 1}', '["metric", "m"]', '["video", 1]', "not json", "[]"]:
        with pytest.raises(ValueError, match=r"^not a tracking record: "):
            rec.decode(line)
    with pytest.raises(TypeError, match=r"^not a tracking record: 'x'$"):
        rec.send(object(), "run", ["x"])  # type: ignore[list-item]


def test_a_file_of_another_format_version_is_refused_by_name(tmp_path: Path) -> None:
    assert rec.check_header(rec.header(), "f") is True
    assert rec.check_header(rec.encode(rec.Param("a", "b")), "f") is False  # no header: v1
    with pytest.raises(ValueError, match=(
        r"^spill holds tracking records of format version 3; this mlflow_hvd reads versions "
        r"1, 2: replay it with the mlflow_hvd that wrote it$"
    )):
        rec.check_header(json.dumps({"format": "mlflow_hvd.records", "version": 3}), "spill")
    assert rec.check_header(json.dumps({"format": "mlflow_hvd.records", "version": 1}), "f")
    with pytest.raises(ValueError, match=r"^spill is not a file of mlflow_hvd tracking records$"):
        rec.check_header(json.dumps({"format": "other"}), "spill")


def test_a_bundle_is_written_with_the_codec_and_read_back_with_its_files(tmp_path: Path) -> None:
    path = undelivered.save(str(tmp_path), "run1", "http://server", EVERY_KIND[:4] + [
        rec.Artifact("0/notes.txt", "docs")], files=[("0/notes.txt", b"hello")])
    lines = (Path(path) / "records.jsonl").read_text().splitlines()
    assert lines[0] == rec.header() and len(lines) == 6
    meta, records = undelivered.load(path)
    assert meta == {"run_id": "run1", "tracking_uri": "http://server"}
    (artifact,) = [r for r in records if isinstance(r, rec.Artifact)]
    assert artifact.artifact_dir == "docs" and Path(artifact.path).read_bytes() == b"hello"
    assert repr(records[:4]) == repr(EVERY_KIND[:4])


def test_a_bundle_saved_before_headers_existed_still_replays(tmp_path: Path) -> None:
    bundle = tmp_path / "run2"
    bundle.mkdir()
    (bundle / "bundle.json").write_text('{"run_id": "run2", "tracking_uri": "sqlite:///x.db"}')
    (bundle / "records.jsonl").write_text('["metric", "m", 1.0, 5, 0]\n["status", "FAILED"]\n')
    _, records = undelivered.load(str(bundle))
    assert records == [rec.Metric("m", 1.0, 5, 0), rec.Status("FAILED")]
