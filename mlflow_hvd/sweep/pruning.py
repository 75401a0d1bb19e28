"""Driver side: pruning a sweep's trials at epoch boundaries, the rules and the judge of one
trial.

Every value rank 0 logs of the sweep's metric with a step reaches the trial's
:class:`TrialJudge` (an :class:`~mlflow_hvd.runner.EpochJudge`; see
:mod:`mlflow_hvd.rank.tracking.pruning`); the judge compares the trial with the curves of the
trials before it (:class:`History`, rebuilt from the saved hyperopt results when a sweep is
resumed, so a resumed sweep decides as an uninterrupted one would) and answers at once.

Values are compared "lower is better" after multiplying by the sweep's sign (-1 when the
metric is maximised). The rules are the published ones: the median rule compares a trial's
best value in its first ``k`` epochs with the median of the earlier trials' values *at*
epoch ``k`` (Optuna's ``MedianPruner``), ASHA ranks the trials by their value at the rung
(Li et al.; Ray Tune, Optuna). An earlier trial's best-so-far would be a biased bar: on a
noisy curve it is the luckiest epoch, lower than the value the trial ends with, and it
stops trials that would have ended better.

Epochs are counted, not read from the step: the ``k``-th distinct step a trial reported is
its epoch ``k`` (1-based), whatever step numbering the training function uses; a restarted
attempt that logs a step again replaces its value.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlflow_hvd.common.options import check_positive_int
from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.runner import EpochDecision


@dataclass(frozen=True)
class Curve:
    """One earlier trial as the rules see it: its signed values per epoch and whether it
    trained to its end (False: it was pruned)."""

    values: tuple[float, ...]
    finished: bool

    def at(self, epoch: int) -> float:
        """The signed value at (1-based) ``epoch``."""
        return self.values[epoch - 1]


@dataclass(frozen=True)
class Cut:
    """A rule's bar at one epoch: a trial whose own value (the rule's :meth:`own`) is above
    ``threshold`` (signed) is pruned; ``what`` and ``trials`` say where the bar comes
    from."""

    threshold: float
    what: str
    trials: int


@dataclass(frozen=True)
class MedianRule:
    """Median stopping as Optuna's ``MedianPruner`` defines it (Google Vizier and Ray Tune's
    ``MedianStoppingRule`` take the median of running averages instead, a laxer bar): once
    ``min_trials`` earlier trials have finished, stop a trial after epoch
    ``k >= grace_epochs`` when its best value so far is worse than the median of the
    earlier trials' values at epoch ``k`` (over the earlier trials, finished or pruned,
    that reached epoch ``k``)."""

    grace_epochs: int = 1
    min_trials: int = 3
    name: str = field(default="median", init=False)

    def __post_init__(self) -> None:
        check_positive_int("grace_epochs", self.grace_epochs)
        check_positive_int("min_trials", self.min_trials)

    def cut(self, earlier: Sequence[Curve], epoch: int) -> Cut | None:
        if epoch < self.grace_epochs or sum(c.finished for c in earlier) < self.min_trials:
            return None
        reached = [c.at(epoch) for c in earlier if len(c.values) >= epoch]
        if len(reached) < self.min_trials:
            return None
        return Cut(statistics.median(reached), "the median", len(reached))

    @staticmethod
    def own(signed: Sequence[float]) -> float:
        """What of the judged trial is held against the bar: its best value so far."""
        return min(signed)

    @staticmethod
    def own_words(metric: str, epoch: int, sign: float) -> str:
        return (f"its {'lowest' if sign > 0 else 'highest'} {metric} in {epoch} "
                f"epoch{'s' if epoch != 1 else ''}")


@dataclass(frozen=True)
class AshaRule:
    """Asynchronous successive halving (ASHA, Li et al. 2020; Ray Tune's
    ``ASHAScheduler`` in its stopping form): rungs at epochs ``grace_epochs * eta**j``; at a
    rung, a trial goes on only if its value at the rung is among the top ``1/eta`` of the
    values of the trials that reached the rung, itself included (at least the best one
    goes on). A rung judges once at least ``eta`` earlier trials reached it."""

    grace_epochs: int = 1
    eta: int = 3
    name: str = field(default="asha", init=False)

    def __post_init__(self) -> None:
        check_positive_int("grace_epochs", self.grace_epochs)
        check_positive_int("eta", self.eta, 2)

    def rungs(self, max_epochs: int) -> list[int]:
        out, rung = [], self.grace_epochs
        while rung <= max_epochs:
            out.append(rung)
            rung *= self.eta
        return out

    def cut(self, earlier: Sequence[Curve], epoch: int) -> Cut | None:
        if epoch not in self.rungs(epoch):
            return None
        reached = sorted(c.at(epoch) for c in earlier if len(c.values) >= epoch)
        if len(reached) < self.eta:
            return None
        # with this trial, n = len(reached) + 1 reached the rung; the top max(1, n // eta)
        # go on: this trial does if it is not worse than the earlier trial at that place
        keep = max(1, (len(reached) + 1) // self.eta)
        return Cut(reached[keep - 1], f"the top 1/{self.eta} (the {_ordinal(keep)} best)",
                   len(reached))

    @staticmethod
    def own(signed: Sequence[float]) -> float:
        """What of the judged trial is held against the bar: its value at the rung."""
        return signed[-1]

    @staticmethod
    def own_words(metric: str, epoch: int, sign: float) -> str:
        return f"its {metric} at epoch {epoch}"


Rule = MedianRule | AshaRule


def make_rule(prune: Any, grace_epochs: int) -> Rule | None:
    """``sweep(prune=...)``: None, "none", "median", "asha", or a rule instance.

    Raises:
        ConfigurationError: Anything else, naming what is accepted.
    """
    if prune is None or prune == "none":
        return None
    if isinstance(prune, MedianRule | AshaRule):
        if grace_epochs != 1:
            raise ConfigurationError(
                f"grace_epochs={grace_epochs!r} goes with prune='median' or 'asha'; a rule "
                f"instance carries its own: {type(prune).__name__}(grace_epochs=...)")
        return prune
    if prune == "median":
        return MedianRule(grace_epochs=grace_epochs)
    if prune == "asha":
        return AshaRule(grace_epochs=grace_epochs)
    raise ConfigurationError(
        f"prune must be None, 'median', 'asha' or a MedianRule/AshaRule, got {prune!r}")


@dataclass(frozen=True)
class History:
    """The curves of a sweep's earlier trials that ran (failed trials are left out)."""

    curves: tuple[Curve, ...] = ()

    @staticmethod
    def from_results(results: Sequence[dict[str, Any]], sign: float) -> History:
        """From hyperopt's saved results (``curve``: the metric per epoch, raw;
        ``pruned_at_epoch``: 0 or the epoch it stopped after)."""
        curves = []
        for r in results:
            values = r.get("curve")
            if r.get("status") != "ok" or not values:
                continue
            curves.append(Curve(tuple(sign * float(v) for v in values),
                                not r.get("pruned_at_epoch")))
        return History(tuple(curves))


