"""Driver side (a command): packs the current virtual environment for Spark executors that
do not have it (see :mod:`mlflow_hvd.common.env_archive`), or finds the cached
archive when nothing changed, and prints how to ship it.

    python -m mlflow_hvd.cli.pack_env [--json] [--compress-level N]

Ship it with ``spark.archives=<archive>#environment`` on the session and
``PYSPARK_PYTHON=./environment/bin/python`` in the driver's environment before the session
starts (docs/cluster.md). Every executor needs the venv's base interpreter at
the path printed.
"""

from __future__ import annotations

import argparse
import json
import sys

from mlflow_hvd.common.env_archive import describe, pack_environment
from mlflow_hvd.errors import MlflowHvdError


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m mlflow_hvd.cli.pack_env``."""
    parser = argparse.ArgumentParser(prog="python -m mlflow_hvd.cli.pack_env", description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--compress-level", type=int, choices=range(10), default=None,
                        metavar="0-9", help="gzip level (default: $MLFLOW_HVD_PACK_COMPRESS_"
                        "LEVEL, else 1); 0: stored, not compressed (three times the bytes to "
                        "send, no compressing or inflating)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        packed = pack_environment(compress_level=args.compress_level)
    except MlflowHvdError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    facts = describe(packed)
    if args.json:
        print(json.dumps(facts))
        return 0
    how = "reused the cached archive" if packed.reused else f"packed in {packed.seconds:.0f} s"
    print(f"{how}: {packed.path} ({packed.size / 2**20:.0f} MiB)\n"
          f"ship it with:\n"
          f"  export PYSPARK_PYTHON={facts['PYSPARK_PYTHON']}   # before the session starts\n"
          f"  --conf spark.archives={facts['spark_conf']['spark.archives']}\n"
          f"every executor needs {facts['base_python']} (the venv's base interpreter)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
