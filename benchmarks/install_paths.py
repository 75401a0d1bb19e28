"""What a PyTorch user installs: ``pip install "<checkout>[torch]"`` (mlflow_hvd for
torch.distributed code, no TensorFlow, no Horovod) against what pyspark's TorchDistributor
needs (``pip install pyspark torch mlflow``), each into a new venv, from the same indexes
and the same PyTorch (``torch==2.13.0``, the CPU build the lock pins).

Per round and arm: the install's wall time and the venv's size on disk (``du``). The arms
alternate after one warm-up each (the first install of a package fills pip's cache; both arms
then install from it, as a second machine image or CI would). Prints min/median/max per arm
and the ratios of medians (goal: <= 1.1 on both). ``--also`` adds arms measured the same way:
``tensorflow`` (``[tensorflow-cpu]``: the Keras path before Horovod's build) and ``both``
(``[tensorflow-cpu,torch]``).

    .venv/bin/python benchmarks/install_paths.py [--rounds 3] [--also tensorflow --also both]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"
PYTHON = "python3.11"


def source_copy(into: Path) -> Path:
    """The package's source without the checkout's venvs and caches (pip builds in the
    source tree it is given)."""
    copy = into / "mlflow_hvd"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(
        ".venv*", ".git", "__pycache__", "*.db", "mlruns", ".*_cache", "*.egg-info", "dist",
        "build", "site", "test-output", "tests", "docs", "benchmarks"))
    return copy


def disk_bytes(path: Path) -> int:
    done = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[0])


def install(requirements: list[str], scratch: Path) -> tuple[float, int]:
    """A new venv with ``requirements`` installed by pip: (seconds, bytes on disk)."""
    venv = Path(tempfile.mkdtemp(prefix="venv-", dir=scratch))
    try:
        subprocess.run([PYTHON, "-m", "venv", str(venv)], check=True, timeout=300)
        t0 = time.perf_counter()
        subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", *requirements],
                       check=True, timeout=3600, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        seconds = time.perf_counter() - t0
        return seconds, disk_bytes(venv)
    finally:
        shutil.rmtree(venv, ignore_errors=True)


def summary(name: str, values: list[float], unit: str) -> str:
    return (f"{name:44s} min {min(values):8.1f}  median {statistics.median(values):8.1f}  "
            f"max {max(values):8.1f} {unit}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--also", action="append", default=[],
                        choices=("tensorflow", "both"))
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="install-paths-"))
    try:
        source = source_copy(scratch)
        arms: dict[str, Callable[[], tuple[float, int]]] = {
            "mlflow_hvd[torch]": lambda: install([f"{source}[torch]", TORCH], scratch),
            "TorchDistributor's (pyspark torch mlflow)": lambda: install(
                ["pyspark", TORCH, "mlflow"], scratch),
        }
        if "tensorflow" in args.also:
            arms["mlflow_hvd[tensorflow-cpu]"] = lambda: install(
                [f"{source}[tensorflow-cpu]"], scratch)
        if "both" in args.also:
            arms["mlflow_hvd[tensorflow-cpu,torch]"] = lambda: install(
                [f"{source}[tensorflow-cpu,torch]", TORCH], scratch)
        for fn in arms.values():  # warm-up: pip's cache holds every package after it
            fn()
        results: dict[str, list[tuple[float, int]]] = {name: [] for name in arms}
        names = list(arms)
        for i in range(args.rounds):
            for name in names[i % len(names):] + names[:i % len(names)]:
                results[name].append(arms[name]())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"install paths: a new {PYTHON} venv each, pip {args.rounds} rounds after a "
          "warm-up, arms rotated")
    for name, values in results.items():
        print(summary(f"{name} install", [s for s, _ in values], "s"))
        print(summary(f"{name} venv", [b / 1e6 for _, b in values], "MB"))
    peer = "TorchDistributor's (pyspark torch mlflow)"
    seconds = {n: statistics.median(s for s, _ in v) for n, v in results.items()}
    size = {n: statistics.median(b for _, b in v) for n, v in results.items()}
    print(f"mlflow_hvd[torch] / TorchDistributor's (medians): install time "
          f"{seconds['mlflow_hvd[torch]'] / seconds[peer]:.2f}, disk "
          f"{size['mlflow_hvd[torch]'] / size[peer]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
