"""Driver side (a command): builds the class-data archive that makes Spark's driver JVM
start faster (see :mod:`mlflow_hvd.backends.spark.jvm`; figures in docs/benchmarks.md). Once per
Java + Spark installation; ``make setup`` runs it; nothing to do when the archive exists.

    python -m mlflow_hvd.cli.jvm_archive [--timeout 300]
"""

from __future__ import annotations

import argparse
import sys
import time

from mlflow_hvd.backends.spark import jvm
from mlflow_hvd.errors import MlflowHvdError


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m mlflow_hvd.cli.jvm_archive``."""
    parser = argparse.ArgumentParser(prog="python -m mlflow_hvd.cli.jvm_archive",
                                     description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds the build may take (default 300)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    existing = jvm.archive_path()
    if existing is not None and existing.is_file():
        print(f"Spark's class-data archive is up to date: {existing}")
        return 0
    started = time.monotonic()
    try:
        path = jvm.build_archive(timeout=args.timeout)
    except MlflowHvdError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"built Spark's class-data archive in {time.monotonic() - started:.0f} s: {path} "
          f"({path.stat().st_size / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
