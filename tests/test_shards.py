"""A task's partition written to its host and read back by its rank, without Spark:
agent/feed.py (writing, the tasks' agreement, errors) and rank/shard.py (batches, shuffling,
tf.data, torch)."""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from mlflow_hvd.agent.feed import TaskFeed, agree, feed_partition, manifest, write_partition
from mlflow_hvd.data import Shard
from mlflow_hvd.errors import ConfigurationError, DataInputError, FeedError
from mlflow_hvd.protocol.feed import (
    TAG_COLUMN,
    Column,
    ColumnKind,
    FeedFault,
    FeedSpec,
    FrameSpec,
    ShardArg,
    load_manifest,
)
from mlflow_hvd.rank import passes
from mlflow_hvd.rank.shard import resolve

TRAIN = FrameSpec("train", 0, (
    Column("id", ColumnKind.SCALAR, "int64", "id"),
    Column("x", ColumnKind.ARRAY, "float32", "x"),
    Column("label", ColumnKind.SCALAR, "int32", "label"),
))


def batches(start: int, stop: int, per_batch: int, width: int = 3) -> list[pa.RecordBatch]:
    """Record batches as a Spark task receives them: ids, list<float> arrays, labels."""
    out = []
    for lo in range(start, stop, per_batch):
        ids = np.arange(lo, min(lo + per_batch, stop))
        x = pa.array([[float(i)] * width for i in ids], pa.list_(pa.float32()))
        out.append(pa.RecordBatch.from_arrays(
            [pa.array(ids), x, pa.array(ids % 2, pa.int32())], names=["id", "x", "label"]))
    return out


def fed(tmp_path: Path, sizes: list[int], per_batch: int = 100) -> list[Shard]:
    """Every rank's shard of ``train``, as np tasks with ``sizes`` rows would leave them."""
    spec = FeedSpec((TRAIN,))
    reports, dirs, start = [], [], 0
    for partition, size in enumerate(sizes):
        directory = tmp_path / f"task{partition}"
        directory.mkdir()
        dirs.append(str(directory))
        reports.append(feed_partition(spec, partition, batches(start, start + size, per_batch),
                                      str(directory)))
        start += size
    paths = [manifest(spec, dirs[p], reports, p) for p in range(len(sizes))]
    return [resolve({"train": ShardArg("train")}, path)["train"] for path in paths]


def ids(shard: Shard, batch_size: int, **options: object) -> list[int]:
    return [int(i) for b in shard.batches(batch_size, **options) for i in b["id"]]


def test_every_rank_keeps_the_smallest_count_and_the_rest_is_counted_as_dropped(
        tmp_path: Path) -> None:
    shards = fed(tmp_path, [1000, 1003, 998])
    assert [s.rows for s in shards] == [998, 998, 998]
    assert [s.steps(64) for s in shards] == [15, 15, 15]
    assert shards[0].dropped == 7 and shards[0].total_rows == 3001
    seen = [ids(s, 1, shuffle=False) for s in shards]
    assert all(len(rows) == 998 for rows in seen)
    assert not set(seen[0]) & set(seen[1]) and not set(seen[1]) & set(seen[2])
    # the first `rows` of each task's file, in order
    assert seen[1] == list(range(1000, 1998))


def test_a_pass_gives_full_batches_only_the_same_number_on_every_rank(tmp_path: Path) -> None:
    shard = fed(tmp_path, [1050, 1050])[0]
    got = list(shard.batches(100))
    assert len(got) == shard.steps(100) == 10
    assert {len(b["id"]) for b in got} == {100}
    assert got[0]["x"].shape == (100, 3) and got[0]["x"].dtype == np.float32
    assert got[0]["label"].dtype == np.int32
    # a row's columns stay together through the shuffle
    for b in got:
        assert np.array_equal(b["x"][:, 0], b["id"].astype(np.float32))
        assert np.array_equal(b["label"], (b["id"] % 2).astype(np.int32))


