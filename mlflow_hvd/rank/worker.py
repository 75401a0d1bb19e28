"""Worker entry point: ``python -m mlflow_hvd.rank.worker``.

Reads a :class:`~mlflow_hvd.protocol.messages.Bootstrap` line from stdin (the run secret
never appears on the command line or in the environment), connects to the driver, runs
``main(**kwargs)`` from the cloudpickled payload and reports the outcome:

* rank 0 sends its return value (:class:`WorkerResult`), every rank exits 0 on success;
* if ``main`` raises, the rank sends :class:`WorkerError` with its traceback and exits 1.

A pooled worker (``Bootstrap.pooled``, :mod:`mlflow_hvd.driver.pool`) does not exit after a
successful job: it shuts Horovod down, clears Keras' state, marks the end of the job's
output, and asks the driver for the next payload (:class:`AwaitJob`), until it is retired.

The worker dies with its parent (PR_SET_PDEATHSIG plus a polling watchdog), so a killed
Spark task or driver never leaves it behind.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import sys
import threading
import time
import traceback

import cloudpickle

from mlflow_hvd.common import code_sources, horovod_env
from mlflow_hvd.common.procs import set_parent_death_signal
from mlflow_hvd.errors import ChannelError, TrackingError
from mlflow_hvd.protocol import records
from mlflow_hvd.protocol.channel import ChannelClient
from mlflow_hvd.protocol.messages import (
    JOB_END_MARK,
    AwaitJob,
    Bootstrap,
    NextJob,
    Payload,
    TorchStoreWanted,
    WorkerError,
    WorkerResult,
    WorkerStarted,
)
from mlflow_hvd.rank import (
    context,
    credentials,
    frameworks,
    identity,
    keras_guard,
    shard,
    torch_dist,
)
from mlflow_hvd.rank.tracking import api as tracking_api
from mlflow_hvd.rank.tracking import job_env, plugin

EXIT_USER_ERROR = 1
EXIT_ORPHANED = 70
EXIT_NOT_FED = 75  # as a task that starts no rank (agent.spark_task.EXIT_NOT_LAUNCHED)


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            # Take the whole group (user subprocesses included) down with us.
            try:
                os.killpg(os.getpgrp(), signal.SIGKILL)
            finally:
                os._exit(EXIT_ORPHANED)
        time.sleep(0.5)


def main() -> int:
    boot = Bootstrap.from_json(sys.stdin.readline())
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != boot.parent_pid:
        return EXIT_ORPHANED
    threading.Thread(target=_watch_parent, args=(boot.parent_pid,), name="mlflow-hvd-watchdog",
                     daemon=True).start()

    signal.signal(signal.SIGTERM, _on_sigterm)
    me = identity.current()
    rank, host = me.rank, me.host
    client = ChannelClient(
        boot.driver_host, boot.driver_port, bytes.fromhex(boot.secret_hex), boot.channel_timeout
    )
    global _client
    _client = client
    context.install(client, rank)
    keras_guard.install()  # before the user's code can import Horovod's Keras layer
    torch_jobs = torch_dist.TorchJobs(lambda: client.send(TorchStoreWanted(rank)))
    torch_jobs.install()  # the driver starts the job's torch.distributed store when told
    # MLflow's own API in the training function writes through mlflow_hvd's store: MLflow
    # finds it by its entry points, which it reads when first imported
    plugin.ensure_registered(os.path.dirname(boot.payload_path))
    with open(boot.payload_path, "rb") as f:
        payload_bytes = f.read()
    next_job = NextJob(payload_bytes, tuple(boot.job_vars.items()))  # the first
    while True:
        client.send(WorkerStarted(rank, host))
        code = _run_job(client, rank, host, next_job, boot, torch_jobs)
        if code != 0 or not boot.pooled:
            return code  # the process ends with os._exit: the job's frame is never freed
        # after the job's outcome is reported, off the job's own time: the process group
        # the job left destroyed, then its frame (DDP's models after their groups' keepers)
        torch_jobs.end_job()
        torch_dist.release_locals()
        _end_pooled_job()
        try:
            # the driver answers within its idle limit (NextJob or Retire)
            answer = client.request(AwaitJob(rank), boot.idle_timeout + boot.channel_timeout)
        except ChannelError:  # the driver is gone or silent: nobody will hand out a job
            return EXIT_ORPHANED
        if not isinstance(answer, NextJob):  # Retire: the pool is closing
            return 0
        next_job = answer


def _run_job(client: ChannelClient, rank: int, host: str, job: NextJob,
             boot: Bootstrap, torch_jobs: torch_dist.TorchJobs) -> int:
    """Run one job's ``main`` and report its outcome; returns the exit code it earns."""
    applied: credentials.Applied | None = None
    try:
        torch_jobs.start_job(job.env)  # before the job's code is unpickled
        payload: Payload = pickle.loads(job.payload)
        main_fn, kwargs = cloudpickle.loads(payload.code.pickled)
        context.install(client, rank, payload.attempt)
        code_sources.restore([main_fn, kwargs], payload.code.code_files, payload.code.code_texts)
        # each DataFrame: this rank's shard, which its task may still be writing (the shard
        # waits on first use); rank 0 records each split when its shard is first used
        kwargs = shard.resolve(kwargs, boot.shards,
                               on_load=_announce_shard if rank == 0 else None)
        if rank == 0 and payload.tracking is not None:  # the driver's MLflow client settings
            sealed = credentials.fetch(client, rank)
            if sealed is not None:
                applied = credentials.apply(
                    bytes.fromhex(boot.secret_hex), sealed,
                    os.path.join(os.path.dirname(boot.payload_path), "credentials"))
        tracking_api.configure(payload.tracking, rank, identity.current().local_rank, host)
        saved = job_env.enter(payload.tracking, rank) if payload.tracking else None
        try:
            value = torch_dist.call_holding_locals(main_fn, **kwargs)
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
            value = None
        finally:
            if saved is not None:
                job_env.leave(saved)
        shard.settle(kwargs)  # a job whose data was not fed fails, used or not
        if rank == 0:
            _log_horovod_files()
        _finish_tracking(client, strict=True)  # before reporting success: nothing is lost
        if rank == 0:
            client.send(WorkerResult(rank, cloudpickle.dumps(value)))
    except BaseException as exc:
        # keep what was logged up to the failure; the job is going down: hand the rest to
        # the driver soon rather than keep the other ranks' stop waiting
        _finish_tracking(client, strict=False, timeout=SIGTERM_DRAIN)
        if _feed_failed(exc):  # the driver has the feed's error from the tasks: not ours
            sys.stderr.write(f"mlflow_hvd: rank {rank} stops: its data was not fed\n")
            return EXIT_NOT_FED
        return _report(client, rank, host, exc)
    finally:
        credentials.remove(applied)
        sys.stdout.flush()
        sys.stderr.flush()
    return 0


