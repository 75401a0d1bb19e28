"""The driver's rendezvous server against horovod's as shipped, on the requests of
``hvd.init()``.

Both arms run the same job through the real driver: ``HorovodRunner(np=-N)`` with
lightweight ranks that send the HTTP requests horovod's Gloo store sends at ``hvd.init()``
(:mod:`tests.gloo_rendezvous`; ranks as if on hosts of 8, reaching the server over
``--spread`` seconds as real ranks do). The arms differ only in the server:

* ``ours``: horovod's server and handler, served by a pool of threads, with requests for
  keys that are not there yet held until the key arrives (``mlflow_hvd.driver.rendezvous``);
* ``horovod``: horovod's server as shipped -- a new thread per request, "not there yet"
  answered at once (the client asks again 10 ms later). Both listen with the same backlog
  (with horovod's 5, large jobs do not start at all).

Alternated rounds; prints min/median/max per arm of the time the server was busy, the
driver's CPU seconds during the job and the "not there yet" answers, and the ratio of the
medians (ours / horovod).

    .venv/bin/python benchmarks/rendezvous.py [--np 64] [--rounds 5] [--spread 2]
"""

from __future__ import annotations

import argparse
import logging
import re
import resource
import socketserver
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import workers  # the tests' lightweight rank functions

from mlflow_hvd import HorovodRunner, TrackingConfig
from mlflow_hvd.driver import rendezvous as rdv

LOAD = re.compile(r"the rendezvous server (\d+) requests in ([\d.]+)s \((\d+) not there yet,")
OURS = (rdv._Server.process_request, rdv.HOLD_SECONDS)
HOROVODS = (socketserver.ThreadingMixIn.process_request, 0.0)


class _Load(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.match: re.Match[str] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        self.match = LOAD.search(record.getMessage()) or self.match


def one_job(np: int, spread: float, server: tuple[object, float]) -> tuple[float, float, int]:
    rdv._Server.process_request, rdv.HOLD_SECONDS = server  # type: ignore[method-assign]
    load = _Load()
    logger = logging.getLogger("mlflow_hvd.driver.generation")
    logger.addHandler(load)
    logger.setLevel(logging.INFO)
    before = resource.getrusage(resource.RUSAGE_SELF)
    try:
        with tempfile.TemporaryDirectory() as connected:
            result = HorovodRunner(np=-np, tracking=TrackingConfig(track=False)).run(
                workers.scale_rank, lines=0, ranks_per_host=8, spread=spread,
                rendezvous_dir=connected)
    finally:
        logger.removeHandler(load)
    after = resource.getrusage(resource.RUSAGE_SELF)
    if result["rank"] != 0 or load.match is None:
        raise SystemExit(f"unexpected result {result!r} or no load line")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return float(load.match[2]), cpu, int(load.match[3])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--spread", type=float, default=2.0)
    args = p.parse_args()
    arms = {"ours": OURS, "horovod": HOROVODS}
    samples: dict[str, list[tuple[float, float, int]]] = {a: [] for a in arms}
    one_job(8, 0.0, OURS)  # warm-up
    for r in range(args.rounds):
        for arm in arms if r % 2 == 0 else reversed(list(arms)):
            samples[arm].append(one_job(args.np, args.spread, arms[arm]))
            busy, cpu, not_found = samples[arm][-1]
            print(f"round {r + 1} {arm}: server busy {busy:.2f}s, driver CPU {cpu:.2f}s, "
                  f"{not_found} not there yet", flush=True)
    print(f"{args.rounds} alternated rounds, np=-{args.np}, ranks reach the server over "
          f"{args.spread:g}s")
    medians: dict[str, list[float]] = {}
    for arm, runs in samples.items():
        medians[arm] = []
        cells = []
        for i, label in enumerate(("server busy, s", "driver CPU, s", "not there yet")):
            values = [run[i] for run in runs]
            medians[arm].append(statistics.median(values))
            cells.append(f"{label} {medians[arm][-1]:.2f} (min {min(values):.2f}, "
                         f"max {max(values):.2f})")
        print(f"{arm}: " + "; ".join(cells))
    ratios = [o / h if h else float("nan") for o, h in zip(medians["ours"], medians["horovod"],
                                                           strict=True)]
    print(f"ours / horovod: server busy {ratios[0]:.2f}, driver CPU {ratios[1]:.2f}, "
          f"not there yet {ratios[2]:.3f}")


if __name__ == "__main__":
    main()
