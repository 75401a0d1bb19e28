"""Rank 0's metric, param and tag writes made by the driver (:mod:`mlflow_hvd.driver.tracking.relay`
on the driver, :mod:`mlflow_hvd.rank.tracking.sender` on rank 0), against real stores."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import mlflow
import pytest
import workers
from driver_jobs import tracking_target
from services import wait_until

from mlflow_hvd import HorovodRunner
from mlflow_hvd.driver.channel_server import ChannelServer
from mlflow_hvd.driver.tracking.relay import Relay
from mlflow_hvd.errors import TrackingError
from mlflow_hvd.protocol.channel import ChannelClient
from mlflow_hvd.protocol.messages import TrackingTarget, TrackingWrite, TrackingWritten
from mlflow_hvd.protocol.records import Artifact, Metric, Param, Tag
from mlflow_hvd.rank.tracking.sender import Sender

SECRET = b"r" * 32


def _metric(value: float, step: int) -> Metric:
    return Metric("m", value, int(time.time() * 1000), step)


def test_the_driver_writes_rank_0s_records_and_rank_0_never_imports_mlflow(store: str) -> None:
    runner = HorovodRunner(np=-1)
    out = runner.run(workers.log_without_mlflow, n=300)
    assert out == {"mlflow_loaded": False}
    client = mlflow.MlflowClient()
    run = client.get_run(str(runner.last_run_id))
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(i, 1.0 / (i + 1)) for i in range(300)]
    assert run.data.params == {"lr": "0.1"}
    assert (run.data.tags["phase"], run.data.tags["ckpt"]) == ("done", "epoch_1")
    assert run.data.metrics["epoch_loss"] == 0.5


def test_mlflow_is_imported_on_the_training_thread_when_a_file_is_queued(store: str) -> None:
    """The delivery thread never imports MLflow first: a training thread importing, say,
    ``mlflow.models`` at the same moment broke MLflow's import cycles (ImportError)."""
    runner = HorovodRunner(np=-1)
    assert runner.run(workers.artifact_after_metrics) == (False, True)
    client = mlflow.MlflowClient()
    assert [a.path for a in client.list_artifacts(str(runner.last_run_id), "d")] == ["d/x.json"]
    assert client.get_run(str(runner.last_run_id)).data.metrics == {"a": 1.0}


def test_the_relay_writes_only_the_jobs_run_and_passes_a_refusal_on(store: str) -> None:
    client = mlflow.MlflowClient()
    run_id = client.create_run("0").info.run_id
    relay = Relay(tracking_target(store, run_id))
    assert relay.answer(TrackingWrite(run_id, (_metric(1.0, 0),))) == TrackingWritten()
    assert [m.value for m in client.get_metric_history(run_id, "m")] == [1.0]
    assert relay.answer(TrackingWrite("another", (_metric(2.0, 1),))) == TrackingWritten(
        f"the driver writes only this job's run {run_id}; it refused records for run another"
    )
    client.delete_run(run_id)
    refused = relay.answer(TrackingWrite(run_id, (_metric(3.0, 2),)))
    assert not refused.outage
    assert "must be in the 'active' state" in refused.error


def test_the_relay_answers_outage_at_once_for_a_server_that_is_down(store: str) -> None:
    run_id = mlflow.MlflowClient().create_run("0").info.run_id
    url = f"http://127.0.0.1:{_closed_port()}"
    answer = Relay(tracking_target(url, run_id)).answer(
        TrackingWrite(run_id, (_metric(1.0, 0),)))
    assert answer.outage
    assert answer.error.startswith(
        f"the driver cannot connect to the tracking server at {url}: ")
    assert "Connection refused" in answer.error


