"""The sweep's loop (sweep/loop.py, sweep/fmin_trials.py): hyperopt's fmin suggests the
points, one trial at a time or several at once, with no ranks (the trials are functions)."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest
from hyperopt import STATUS_OK, hp

from mlflow_hvd import ClusterConfig, JobConfig, TrackingConfig
from mlflow_hvd.sweep.fmin_trials import SweepTrials, search
from mlflow_hvd.sweep.slots import Slots
from mlflow_hvd.sweep.trial import Plan

SPACE = {"lr": hp.loguniform("lr", -7, 0), "units": hp.choice("units", [8, 16, 32]),
         "drop": hp.uniform("drop", 0.0, 0.5)}

# What seed 7 gave before the sweep ran on one fmin loop (the sequential sweep called fmin
# once per trial, seeded (seed, n); the concurrent one called TPE itself with the same
# seeds): [lr, units, drop] of trials 0-23. Trials 0-19 are TPE's random start, 20-23 its own.
POINTS = [
    [0.001515577884452358, 32, 0.190843395809508],
    [0.03195974805146177, 16, 0.0773483788126692],
    [0.052770309462634224, 32, 0.4795543337781333],
    [0.016555954084227924, 16, 0.03933340284075726],
    [0.00732138915498962, 8, 0.40887426549435923],
    [0.4330457250091124, 32, 0.4870637605335484],
    [0.0077734061549357, 16, 0.37716376961280307],
    [0.006023399242387648, 32, 0.2167233421414848],
    [0.26663573465248924, 16, 0.04115087164299752],
    [0.0023520838150780264, 16, 0.2967718683674161],
    [0.0010393330645787186, 16, 0.31934275553994823],
    [0.00400554706565738, 8, 0.18620957335783278],
    [0.022945805744490243, 16, 0.448369880847292],
    [0.029355648302616933, 32, 0.26211491703224293],
    [0.012062311704878934, 16, 0.10791776720121032],
    [0.20248167675769496, 16, 0.4217462043082172],
    [0.0909359188309463, 8, 0.4678119924077196],
    [0.2964986602104165, 16, 0.16242769518485223],
    [0.013517310157179373, 8, 0.08449137401716705],
    [0.016468422234539842, 8, 0.4988271646497816],
    [0.08596947062172088, 32, 0.005318043911712006],
    [0.07408675995366036, 32, 0.011433159107685786],
    [0.05119476941525662, 32, 0.11930423692837767],
    [0.08435795931298584, 32, 0.12521100072455205],
]


def same_points(points: list[list[float]]) -> list[Any]:
    """``points`` as a comparison that allows the last bits a CPU's exp may change: a
    loguniform draw is exp of a uniform one, and numpy's vectorised exp differs by an ulp
    between processors (trial 9's lr on an AMD EPYC against the machine that wrote these)."""
    return [pytest.approx(p, rel=1e-14, abs=0) for p in points]


def _loss(p: dict[str, Any]) -> float:
    return (math.log(p["lr"]) + 3) ** 2 + p["drop"] + (0.1 if p["units"] == 8 else 0)


def _plan(max_evals: int) -> Plan:
    return Plan(lambda **kw: None, SPACE, max_evals, -1, "loss", 7, None, {}, JobConfig(),
                ClusterConfig(), TrackingConfig())


def _point(p: dict[str, Any]) -> list[float]:
    return [float(p["lr"]), int(p["units"]), float(p["drop"])]


def test_one_trial_at_a_time_suggests_the_points_it_always_did() -> None:
    seen: list[list[float]] = []

    def evaluate(params: dict[str, Any]) -> dict[str, Any]:
        seen.append(_point(params))
        return {"status": STATUS_OK, "loss": _loss(params)}

    trials = SweepTrials(1)
    search(trials, _plan(len(POINTS)), evaluate, lambda t: False)
    assert seen == same_points(POINTS)
    assert [t["tid"] for t in trials.trials] == list(range(len(POINTS)))


class _Runner:
    def __init__(self) -> None:
        self.stops = 0

    def stop(self) -> None:
        self.stops += 1


def test_three_at_once_suggest_each_point_when_a_slot_is_free_with_its_own_seed() -> None:
    """Trial k ends 1.2 s after trial k + 2 started (more than fmin's poll), so three
    slots free in turn: fmin suggests no point while all three are busy (a fourth would
    find no free slot), and the random start is the same points as one at a time, trial by
    trial."""
    n = 6
    started: list[int] = []
    since: dict[int, float] = {}
    points: dict[int, list[float]] = {}
    running: list[int] = []
    most = [0]
    cond = threading.Condition()

    def run(tid: int, params: dict[str, Any], runner: Any) -> dict[str, Any]:
        with cond:
            started.append(tid)
            since[tid] = time.monotonic()
            points[tid] = _point(params)
            running.append(tid)
            most[0] = max(most[0], len(running))
            cond.notify_all()
            last = min(tid + 2, n - 1)
            assert cond.wait_for(lambda: last in started, timeout=60)
        time.sleep(max(0.0, since[last] + 1.2 - time.monotonic()))
        with cond:
            running.remove(tid)
        return {"status": STATUS_OK, "loss": _loss(params)}

    slots = Slots([_Runner(), _Runner(), _Runner()], run)  # type: ignore[list-item]
    trials = SweepTrials(3, SPACE, slots)
    try:
        search(trials, _plan(n), None, lambda t: False)
    finally:
        slots.close()
    assert started == list(range(n))
    assert [points[t] for t in range(n)] == same_points(POINTS[:n])
    assert most[0] == 3
    assert [t["result"]["status"] for t in trials.trials] == [STATUS_OK] * n


def test_a_stopped_sweep_asks_every_running_trial_to_stop_and_saves_only_finished_ones(
) -> None:
    """What Ctrl-C does to a sweep of several trials at once: fmin ends, each running
    trial's runner is told to stop (no exception is put into its thread), and what would be
    saved holds the finished trials with every id handed out."""
    runners = [_Runner(), _Runner()]
    release = threading.Event()
    ended: list[int] = []

    def run(tid: int, params: dict[str, Any], runner: Any) -> dict[str, Any]:
        if tid == 0:
            return {"status": STATUS_OK, "loss": 1.0}
        release.wait(60)  # until its runner is told to stop (as HorovodRunner.stop does)
        ended.append(tid)
        raise KeyboardInterrupt

    class Stop(_Runner):
        def stop(self) -> None:
            super().stop()
            release.set()

    runners = [Stop(), Stop()]
    slots = Slots(runners, run)  # type: ignore[arg-type]
    trials = SweepTrials(2, SPACE, slots)
    polls = [0]

    def after_each(t: Any) -> bool:
        polls[0] += 1
        if len(t.trials) >= 3 and polls[0] > 3:
            raise KeyboardInterrupt  # Ctrl-C while fmin polls
        return False

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        try:
            search(trials, _plan(6), None, after_each)
        except BaseException:
            slots.stop()
            raise
        finally:
            slots.close()
    assert time.monotonic() - t0 < 30
    assert sum(r.stops for r in runners) == 2 and sorted(ended) == [1, 2]
    kept = trials.finished()
    assert [d["tid"] for d in kept.trials] == [0]
    assert kept.new_trial_ids(1) == [3]  # a resumed sweep numbers on after those handed out
