"""``python -m mlflow_hvd.tracking.replay BUNDLE_DIR [--tracking-uri URI]``: send tracking
records saved during a tracking-server outage (see :mod:`.undelivered`)."""

from __future__ import annotations

import argparse
import sys

from mlflow_hvd.driver.tracking.undelivered import load, replay
from mlflow_hvd.protocol import records


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m mlflow_hvd.tracking.replay``."""
    p = argparse.ArgumentParser(
        prog="python -m mlflow_hvd.tracking.replay",
        description="Send what rank 0 could not deliver during a tracking-server outage "
                    "(saved by the driver, named in its warning) into the run it belongs to.")
    p.add_argument("bundle", help="the directory named in the warning")
    p.add_argument("--tracking-uri", help="send to this server instead of the saved one")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        meta, _ = load(args.bundle)
    except (OSError, ValueError) as exc:
        print(f"cannot read bundle {args.bundle}: {exc}", file=sys.stderr)
        return 2
    try:
        counts = replay(args.bundle, args.tracking_uri)
    except Exception as exc:
        print(f"replay of {args.bundle} stopped (kept; run it again): {exc}", file=sys.stderr)
        return 1
    print(f"replayed {records.describe(counts)} into run {meta['run_id']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
