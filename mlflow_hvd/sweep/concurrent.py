"""Driver side: a sweep's trials several at a time, each on its own slot of warm ranks.

A slot is one :class:`~mlflow_hvd.runner.HorovodRunner` with its own warm generation of
``np`` ranks; ``parallelism`` slots share the sweep's SparkSession (each trial is its own
barrier stage) or, for ``np < 0``, the driver machine. Hyperopt is asked for a new point
each time a slot is free (TPE sees the pending trials, as with ``SparkTrials``: they count
as suggested and as not yet good); trial ``n`` is suggested with the same random state as
in a sequential sweep, so the first ``n_startup_jobs`` points (TPE's random ones) are the
same whatever the parallelism. Trials are numbered in the order they were suggested.

A trial that fails, is retried or is pruned frees its slot for the next suggestion; one
that hangs holds only its own slot. Ctrl-C or SIGTERM (in the main thread) stops every
running trial the way Ctrl-C stops one job: the interrupt is raised in each trial's thread,
whose runner stops its ranks, cancels its Spark job group and ends its run KILLED.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.runner import HorovodRunner
from mlflow_hvd.sweep.pruning import LiveHistory
from mlflow_hvd.sweep.trial import TAG, Notes, Plan, run_trial
from mlflow_hvd.sweep.trials_store import no_progress, save_trials

log = logging.getLogger(__name__)

STOP_WAIT = 60.0  # seconds interrupted trials get to stop their ranks and end their runs


def check_parallelism(parallelism: object) -> int | str:
    if parallelism == "auto":
        return "auto"
    if isinstance(parallelism, bool) or not isinstance(parallelism, int) or parallelism < 1:
        raise ConfigurationError(
            f"parallelism must be a whole number >= 1 (trials at once) or 'auto', got "
            f"{parallelism!r}")
    return parallelism


def resolve_parallelism(parallelism: int | str, np: int, runner: HorovodRunner,
                        remaining: int) -> int:
    """How many trials run at once: ``parallelism``, or for ``"auto"`` as many as fit.

    ``np > 0``: the session's task slots (executors x cores / ``spark.task.cpus``, as the
    master declares them, else as registered now) hold ``slots // np`` barrier stages of
    ``np`` tasks at once; more would leave stages waiting for each other's slots, so a
    larger ``parallelism`` is refused. ``np < 0``: ``auto`` is the driver's cores // -np.
    Never more than the trials left to run.

    Raises:
        ConfigurationError: ``parallelism * np`` exceeds the cluster's slots.
    """
    if parallelism == 1:
        return 1
    found = runner.task_slots()
    slots = found.count
    fit = max(1, slots // abs(np))
    if np < 0:
        chosen = fit if parallelism == "auto" else int(parallelism)
        return max(1, min(chosen, remaining))
    if parallelism == "auto":
        log.info("sweep parallelism='auto': %d slots // np=%d -> %d trials at once",
                 slots, np, fit)
        return max(1, min(fit, remaining))
    if int(parallelism) * np > slots:
        raise ConfigurationError(
            f"parallelism={parallelism} with np={np} needs {int(parallelism) * np} barrier "
            f"task slots at once, but {found.where} has {slots}: "
            f"at most {fit} trials of np={np} fit. Use parallelism={fit} or 'auto', or add "
            "executors or cores")
    return max(1, min(int(parallelism), remaining))


def run_slots(client: Any, parent_id: str, trials: Any, plan: Plan,
               runner: HorovodRunner, at_once: int) -> None:
    """The remaining trials ``at_once`` at a time, each slot its own (warm) runner in the
    same Spark application; the history saved and the early-stop rule checked after each
    trial ends."""

    def after_each() -> bool:
        kept = finished_only(trials)
        save_trials(client, parent_id, kept)
        ended = [d["result"] for d in sorted(kept.trials, key=lambda d: d["tid"])]
        if plan.early_stop_rounds and no_progress(ended, plan.early_stop_rounds):
            client.set_tag(parent_id, f"{TAG}early_stopped", f"after {len(ended)} trials")
            return True
        return False

    with contextlib.ExitStack() as stack:
        slots = [runner]
        for _ in range(at_once - 1):  # the session is up: they share it
            other = plan.runner()
            slots.append(stack.enter_context(other) if plan.warm else other)
        run_concurrently(client, parent_id, trials, plan, slots, after_each)


def run_concurrently(client: Any, parent_id: str, trials: Any, plan: Plan,
                     runners: list[HorovodRunner],
                     after_each: Callable[[], bool]) -> None:
    """Run the sweep's remaining trials, ``len(runners)`` at a time; ``after_each`` (the
    history saved, the early-stop rule) is called on the main thread after each trial
    ends and returns True to stop suggesting."""
    from hyperopt import Domain

    domain = Domain(lambda params: None, plan.space)
    live = LiveHistory(trials.results, plan.sign)
    notes = Notes()
    free = list(runners)
    running: dict[Future[dict[str, Any]], tuple[dict[str, Any], HorovodRunner]] = {}
    threads: dict[int, int] = {}  # trial -> its thread's ident
    stop = False
    pool = ThreadPoolExecutor(len(runners), thread_name_prefix="mlflow-hvd-trial")
    try:
        while True:
            while free and not stop and len(trials.trials) < plan.max_evals:
                doc, params = _suggest(trials, domain, plan)
                runner = free.pop()
                future = pool.submit(_trial, client, doc["tid"], params, plan, runner,
                                     live, notes, parent_id, threads)
                running[future] = (doc, runner)
            if not running:
                return
            done, _ = wait(running, timeout=0.5, return_when=FIRST_COMPLETED)
            for future in done:
                doc, runner = running.pop(future)
                result = future.result(timeout=0)  # in `done`: it has ended, no wait
                _record(trials, doc, result)
                live.end(doc["tid"], result)
                free.append(runner)
                stop = after_each() or stop
    except BaseException:
        _interrupt(running, threads)
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # the waits above have deadlines


def _suggest(trials: Any, domain: Any, plan: Plan) -> tuple[dict[str, Any], dict[str, Any]]:
    """A new trial document from TPE, marked running, and its params."""
    import numpy
    from hyperopt import JOB_STATE_RUNNING, space_eval, tpe
    from hyperopt.utils import coarse_utcnow

    (tid,) = trials.new_trial_ids(1)
    # the sequential sweep's random state for trial tid (fmin's draw from it)
    seed = int(numpy.random.default_rng([plan.seed, tid + 1]).integers(2**31 - 1))
    (doc,) = tpe.suggest([tid], domain, trials, seed)
    doc["state"] = JOB_STATE_RUNNING
    doc["book_time"] = coarse_utcnow()
    trials.insert_trial_docs([doc])
    trials.refresh()
    vals = {k: v[0] for k, v in doc["misc"]["vals"].items() if v}
    return doc, space_eval(plan.space, vals)


def _trial(client: Any, index: int, params: dict[str, Any], plan: Plan,
           runner: HorovodRunner, live: LiveHistory, notes: Notes, parent_id: str,
           threads: dict[int, int]) -> dict[str, Any]:
    threads[index] = threading.get_ident()
    try:
        return run_trial(client, index, params, plan, runner, None, notes, live=live,
                         parent_run_id=parent_id)
    finally:
        threads.pop(index, None)


def _record(trials: Any, doc: dict[str, Any], result: dict[str, Any]) -> None:
    from hyperopt import JOB_STATE_DONE
    from hyperopt.utils import coarse_utcnow

    for stored in trials._dynamic_trials:
        if stored["tid"] == doc["tid"]:
            stored["result"] = result
            stored["state"] = JOB_STATE_DONE
            stored["refresh_time"] = coarse_utcnow()
    trials.refresh()


def finished_only(trials: Any) -> Any:
    """A copy of ``trials`` without the running ones (what is saved: a resumed sweep runs
    an interrupted trial's point again as a new trial), keeping the ids already handed out
    so that trial numbers stay unique."""
    import copy

    from hyperopt import JOB_STATE_DONE, Trials

    kept = Trials()
    kept.insert_trial_docs([copy.deepcopy(d) for d in trials._dynamic_trials
                            if d["state"] == JOB_STATE_DONE])
    kept._ids = set(trials._ids)
    kept.refresh()
    return kept


def _interrupt(running: dict[Future[dict[str, Any]], Any], threads: dict[int, int]) -> None:
    """Raise KeyboardInterrupt in every running trial's thread (its runner then stops the
    job as on Ctrl-C) and wait, within :data:`STOP_WAIT`, for them to end."""
    for index, ident in list(threads.items()):
        log.info("sweep: stopping trial %d", index)
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident),
                                                   ctypes.py_object(KeyboardInterrupt))
    deadline = time.monotonic() + STOP_WAIT
    for future in running:
        try:
            future.result(timeout=max(0.0, deadline - time.monotonic()))
        except BaseException as exc:  # the trial's own interrupt, or its last error
            log.debug("sweep: a stopped trial ended with %s", type(exc).__name__)

