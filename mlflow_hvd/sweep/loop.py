"""Driver side: a sweep's trials on hyperopt's own loop, ``fmin``, one at a time or several
at once.

One at a time, ``fmin`` evaluates each point itself (a synchronous ``Trials``), in the
sweep's thread. Several at once, it works as with hyperopt's ``SparkTrials``: the ``Trials``
is asynchronous, ``fmin`` inserts each point it suggests and polls for the results, and the
``Trials`` (:class:`~.fmin_trials.SweepTrials`) runs each new point in a thread of its own
on a free slot (:mod:`.slots`) and fills in its result. A slot is one
:class:`~mlflow_hvd.runner.HorovodRunner` with its own warm generation of ``np`` ranks;
``parallelism`` slots share the sweep's SparkSession (each trial is its own barrier stage)
or, for ``np < 0``, the driver machine.

Either way ``fmin`` suggests a point only when a slot is free, so TPE sees every trial that
ended (and the running ones, as pending, as with ``SparkTrials``); and trial ``n`` is
suggested with a random state of its own, ``(seed, n + 1)``, so that a sweep suggests the
same points whether it ran straight through or was resumed, and the first
``n_startup_jobs`` (TPE's random ones) whatever the parallelism. Trials are numbered in the
order they were suggested.

Stopping is cooperative: Ctrl-C or SIGTERM in the sweep's thread ends ``fmin``; every running
trial's runner is then told to stop (:meth:`HorovodRunner.stop`), which ends its job as
Ctrl-C would: ranks stopped, Spark job group cancelled, child run KILLED.

The ``Trials`` and the seeded suggestions are :mod:`.fmin_trials` (imported when a sweep
runs: hyperopt takes seconds to import).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.runner import HorovodRunner
from mlflow_hvd.sweep.pruning import LiveHistory
from mlflow_hvd.sweep.slots import Slots
from mlflow_hvd.sweep.trial import TAG, Notes, Plan, run_trial
from mlflow_hvd.sweep.trials_store import no_progress, save_trials

log = logging.getLogger(__name__)



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


def run_trials(client: Any, parent_id: str, saved: Any, plan: Plan,
               runner: HorovodRunner, at_once: int) -> Any:
    """The sweep's remaining trials, ``at_once`` at a time (each slot its own warm runner
    in the same Spark application, the first ``runner``); the finished trials saved in the
    parent run and the early-stop rule checked after each one ends."""
    notes = Notes()
    saved_count = [len(saved.trials) if saved is not None else 0]

    def after_each(trials: Any) -> bool:
        finished = trials.finished()
        if len(finished.trials) == saved_count[0]:
            return False
        saved_count[0] = len(finished.trials)
        save_trials(client, parent_id, finished)
        ended = [d["result"] for d in sorted(finished.trials, key=lambda d: d["tid"])]
        if plan.early_stop_rounds and no_progress(ended, plan.early_stop_rounds):
            client.set_tag(parent_id, f"{TAG}early_stopped", f"after {len(ended)} trials")
            return True
        return False

    from mlflow_hvd.sweep.fmin_trials import SweepTrials, search

    if at_once == 1:
        trials = SweepTrials(1)
        trials.resume(saved)

        def evaluate(params: dict[str, Any]) -> dict[str, Any]:
            done = trials.results[:-1]  # hyperopt already holds this trial's empty result
            return run_trial(client, len(trials.trials) - 1, params, plan, runner, done,
                             notes)

        search(trials, plan, evaluate, after_each)
        after_each(trials)  # what ended after fmin's last poll is saved too
        return trials

    live = LiveHistory(saved.results if saved is not None else [], plan.sign)

    def run(tid: int, params: dict[str, Any], slot: HorovodRunner) -> dict[str, Any]:
        result = run_trial(client, tid, params, plan, slot, None, notes, live=live,
                           parent_run_id=parent_id)
        live.end(tid, result)
        return result

    with contextlib.ExitStack() as stack:
        runners = [runner]
        for _ in range(at_once - 1):  # the session is up: they share it
            other = plan.runner()
            runners.append(stack.enter_context(other) if plan.warm else other)
        slots = Slots(runners, run)
        trials = SweepTrials(at_once, plan.space, slots)
        trials.resume(saved)
        try:
            search(trials, plan, None, after_each)
            after_each(trials)  # fmin waits for the last trials without polling this
        except BaseException:
            slots.stop()
            raise
        finally:
            slots.close()
    return trials