def test_a_call_the_server_never_answers_holds_later_writes_until_it_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server that accepts connections but never answers: the relay answers "outage"
    at its deadline, then at once while that call runs; once the call ends (the server
    is gone), the next write is tried again."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "120")
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)  # the kernel accepts connections; nobody ever reads them
    url = f"http://127.0.0.1:{mute.getsockname()[1]}"
    relay = Relay(tracking_target(url, "r1"), timeout=0.5)
    write = TrackingWrite("r1", (_metric(1.0, 0),))
    try:
        first = relay.answer(write)
        assert first == TrackingWritten(
            f"the tracking server at {url} did not answer the driver within 0.5s", outage=True)
        assert relay.answer(write) == TrackingWritten(
            f"the tracking server at {url} has not yet answered the driver's previous write",
            outage=True)
    finally:
        mute.close()  # the pending connections are reset: the abandoned call ends
    answer = wait_until(lambda: (lambda a: a if "previous write" not in a.error else None)(
        relay.answer(write)), 60, "the abandoned call to end")
    assert answer.outage
    assert answer.error.startswith(f"the driver cannot connect to the tracking server at {url}")


@pytest.fixture()
def relaying_driver(store: str) -> Iterator[tuple[ChannelServer, TrackingTarget]]:
    """A driver channel whose requests a :class:`Relay` answers, and the job's run."""
    run_id = mlflow.MlflowClient().create_run("0").info.run_id
    target = tracking_target(store, run_id)
    relay = Relay(target)
    server = ChannelServer(SECRET, lambda message: None, "127.0.0.1",
                           lambda request: relay.answer(request))
    server.start()
    yield server, target
    server.stop()


def _connect(server: ChannelServer) -> Any:
    return lambda: ChannelClient("127.0.0.1", server.port, SECRET, timeout=10)