def _end_pooled_job() -> None:
    """Leave the process as the next job expects it: Horovod shut down (the next ``main``
    calls ``hvd.init()`` again), Keras' global state cleared and the job's garbage
    collected, then the end-of-job mark on both streams after everything the job printed.

    What survives a job (imported modules, caches) is frozen out of the garbage collector
    (``gc.freeze``): a full collection over TensorFlow's objects would otherwise cost a
    noticeable share of every job (docs/usage.md, "Warm ranks"). The cost: an
    object alive now that later becomes garbage *inside a reference cycle* (say a global
    the next job replaces) is not collected; without cycles, reference counting still
    frees it.
    """
    _shutdown_horovod()
    keras = sys.modules.get("keras")
    if keras is not None:
        keras.backend.clear_session(free_memory=False)
    gc.collect()
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    mark = (JOB_END_MARK + "\n").encode()
    os.write(1, mark)
    os.write(2, mark)


DROP_WARNING = 0.01  # rows left out for equal shards past which rank 0 warns the driver


def _feed_failed(exc: BaseException | None) -> bool:
    """Whether ``exc`` comes from a shard whose feed failed (raised through the training
    function's own handlers or not)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, shard.FeedNotDelivered):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _announce_shard(value: shard.Shard) -> None:
    """Rank 0: record a DataFrame argument's split in the run (tags), and warn the driver
    when more than 1% of its rows were left out to make the shards equal."""
    prefix = f"mlflow_hvd.data.{value.argument}"
    tracking_api.set_tags({f"{prefix}.rows_per_rank": value.rows,
                           f"{prefix}.total_rows": value.total_rows,
                           f"{prefix}.dropped_rows": value.dropped})
    if value.dropped > DROP_WARNING * value.total_rows:
        context.log_to_driver(
            f"mlflow_hvd: warning: {value.dropped} of the {value.total_rows} rows of "
            f"{value.argument}= ({100 * value.dropped / value.total_rows:.1f}%) are left "
            f"out so that every rank has {value.rows}: Spark's round-robin split gives "
            "ranks counts that differ by up to the DataFrame's number of partitions; "
            "coalesce it to fewer partitions, pass more rows or lower np")


def _log_horovod_files() -> None:
    """Rank 0: log the timeline and autotune log Horovod wrote on this host into the job's
    run. Horovod completes them when it shuts down, so it is shut down first (the job's
    collectives are over once ``main`` returned)."""
    files = [(os.environ[var], artifact) for var, artifact in horovod_env.FILES.items()
             if os.environ.get(var)]
    if not files:
        return
    _shutdown_horovod()
    for path, artifact in files:
        if os.path.isfile(path):
            tracking_api.log_artifact(path, os.path.dirname(artifact))
        else:
            sys.stderr.write(f"mlflow_hvd: Horovod wrote no {os.path.basename(artifact)} "
                             f"(expected at {path}); did main call hvd.init()?\n")


def _shutdown_horovod() -> None:
    """Shut down the Horovod of each framework the job initialised (each of
    ``horovod.tensorflow`` and ``horovod.torch`` has its own library and state)."""
    for name in ("horovod.tensorflow", "horovod.torch"):
        hvd = sys.modules.get(name)
        if hvd is None:
            continue
        try:
            if hvd.is_initialized():
                hvd.shutdown()
        except Exception as exc:  # the outcome is already reported; say why Horovod didn't
            sys.stderr.write(f"mlflow_hvd: {name} shutdown failed: {type(exc).__name__}: "
                             f"{exc}\n")


_client: ChannelClient | None = None
SIGTERM_DRAIN = 2.0  # seconds a stopped rank 0 gives MLflow before handing records over


def _finish_tracking(client: ChannelClient, strict: bool, timeout: float | None = None,
                     lock_timeout: float | None = None) -> None:
    """Deliver rank 0's queued records; hand what the server did not take to the driver.

    Raises:
        TrackingError: With ``strict``, records the store refused (not an outage).
    """
    try:
        undelivered, refusal = tracking_api.shutdown(timeout)
    except Exception as exc:  # tracking itself broke: say so, never hide it
        if strict:
            raise
        sys.stderr.write(f"mlflow_hvd: final delivery to MLflow failed: {exc}\n")
        return
    if undelivered is not None:
        what = records.describe(records.count(undelivered.records))
        sys.stderr.write(
            f"mlflow_hvd: {what} did not reach the tracking server "
            f"{undelivered.tracking_uri} ({undelivered.reason}); handing them to the driver\n"
        )
        try:
            client.send(undelivered, lock_timeout=lock_timeout)
        except Exception as exc:
            sys.stderr.write(f"mlflow_hvd: LOST {what}: cannot hand them to the driver: {exc}\n")
    if refusal:
        if strict:
            raise TrackingError(refusal)
        sys.stderr.write(f"mlflow_hvd: {refusal}\n")


def _on_sigterm(signum: int, frame: object) -> None:
    """Stopped by the driver: deliver what is queued for MLflow (hand the rest to the
    driver), then die of the signal.

    Runs only when the main thread executes Python; a rank stuck in a collective is ended
    by the SIGKILL that follows after ``stop_grace``. Never blocks on a lock the interrupted
    code may hold: the tracking state uses re-entrant locks, the channel a bounded wait.
    """
    if _client is not None:
        _finish_tracking(_client, strict=False, timeout=SIGTERM_DRAIN, lock_timeout=1.0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _report(client: ChannelClient, rank: int, host: str, exc: BaseException) -> int:
    tb = "".join(traceback.format_exception(exc))
    sys.stderr.write(tb)
    sys.stderr.flush()
    summary = (f"{type(exc).__name__}: {exc}".rstrip(": ")
               + (torch_dist.hint(exc) or frameworks.hint(exc)))
    client.send(WorkerError(rank, host, summary, tb, time.time()))
    return EXIT_USER_ERROR


def _leave(code: int) -> None:
    """End the process now: the outcome and every log are delivered.

    Skips the interpreter's teardown (slow with TensorFlow and MLflow loaded), so
    ``atexit`` hooks do not run in ranks, as in ``multiprocessing`` children: put cleanup
    in a ``finally`` inside ``main``. Horovod is shut down first on success (its peers
    finish the same way); a failed rank leaves at once, because Horovod's shutdown would
    wait for peers that are still inside a collective while the driver is stopping them.
    """
    if code == 0:
        _shutdown_horovod()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _leave(main())
