"""Driver side: hyperopt's ``Trials`` for a sweep, and TPE seeded per trial (see
:mod:`.loop`).

Hyperopt's names that are not its public API are read in this module only, in
:class:`SweepTrials` (a ``Trials`` subclass, as hyperopt's own ``SparkTrials`` is), each
with why; checked on hyperopt 0.3.0, the release supported.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

from hyperopt import Trials

from mlflow_hvd.sweep.slots import Outcome, Slots
from mlflow_hvd.sweep.trial import Plan


def trial_seed(seed: int, tid: int) -> int:
    """The random state TPE suggests trial ``tid`` with: what ``fmin`` draws from a
    generator seeded with ``(seed, tid + 1)``."""
    import numpy

    return int(numpy.random.default_rng([seed, tid + 1]).integers(2**31 - 1))


def seeded_tpe(seed: int) -> Callable[..., list[dict[str, Any]]]:
    """TPE as ``fmin``'s ``algo``, suggesting each trial with :func:`trial_seed` rather than
    ``fmin``'s own draw (which depends on how many points one ``fmin`` call suggested)."""
    from hyperopt import tpe

    def suggest(new_ids: Sequence[int], domain: Any, trials: Any,
                _seed: int) -> list[dict[str, Any]]:
        tid = new_ids[0]  # fmin asks for one at a time (max_queue_len=1)
        docs: list[dict[str, Any]] = tpe.suggest([tid], domain, trials, trial_seed(seed, tid))
        return docs

    return suggest


class SweepTrials(Trials):
    """hyperopt's ``Trials`` for a sweep of ``slots`` trials at once (asynchronous when
    more than one): ``fmin`` suggests a point only when a slot is free, and the points it
    inserts are run on :class:`Slots`."""

    def __init__(self, slots: int, space: dict[str, Any] | None = None,
                 on: Slots | None = None) -> None:
        self.slots = slots
        self.asynchronous = slots > 1  # read by fmin: it then polls for results
        self._space, self._on = space, on
        self._lock = threading.Lock()
        self._ended: dict[int, Outcome] = {}  # outcomes not yet in their documents
        super().__init__()  # which refreshes

    def resume(self, saved: Any) -> None:
        """Take the finished trials of a saved sweep (``saved``: a ``Trials``)."""
        if saved is None:
            return
        self.insert_trial_docs(saved.trials)
        # Private: the trial ids handed out. A saved sweep keeps those of the trials that
        # were running when it stopped (their documents are not saved: a resumed sweep runs
        # their points again, as new trials); hyperopt numbers new trials by how many ids
        # it handed out, so without them new trials would take the numbers of finished ones.
        self._ids = set(saved._ids)
        self.refresh()

    def finished(self) -> Any:
        """A plain ``Trials`` of the finished trials, with every id handed out: what is
        saved (see :meth:`resume`)."""
        from hyperopt import JOB_STATE_DONE, Trials

        kept = Trials()
        kept.insert_trial_docs([d for d in self.trials if d["state"] == JOB_STATE_DONE])
        kept._ids = set(self._ids)  # private, as in resume()
        kept.refresh()
        return kept

    def ended(self, tid: int, outcome: Outcome) -> None:
        """Trial ``tid`` ended (called in its thread): its result goes into its document on
        the next poll of ``fmin``."""
        with self._lock:
            self._ended[tid] = outcome

    def count_by_state_unsynced(self, arg: Any) -> int:
        from hyperopt import JOB_STATE_NEW, JOB_STATE_RUNNING

        self._take_ended()
        if arg == JOB_STATE_NEW:
            # fmin's queue, which it fills up to max_queue_len (1): counting the running
            # trials too, less the slots, it suggests a point only when a slot is free
            unfinished = int(super().count_by_state_unsynced([JOB_STATE_NEW,
                                                              JOB_STATE_RUNNING]))
            return max(0, unfinished - self.slots + 1)
        return int(super().count_by_state_unsynced(arg))

    def refresh(self) -> None:
        self._take_ended()
        if self.asynchronous:
            self._start_new()
        super().refresh()

    def _documents(self) -> list[dict[str, Any]]:
        # Private: the documents fmin inserted, in insertion order. fmin counts states on
        # them between refreshes, so a trial's result must be written there (SparkTrials
        # writes it the same way).
        docs: list[dict[str, Any]] = self._dynamic_trials
        return docs

    def _take_ended(self) -> None:
        from hyperopt import JOB_STATE_DONE
        from hyperopt.utils import coarse_utcnow

        with self._lock:
            ended, self._ended = self._ended, {}
        if not ended:
            return
        error: BaseException | None = None
        for doc in self._documents():
            outcome = ended.pop(doc["tid"], None)
            if outcome is None:
                continue
            if isinstance(outcome, BaseException):
                error = error or outcome
                continue
            doc["result"], doc["state"] = outcome, JOB_STATE_DONE
            doc["refresh_time"] = coarse_utcnow()
        if ended:  # not inserted yet (a trial that ended at once): the next poll
            with self._lock:
                self._ended.update(ended)
        if error is not None:  # a trial raised what is not a trial's failure: the sweep ends
            raise error

    def _start_new(self) -> None:
        from hyperopt import JOB_STATE_NEW, JOB_STATE_RUNNING, space_eval
        from hyperopt.utils import coarse_utcnow

        assert self._on is not None and self._space is not None  # asynchronous: both given
        for doc in self._documents():
            if doc["state"] != JOB_STATE_NEW:
                continue
            vals = {k: v[0] for k, v in doc["misc"]["vals"].items() if v}
            doc["state"], doc["book_time"] = JOB_STATE_RUNNING, coarse_utcnow()
            self._on.start(doc["tid"], space_eval(self._space, vals), self.ended)


def _not_evaluated(params: Any) -> None:
    """fmin's objective when trials run asynchronously (it is never called; fmin pickles
    it with the space)."""


def search(trials: SweepTrials, plan: Plan,
           evaluate: Callable[[dict[str, Any]], dict[str, Any]] | None,
           after_each: Callable[[SweepTrials], bool]) -> None:
    """``fmin`` over ``plan.space`` until ``plan.max_evals`` trials (those ``trials``
    already holds included) or ``after_each`` (called after each poll) says stop. One trial
    at a time: ``evaluate`` runs each point; several: ``trials`` runs them."""
    import numpy
    from hyperopt import fmin
    from hyperopt.exceptions import AllTrialsFailed

    with contextlib.suppress(AllTrialsFailed):  # fmin's closing argmin when none succeeded
        fmin(
            evaluate if evaluate is not None else _not_evaluated,
            plan.space,
            algo=seeded_tpe(plan.seed),
            max_evals=plan.max_evals,
            trials=trials,
            rstate=numpy.random.default_rng(plan.seed),  # unused: seeded_tpe seeds each trial
            allow_trials_fmin=False,
            max_queue_len=1,
            early_stop_fn=lambda t, *_: (after_each(t), []),
            show_progressbar=False,
            return_argmin=False,
        )