def test_shuffling_is_reproducible_from_seed_and_epoch_and_differs_every_epoch(
        tmp_path: Path) -> None:
    shard = fed(tmp_path, [3000, 3000], per_batch=250)[0]
    epoch0 = ids(shard, 50, seed=7, epoch=0, window=500)
    assert epoch0 == ids(shard, 50, seed=7, epoch=0, window=500)
    epoch1 = ids(shard, 50, seed=7, epoch=1, window=500)
    assert epoch0 != epoch1 and sorted(epoch0) == sorted(epoch1) == list(range(3000))
    assert epoch0 != ids(shard, 50, seed=8, epoch=0, window=500)
    # rows move between record batches: the first batch of a pass mixes several of them
    assert len({i // 250 for i in epoch0[:50]}) > 1
    # passes that do not name their epoch count up from next_epoch
    shard.next_epoch = 1
    assert ids(shard, 50, seed=7, window=500) == epoch1 and shard.next_epoch == 2


def test_the_default_window_is_bounded_by_bytes_as_well_as_rows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Wide rows (images) are shuffled in a window of about WINDOW_BYTES of the file, not
    65,536 rows of them; a window the caller names is kept."""
    shard = fed(tmp_path, [3000, 3000], per_batch=250)[0]
    per_row = os.path.getsize(shard._file.path) / shard._file.written
    monkeypatch.setattr(passes, "WINDOW_BYTES", int(per_row * 500) + 1)  # 500 rows' bytes
    default = ids(shard, 50, seed=7, epoch=0)
    assert default == ids(shard, 50, seed=7, epoch=0, window=500)
    assert default != ids(shard, 50, seed=7, epoch=0, window=passes.WINDOW_ROWS)
    torch_ids = [int(i) for x, _ in shard.torch_dataset(50, features=["id"], seed=7)
                 for i in x]
    assert torch_ids == default  # its first pass: epoch 0 too
    # narrow rows: the row bound; never under a batch; a batch in file order
    monkeypatch.setattr(passes, "WINDOW_BYTES", 32 << 20)
    path, written = shard._file.path, shard._file.written
    assert passes.window_rows(path, written, None, 50, True) == passes.WINDOW_ROWS
    assert passes.window_rows(path, written, 10, 50, True) == 50
    assert passes.window_rows(path, written, None, 50, False) == 50


def mapped_kib(path: str) -> int:
    """This process's resident KiB of its memory maps of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's first line
            inside = head[-1] == path
        elif inside and head[0] == "Rss:":
            total += int(head[1])
    return total


def test_a_window_holds_no_file_pages_while_its_batches_are_consumed(tmp_path: Path) -> None:
    """A shuffled window's rows are copies: the shard file's pages under them are handed
    back before its batches are yielded, so a rank holds a window once, not twice (wide
    rows: ~32 MiB of images less per rank)."""
    shard = fed(tmp_path, [3000, 3000], per_batch=250)[0]
    path = shard._file.path
    with open(path, "rb") as f:  # the measure sees a map's pages
        seen = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    _ = seen[:].count(b"x")
    assert mapped_kib(path) > 0
    seen.close()
    groups = shard._pass(50, None, True, 7, 0, 500).groups()
    first = next(groups)
    assert mapped_kib(path) == 0
    rows = [int(i) for b in first["id"] for i in b]  # a group is valid until the next one
    rows += [int(i) for group in groups for b in group["id"] for i in b]
    assert sorted(rows) == list(range(3000))  # and every row still arrives


def test_two_arguments_in_one_stage_each_get_their_own_file(tmp_path: Path) -> None:
    val = FrameSpec("val", 1, (Column("text", ColumnKind.STRING, "", "text"),))
    tagged_train = FrameSpec("train", 0, (Column("id", ColumnKind.SCALAR, "int64", "id"),))
    spec = FeedSpec((tagged_train, val))
    batch = pa.RecordBatch.from_arrays(
        [pa.array([0, 1, 0, 1, 0], pa.int32()), pa.array([1, None, 2, None, 3]),
         pa.array([None, "a", None, "b", None])], names=[TAG_COLUMN, "id", "text"])
    written = write_partition(spec, [batch], str(tmp_path))
    assert [(w.argument, w.rows) for w in written] == [("train", 3), ("val", 2)]
    reports = [TaskFeed(0, tuple(written))]
    shards = load_manifest(Path(manifest(spec, str(tmp_path), reports, 0)).read_text())
    val_shard = Shard(shards[1])
    assert list(next(val_shard.batches(2, shuffle=False))["text"]) == ["a", "b"]


@pytest.mark.parametrize(("array", "expected"), [
    (pa.array([1.0, None], pa.float32()), "column 'x' .* has null values"),
    (pa.array([[1.0], [1.0, 2.0]], pa.list_(pa.float32())), "arrays of different lengths"),
    (pa.array([[1.0], [None]], pa.list_(pa.float32())), "null elements"),
])
def test_nulls_and_ragged_arrays_are_refused_naming_the_column(
        tmp_path: Path, array: pa.Array, expected: str) -> None:
    kind = ColumnKind.ARRAY if pa.types.is_list(array.type) else ColumnKind.SCALAR
    spec = FeedSpec((FrameSpec("train", 0, (Column("x", kind, "float32", "x"),)),))
    batch = pa.RecordBatch.from_arrays([array], names=["x"])
    with pytest.raises(DataInputError, match=expected):
        write_partition(spec, [batch], str(tmp_path))
    report = feed_partition(spec, 3, [batch], str(tmp_path))
    assert report.fault is FeedFault.DATA
    with pytest.raises(DataInputError, match=r"task 3: .*" + expected):
        agree(spec, [TaskFeed(0, ()), report])


def test_arrays_of_different_lengths_on_different_tasks_are_refused(tmp_path: Path) -> None:
    spec = FeedSpec((TRAIN,))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    reports = [feed_partition(spec, 0, batches(0, 10, 5, width=3), str(tmp_path / "a")),
               feed_partition(spec, 1, batches(10, 20, 5, width=4), str(tmp_path / "b"))]
    with pytest.raises(DataInputError, match="'x' .* arrays of 3 and of 4 elements"):
        agree(spec, reports)


def test_a_rank_without_rows_is_refused_with_the_counts(tmp_path: Path) -> None:
    with pytest.raises(DataInputError, match=r"has 500 rows, and rank\(s\) 1 of 2 got none "
                                             r"\(rows per rank: \[500, 0\]\)"):
        fed(tmp_path, [500, 0])


def test_a_batch_larger_than_a_ranks_rows_names_the_counts(tmp_path: Path) -> None:
    shard = fed(tmp_path, [40, 40])[0]
    with pytest.raises(ConfigurationError, match=r"batch_size=64 but every rank has 40 rows "
                                                 r"of train= \(80 rows over 2 ranks\)"):
        shard.steps(64)
    with pytest.raises(ConfigurationError, match="has no label column 'y'"):
        shard.tf_dataset(8, label="y")


def test_a_full_disk_names_the_directory_and_the_bytes(tmp_path: Path) -> None:
    os.symlink("/dev/full", tmp_path / "train.arrow")  # every write: ENOSPC, from the kernel
    with pytest.raises(FeedError, match=rf"writing this task's rows to {tmp_path} failed: the "
                                        r"disk is full: .* needed at least [\d,]+ more"):
        write_partition(FeedSpec((TRAIN,)), batches(0, 100, 50), str(tmp_path))


def test_a_keras_ready_dataset_knows_its_cardinality(tmp_path: Path) -> None:
    import tensorflow as tf

    shard = fed(tmp_path, [520, 520])[0]
    ds = shard.tf_dataset(64, features=["x"])
    assert int(ds.cardinality()) == shard.steps(64) == 8
    x, y = next(iter(ds))
    assert x.shape == (64, 3) and y.shape == (64,) and y.dtype == tf.int32
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    history = model.fit(ds, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    assert shard.next_epoch == 3  # one pass above, one per epoch of fit


def test_a_torch_dataset_gives_tensor_batches(tmp_path: Path) -> None:
    import torch

    shard = fed(tmp_path, [300, 300])[0]
    loader = shard.torch_loader(32, features=["id", "x"])
    assert len(loader) == 9
    features, label = next(iter(loader))
    assert features["x"].shape == (32, 3) and features["x"].dtype == torch.float32
    assert label.shape == (32,)
    assert sum(1 for _ in loader) == 9


def test_numpy_tf_and_torch_give_the_same_rows_and_kept_batches_stay_intact(
        tmp_path: Path) -> None:
    """A pass reuses its window's arrays; every consumer still gets exactly the pass's rows:
    tf.data copies each group it is handed, and numpy/torch batches are their own arrays
    (kept here until the pass ends: 30 windows later they must not have changed)."""
    import torch

    shard = fed(tmp_path, [6000, 6000], per_batch=250)[0]
    kept = list(shard.batches(40, seed=3, epoch=5, window=200))
    order = [int(i) for b in kept for i in b["id"]]
    assert sorted(order) == list(range(6000)) and order != list(range(6000))
    for b in kept:  # every row still whole: its columns belong to the same id
        assert np.array_equal(b["x"][:, 0], b["id"].astype(np.float32))

    shard.next_epoch = 5
    tf_ids = [int(i) for x, _ in shard.tf_dataset(40, features=["id"], seed=3, window=200)
              for i in x.numpy()]
    assert tf_ids == order
    shard.next_epoch = 5
    batches = list(shard.torch_dataset(40, features=["id", "x"], seed=3, window=200))
    assert [int(i) for x, _ in batches for i in x["id"]] == order
    assert all(torch.equal(x["x"][:, 0], x["id"].float()) for x, _ in batches)


def test_a_job_not_fed_the_argument_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"not fed the DataFrame argument\(s\) "
                                                 r"\['train'\]"):
        resolve({"train": ShardArg("train"), "lr": 0.1}, "")
    assert resolve({"lr": 0.1}, "") == {"lr": 0.1}


def _epoch_ids(loader: Any) -> list[int]:
    return [int(i) for x, _ in loader for i in x["id"]]


@pytest.mark.parametrize("workers, context, persistent", [
    (0, None, False), (1, None, False), (2, None, False), (2, "forkserver", True),
    (2, "spawn", False)])
def test_loader_workers_split_each_pass_and_every_epoch_is_shuffled_anew(
        tmp_path: Path, workers: int, context: str | None, persistent: bool) -> None:
    """Each row once per epoch, in the pass's own order, however many worker processes
    (``forkserver``/``spawn``: the dataset pickles); each epoch its own shuffle, the same
    for the same seed."""
    shard = fed(tmp_path, [1000, 1000])[0]
    options: dict[str, Any] = {"num_workers": workers}
    if workers:
        options.update(multiprocessing_context=context, persistent_workers=persistent)
    loader = shard.torch_loader(50, features=["id", "x"], seed=7, **options)
    assert len(loader) == 20
    epochs = [_epoch_ids(loader) for _ in range(2)]
    for epoch, seen in enumerate(epochs):
        assert sorted(seen) == list(range(1000))  # every row once
        assert seen == [int(i) for b in shard.batches(50, seed=7, epoch=epoch) for i in b["id"]]
    assert epochs[0] != epochs[1]  # a new order every epoch


def test_a_transform_runs_per_row_in_the_workers_and_a_failure_names_row_and_rank(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOROVOD_RANK", "3")
    shard = fed(tmp_path, [400])[0]
    factor = 2  # a closure: the transform travels by value to the forkserver's workers
    loader = shard.torch_loader(40, features=["id", "x"], shuffle=False, num_workers=2,
                                multiprocessing_context="forkserver",
                                transform=lambda row: {**row, "x": row["x"] * factor})
    (x, _), *_ = list(loader)
    assert x["x"].shape == (40, 3) and np.array_equal(x["x"][:, 0].numpy(),
                                                      2 * x["id"].numpy().astype(np.float32))
    failing = shard.torch_loader(40, features=["id", "x"], shuffle=False, transform=_fail_at_57)
    with pytest.raises(ConfigurationError, match=(
            r"^rank 3: transform _fail_at_57 failed on row 57 of epoch 0's pass over train= "
            r"\(batch 1, row 17 in it\): ValueError: cannot decode 57$")):
        list(failing)


def _fail_at_57(row: dict[str, Any]) -> dict[str, Any]:
    if int(row["id"]) == 57:
        raise ValueError("cannot decode 57")
    return row


def test_rows_a_transform_returns_unfit_for_their_batch_are_named(tmp_path: Path) -> None:
    """A batch's rows are stacked column by column: a row whose column's shape or type
    differs from the batch's first row's is named (np.stack would say neither which row
    nor which column; a float into an int column would be cut silently)."""
    shard = fed(tmp_path, [400])[0]

    def as_int_but_row_57(row: dict[str, Any]) -> dict[str, Any]:
        return {**row, "id": float(row["id"]) if int(row["id"]) == 57 else int(row["id"])}

    cases = [
        (lambda row: {**row, "x": row["x"][:2] if int(row["id"]) == 45 else row["x"]},
         r"returned, for row 45 of epoch 0's pass over train= \(batch 1, row 5 in it\), "
         r"'x' of shape \(2,\), but the batch's first row's was \(3,\): rows of a batch "
         r"are stacked"),
        (as_int_but_row_57, r"row 57 .* 'id' of type float64, but the batch's first row's "
         r"was int64: return the same type for every row"),
        (lambda row: {"x": row["x"]} if int(row["id"]) == 3 else row,
         r"row 3 .* the columns \['x'\], but the batch's first row had \['id', 'label', 'x'\]"),
    ]
    for transform, message in cases:
        loader = shard.torch_loader(40, features=["id", "x"], shuffle=False,
                                    transform=transform)
        with pytest.raises(ConfigurationError, match=message):
            list(loader)
    # what fits is stacked: Python ints and float32 arrays into their columns' tensors
    import torch

    loader = shard.torch_loader(40, features=["id", "x"], label=None, shuffle=False,
                                transform=lambda row: {"id": int(row["id"]), "x": row["x"]})
    first = next(iter(loader))
    assert first["id"].dtype == torch.int64 and first["id"].tolist() == list(range(40))
    assert first["x"].dtype == torch.float32 and first["x"].shape == (40, 3)


def test_a_tf_map_runs_per_row_in_tf_data_and_keeps_the_batches(tmp_path: Path) -> None:
    shard = fed(tmp_path, [400])[0]

    def double_x(x: Any, y: Any) -> Any:
        return {**x, "x": x["x"] * 2.0}, y

    ds = shard.tf_dataset(40, features=["id", "x"], shuffle=False, map=double_x)
    assert int(ds.cardinality()) == 10
    batches = list(ds)
    assert len(batches) == 10
    x, y = batches[1]
    assert x["x"].shape == (40, 3) and y.shape == (40,)
    assert np.array_equal(x["x"].numpy()[:, 0], 2 * x["id"].numpy().astype(np.float32))
    assert [int(i) for b, _ in batches for i in b["id"]] == list(range(400))  # in order
    with pytest.raises(ConfigurationError, match="map must be a function of one row"):
        shard.tf_dataset(40, map="decode")


def test_bytes_and_text_columns_reach_torch_as_lists_with_and_without_workers(
        tmp_path: Path) -> None:
    """Binary and string columns are lists of ``bytes`` / ``str`` in a torch batch, in the
    training process (where a window's batches are copied at once) and from workers."""
    spec = FeedSpec((FrameSpec("train", 0, (
        Column("id", ColumnKind.SCALAR, "int64", "id"),
        Column("png", ColumnKind.BINARY, "binary", "png"),
        Column("text", ColumnKind.STRING, "string", "text"),
    )),))
    ids = np.arange(300)
    record = pa.RecordBatch.from_arrays(
        [pa.array(ids), pa.array([b"\x89PNG%d" % i for i in ids], pa.binary()),
         pa.array([f"row {i}" for i in ids])], names=["id", "png", "text"])
    directory = tmp_path / "task0"
    directory.mkdir()
    report = feed_partition(spec, 0, [record.slice(0, 120), record.slice(120)], str(directory))
    shard = resolve({"train": ShardArg("train")}, manifest(spec, str(directory), [report], 0))[
        "train"]
    for options in ({}, {"num_workers": 2, "multiprocessing_context": "forkserver"}):
        loader = shard.torch_loader(25, label=None, features=["id", "png", "text"], **options)
        batches = list(loader)
        assert len(batches) == 12
        for b in batches:
            assert isinstance(b["png"], list) and isinstance(b["text"], list)
            assert b["png"] == [b"\x89PNG%d" % i for i in b["id"].tolist()]
            assert b["text"] == [f"row {i}" for i in b["id"].tolist()]
        assert sorted(i for b in batches for i in b["id"].tolist()) == list(range(300))


def test_a_rank_started_before_its_shard_was_written_waits_for_it_on_first_use(
        tmp_path: Path) -> None:
    """Ranks start while their tasks write the data: ``resolve`` returns at once, and the
    shard waits for the manifest when first used (``on_load`` then, once); a failed feed
    raises FeedNotDelivered there, and ``settle`` waits for shards the function never
    used."""
    import threading

    from mlflow_hvd.protocol.feed import FEED_FAILED_FILE, MANIFEST_FILE
    from mlflow_hvd.rank.shard import FeedNotDelivered, settle

    spec = FeedSpec((TRAIN,))
    directory = tmp_path / "task0"
    directory.mkdir()
    loaded: list[str] = []
    kwargs = resolve({"train": ShardArg("train"), "lr": 0.1},
                     str(directory / MANIFEST_FILE), on_load=lambda s: loaded.append(s.argument))
    assert kwargs["lr"] == 0.1 and kwargs["train"].argument == "train" and loaded == []

    def write() -> None:
        report = feed_partition(spec, 0, batches(0, 100, 50), str(directory))
        manifest(spec, str(directory), [report], 0)

    writer = threading.Timer(0.3, write)  # the task writes after its rank started
    started = time.monotonic()
    writer.start()
    assert kwargs["train"].rows == 100  # waited for the manifest
    assert time.monotonic() - started >= 0.25
    writer.join()
    settle(kwargs)
    assert loaded == ["train"]

    failed = tmp_path / "task1"
    failed.mkdir()
    (failed / FEED_FAILED_FILE).write_text("DataInputError: column 'y' has null values")
    waiting = resolve({"train": ShardArg("train")}, str(failed / MANIFEST_FILE))
    with pytest.raises(FeedNotDelivered, match="column 'y' has null values"):
        settle(waiting)


def test_a_rank_waiting_for_its_shards_stops_when_its_task_or_the_driver_is_gone(
        tmp_path: Path) -> None:
    """The wait for the manifest has bounds of its own: the task's directory removed (the
    task ended), or the driver's connection closed (the driver ended: on Spark Connect the
    stage may outlive the client) ends it with FeedNotDelivered within about a second."""
    from mlflow_hvd.driver.channel_server import ChannelServer
    from mlflow_hvd.protocol.channel import ChannelClient
    from mlflow_hvd.protocol.feed import MANIFEST_FILE
    from mlflow_hvd.rank import context
    from mlflow_hvd.rank.shard import FeedNotDelivered, settle

    gone = tmp_path / "removed"
    gone.mkdir()
    waiting = resolve({"train": ShardArg("train")}, str(gone / MANIFEST_FILE))
    gone.rmdir()
    with pytest.raises(FeedNotDelivered, match="their task ended before writing them"):
        settle(waiting)

    secret = b"s" * 32
    server = ChannelServer(secret, lambda message: None, bind_host="127.0.0.1")
    server.start()
    client = ChannelClient("127.0.0.1", server.port, secret, timeout=5)
    context.install(client, 1)
    try:
        assert not client.driver_gone()
        directory = tmp_path / "task"
        directory.mkdir()
        waiting = resolve({"train": ShardArg("train")}, str(directory / MANIFEST_FILE))
        threading_timer = threading.Timer(0.5, server.stop)
        threading_timer.start()
        started = time.monotonic()
        with pytest.raises(FeedNotDelivered, match="driver closed this rank's connection"):
            settle(waiting)
        assert time.monotonic() - started < 5, "the driver's end was not noticed"
        threading_timer.join()
        assert client.driver_gone()
    finally:
        context._client = None
        client.close()
        server.stop()
