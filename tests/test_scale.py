"""Jobs of many ranks start reliably: every rank's connections reach the driver at once
(the channel and horovod's rendezvous server listen with a backlog large enough for a
whole job), every output line arrives, in order, and rank 0's value comes back. The ranks
are lightweight (no TensorFlow), with the runner's default deadlines."""

from __future__ import annotations

import collections
import json
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import workers
from conftest import assert_no_workers_left
from services import stderr_tail

from mlflow_hvd import HorovodRunner, TrackingConfig

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parent
LINE = re.compile(r"\[(\d+)\]<stdout>: line (\d+)")


def _lines_by_rank(output: str) -> dict[int, list[int]]:
    seen: dict[int, list[int]] = collections.defaultdict(list)
    for line in output.splitlines():
        m = LINE.fullmatch(line)
        if m:
            seen[int(m[1])].append(int(m[2]))
    return seen


def test_128_local_ranks_start_and_every_line_arrives_in_order(
    capsys: pytest.CaptureFixture[str],
) -> None:
    n = 200  # 25,600 lines: output keeps the driver busy while ranks connect
    result = HorovodRunner(np=-128, driver_log_verbosity="all",
        tracking=TrackingConfig(track=False)).run(
        workers.count_lines, n=n)
    assert result == 0
    seen = _lines_by_rank(capsys.readouterr().out)
    assert sorted(seen) == list(range(128))
    assert all(lines == list(range(n)) for lines in seen.values())
    assert_no_workers_left()


def test_a_spark_barrier_stage_of_64_ranks(tmp_path: Path) -> None:
    """64 barrier tasks start, perform hvd.init()'s rendezvous requests (as if on 8 hosts),
    print; every line arrives in order and rank 0's value returns."""
    connected = tmp_path / "connected"
    script = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(TESTS)!r})\n"
        "import workers\n"
        "from mlflow_hvd import HorovodRunner, JobConfig, TrackingConfig\n"
        "from mlflow_hvd import ClusterConfig\n"
        # 64 processes importing the rank's modules on 2 cores beside the other tiers: the
        # default 60 s start deadline was too short once (CI6); the claim is 64 ranks
        "r = HorovodRunner(np=64, cluster=ClusterConfig(spark_master='local[64]'),\n"
        "                  job=JobConfig(start_timeout=300),\n"
        "                  tracking=TrackingConfig(track=False),\n"
        "                  driver_log_verbosity='all')\n"
        "out = r.run(workers.scale_rank, lines=5, ranks_per_host=8,\n"
        f"            rendezvous_dir={str(connected)!r}, rendezvous_timeout=120)\n"
        "print('RESULT ' + json.dumps(out), flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, stderr_tail(proc.stderr)
    result = json.loads(proc.stdout.split("RESULT ")[-1])
    assert result["rank"] == 0 and result["requests"] > 2 * 2 * 63  # two passes, 63 peers
    seen = _lines_by_rank(proc.stdout)
    assert sorted(seen) == list(range(64))
    assert all(lines == list(range(5)) for lines in seen.values())
    assert_no_workers_left()


def test_the_rendezvous_of_32_ranks_is_served_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str],
) -> None:
    """32 ranks send the requests hvd.init() sends (horovod's Gloo store, over HTTP); the
    driver's count of the requests it served equals the ranks' count of answers."""
    import logging

    caplog.set_level(logging.INFO, logger="mlflow_hvd.driver.generation")
    result = HorovodRunner(np=-32, driver_log_verbosity="all",
        tracking=TrackingConfig(track=False)).run(
        workers.scale_rank, lines=3, rendezvous_dir=str(tmp_path), spread=1.0)
    assert result["rank"] == 0
    sent = [int(m[1]) for m in re.finditer(r"\]<stdout>: rendezvous requests (\d+)",
                                           capsys.readouterr().out)]
    assert len(sent) == 32
    assert result["requests"] in sent
    (load,) = [r.getMessage() for r in caplog.records if "rendezvous server" in r.getMessage()]
    served = re.search(
        r"the rendezvous server (\d+) requests in [\d.]+s \((\d+) not there yet, "
        r"0 refused\)", load)
    assert served, load
    assert int(served[1]) == sum(sent)
    # ranks arrive over a second: without held requests the early ones would ask for
    # missing keys every 10 ms (hundreds of "not yet" answers)
    assert int(served[2]) < 32 * 6
    assert_no_workers_left()


def _under_limits(
    soft: int, hard: int, code: str, tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    script = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))\n"
        f"sys.path.insert(0, {str(TESTS)!r})\n" + code
    )
    return subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)


def test_a_low_open_file_limit_is_raised_for_a_large_job(tmp_path: Path) -> None:
    """With a soft limit of 256 open files, 100 local ranks ended in 'Too many open files'
    and a StartTimeoutError blaming slow workers; the driver raises its soft limit."""
    proc = _under_limits(256, resource.getrlimit(resource.RLIMIT_NOFILE)[1], (
        "import resource, workers\n"
        "from mlflow_hvd import HorovodRunner, TrackingConfig\n"
        "r = HorovodRunner(np=-100, tracking=TrackingConfig(track=False))\n"
        "print('RESULT', r.run(workers.count_lines, n=2))\n"
        "print('SOFT', resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    ), tmp_path)
    assert proc.returncode == 0, stderr_tail(proc.stderr)
    assert "RESULT 0" in proc.stdout
    from mlflow_hvd.driver.limits import files_needed

    assert f"SOFT {files_needed(100)}" in proc.stdout


def test_a_hard_limit_too_low_for_the_job_is_named(tmp_path: Path) -> None:
    proc = _under_limits(200, 300, (
        "import logging, resource\n"
        "logging.basicConfig()\n"
        "from mlflow_hvd.driver.limits import ensure_open_files\n"
        "ensure_open_files(1000)\n"
        "print('SOFT', resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    ), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "SOFT 300" in proc.stdout
    assert ("a job of 1000 ranks needs about 5256 open files on the driver, and this process "
            "may open at most 300 (its hard limit): raise it (ulimit -Hn") in proc.stderr