def test_rank_0_sends_batches_through_the_driver_and_artifacts_itself(
    relaying_driver: tuple[ChannelServer, TrackingTarget], tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, target = relaying_driver
    relayed: list[TrackingWrite] = []
    answer = Relay.answer
    monkeypatch.setattr(Relay, "answer",
                        lambda self, request: (relayed.append(request), answer(self, request))[1])
    sender = Sender(target, _connect(server))
    sender([Metric("m", 1.0, 1000, 0), Param("p", "x"), Tag("t", "y")])
    (tmp_path / "a.txt").write_text("hi")
    sender([Artifact(str(tmp_path / "a.txt"), "files")])
    sender.close()
    client = mlflow.MlflowClient()
    run = client.get_run(target.run_id)
    assert (run.data.metrics, run.data.params, run.data.tags["t"]) == ({"m": 1.0}, {"p": "x"}, "y")
    assert [a.path for a in client.list_artifacts(target.run_id, "files")] == ["files/a.txt"]
    # the driver wrote the batch; the file went from rank 0 straight to the store
    assert [[r.kind for r in w.records] for w in relayed] == [["metric", "param", "tag"]]


def test_a_written_checkpoint_commit_is_told_to_the_driver_after_it_is_written(
    store: str,
) -> None:
    """Rank 0 tells the driver of a checkpoint its batch committed, on the batch's own
    connection, once the store took it: the epoch and whether the loop called it its last;
    a commit the store refused, or one that names no checkpoint, tells nothing."""
    from mlflow_hvd.protocol.checkpoint_layout import LATEST_TAG, model_path
    from mlflow_hvd.protocol.messages import CheckpointCommitted
    from mlflow_hvd.protocol.records import Commit

    client = mlflow.MlflowClient()
    run_id = client.create_run("0").info.run_id
    target = tracking_target(store, run_id)
    relay = Relay(target)
    heard: list[tuple[object, bool]] = []  # (message, was the commit in the run by then)

    def on_message(message: object) -> None:
        tag = client.get_run(run_id).data.tags.get(LATEST_TAG)
        heard.append((message, tag == model_path(3)))

    server = ChannelServer(SECRET, on_message, "127.0.0.1", relay.answer)
    server.start()
    try:
        sender = Sender(target, _connect(server))
        checkpoint = Commit((_metric(0.5, 3),), (Tag(LATEST_TAG, model_path(3)),), 3, False)
        sender([_metric(1.0, 2)])
        sender([checkpoint])  # a commit is a batch of its own (records.next_batch)
        sender([Commit((_metric(0.4, 4),), (Tag("other", "x"),))])  # no checkpoint
        client.delete_run(run_id)
        with pytest.raises(TrackingError):
            sender([Commit((), (Tag(LATEST_TAG, model_path(4)),), 4, True)])
        sender.close()
    finally:
        server.stop()
    assert heard == [(CheckpointCommitted(0, 3, False), True)]


def test_the_drivers_refusal_and_outage_reach_rank_0_as_errors_the_delivery_classifies(
    relaying_driver: tuple[ChannelServer, TrackingTarget], store: str
) -> None:
    from mlflow_hvd.common.tracking_server import is_outage

    server, target = relaying_driver
    mlflow.MlflowClient().delete_run(target.run_id)
    sender = Sender(target, _connect(server))
    with pytest.raises(TrackingError, match="must be in the 'active' state") as refused:
        sender([Metric("m", 1.0, 1000, 0)])
    assert not is_outage(refused.value)
    server.stop()  # the driver is gone
    with pytest.raises(ConnectionError) as gone:
        sender([Metric("m", 1.0, 1000, 0)])
    assert is_outage(gone.value)
    assert str(gone.value).startswith(
        f"cannot reach the driver, which writes rank 0's records to {store}: ")


def test_a_driver_that_does_not_take_records_is_a_refusal_naming_the_run(store: str) -> None:
    from mlflow_hvd.common.tracking_server import is_outage

    server = ChannelServer(SECRET, lambda message: None, "127.0.0.1")  # answers Unanswered
    server.start()
    try:
        sender = Sender(tracking_target(store, "r9"), _connect(server))
        with pytest.raises(TrackingError) as info:
            sender([Metric("m", 5.0, 1000, 0)])
    finally:
        server.stop()
    assert str(info.value) == (
        "the driver did not take rank 0's records for run r9 (it answered Unanswered: this "
        "channel answers no requests): is the driver running another version of mlflow_hvd?"
    )
    assert not is_outage(info.value)


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_an_outage_the_driver_reports_reaches_rank_0_as_a_connection_error() -> None:
    from mlflow_hvd.common.tracking_server import is_outage

    target = tracking_target("http://127.0.0.1:9", "r1")  # nothing listens on port 9
    relay = Relay(target)
    server = ChannelServer(SECRET, lambda message: None, "127.0.0.1",
                           lambda request: relay.answer(request))
    server.start()
    try:
        sender = Sender(target, _connect(server))
        with pytest.raises(ConnectionError) as down:
            sender([Metric("m", 1.0, 1000, 0)])
        sender.close()
    finally:
        server.stop()
    assert is_outage(down.value)
    assert str(down.value).startswith(
        "the driver cannot connect to the tracking server at http://127.0.0.1:9: ")


def test_a_call_with_a_deadline_gives_its_value_its_error_or_up() -> None:
    """common.deadline's Running, the one home of "a call with a deadline" (the relay's
    writes, Spark stages, the run's bookkeeping): the value, the call's own exception
    raised in the caller, or DeadlineExceeded naming the call while it goes on."""
    import threading

    from mlflow_hvd.common.deadline import DeadlineExceeded, Running, call_within

    assert call_within(5, "adding", lambda a, b: a + b, 2, b=3) == 5
    with pytest.raises(KeyError, match="missing"):
        call_within(5, "failing", {}.__getitem__, "missing")
    release = threading.Event()
    slow = Running("waiting", release.wait, 10)
    assert not slow.wait(0.05) and not slow.done
    with pytest.raises(DeadlineExceeded, match="^waiting has not returned yet$"):
        slow.result()
    with pytest.raises(DeadlineExceeded, match=r"^blocking did not return within 0.05s$"):
        call_within(0.05, "blocking", release.wait, 10)
    release.set()
    assert slow.wait(5) and slow.result() is True