class LiveHistory:
    """The history concurrent trials are judged against: the trials that ended (finished or
    pruned) and the epochs the running ones have reached so far, whichever ends first. A
    running trial's curve counts as not finished (the median rule's ``min_trials`` counts
    ended trials only); ASHA ranks every trial that reached the rung."""

    def __init__(self, results: Sequence[dict[str, Any]], sign: float) -> None:
        self.sign = sign
        self._lock = threading.Lock()
        self._ended = list(History.from_results(results, sign).curves)
        self._running: dict[int, tuple[float, ...]] = {}  # signed values by trial

    def report(self, trial: int, raw: tuple[float, ...]) -> None:
        with self._lock:
            self._running[trial] = tuple(self.sign * v for v in raw)

    def end(self, trial: int, result: dict[str, Any]) -> None:
        with self._lock:
            self._running.pop(trial, None)
            self._ended.extend(History.from_results([result], self.sign).curves)

    def without(self, trial: int) -> History:
        """Every other trial, as of now."""
        with self._lock:
            live = [Curve(v, False) for t, v in self._running.items() if t != trial and v]
            return History((*self._ended, *live))


@dataclass(frozen=True)
class JudgedTrial:
    """What one trial's judge saw: the metric per epoch (raw values, in step order), the
    epoch it was pruned after (0: it was not), and whether it trained on after being told
    to stop (its training function does not call ``should_prune``)."""

    curve: tuple[float, ...]
    pruned_at_epoch: int
    ignored_at_epoch: int = 0


class TrialJudge:
    """Answers one trial's epoch reports (an :class:`~mlflow_hvd.runner.EpochJudge`);
    called on the driver's channel thread, once per epoch."""

    def __init__(self, rule: Rule, history: History | Callable[[], History], metric: str,
                 sign: float, max_epochs: int | None,
                 on_values: Callable[[tuple[float, ...]], None] | None = None) -> None:
        """``history``: the earlier trials, or (concurrent trials) a callable that gives
        them as of each verdict; ``on_values``: told this trial's raw values per epoch
        after each report (the other trials' judges see them)."""
        self.rule, self.history, self.metric = rule, history, metric
        self.sign, self.max_epochs = sign, max_epochs
        self._on_values = on_values
        self._lock = threading.Lock()
        self._values: dict[int, float] = {}  # raw value by step
        self._pruned_after = 0  # epoch of the last verdict if it was "prune"
        self._last_epoch = 0
        self._ignored = 0

    def __call__(self, metric: str, step: int, value: float) -> EpochDecision:
        with self._lock:
            if metric != self.metric:
                return EpochDecision(False, 0)
            self._values[step] = float(value)
            steps = sorted(self._values)
            epoch = steps.index(step) + 1
            if self._pruned_after and epoch > self._pruned_after and not self._ignored:
                self._ignored = self._pruned_after
            self._last_epoch = epoch
            if self._on_values is not None:
                self._on_values(tuple(self._values[s] for s in steps))
            verdict = self._judge(epoch, [self.sign * self._values[s] for s in steps[:epoch]])
            self._pruned_after = epoch if verdict.stop else 0
            return verdict

    def _judge(self, epoch: int, signed: list[float]) -> EpochDecision:
        if self.max_epochs is not None and epoch >= self.max_epochs:
            return EpochDecision(False, epoch)  # its last epoch: nothing left to save
        history = self.history if isinstance(self.history, History) else self.history()
        cut = self.rule.cut(history.curves, epoch)
        mine = self.rule.own(signed)
        if cut is None or not mine > cut.threshold:
            return EpochDecision(False, epoch)
        own = self.rule.own_words(self.metric, epoch, self.sign)
        return EpochDecision(
            True, epoch,
            f"{self.rule.name}: {own}, {self.sign * mine:.6g}, is worse than {cut.what} of "
            f"{cut.trials} earlier trials at epoch {epoch} ({self.sign * cut.threshold:.6g})")

    def outcome(self) -> JudgedTrial:
        with self._lock:
            curve = tuple(self._values[s] for s in sorted(self._values))
            pruned = self._pruned_after if self._pruned_after == self._last_epoch else 0
            return JudgedTrial(curve, pruned, self._ignored)


def describe(rule: Rule | None) -> dict[str, Any]:
    """The rule's settings, as the sweep's parent run logs them."""
    if rule is None:
        return {"prune": "none"}
    fields = {f.name: getattr(rule, f.name) for f in dataclasses.fields(rule) if f.init}
    return {"prune": rule.name, **{f"prune_{k}": v for k, v in fields.items()}}


def _ordinal(n: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")
