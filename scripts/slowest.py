"""The slowest tests of a `make test` run, across its pytest tiers: each tier writes a JUnit
report (`<logs>/<tier>.xml`, pytest's `--junitxml`); this prints the N slowest tests of all
of them, each with its tier and its whole time (set-up, call and tear-down, as pytest's
`junit_duration_report = total` counts it).

    python scripts/slowest.py test-output/tiers [N]

A tier whose report is missing (it did not run, or was stopped) is named, not guessed at.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TIERS = ("fast", "main", "beside", "old-end", "new-end", "new-end-gpu", "cluster")


def slowest(logs: Path, count: int) -> tuple[list[tuple[float, str, str]], list[str]]:
    """The ``count`` slowest (seconds, tier, test id) of the reports in ``logs``, and the
    tiers that left no readable report."""
    found: list[tuple[float, str, str]] = []
    missing = []
    for tier in TIERS:
        report = logs / f"{tier}.xml"
        try:
            root = ET.parse(report).getroot()
        except (OSError, ET.ParseError):
            missing.append(tier)
            continue
        for case in root.iter("testcase"):
            module = case.get("classname", "").replace(".", "/")
            name = f"{module}.py::{case.get('name', '?')}"
            found.append((float(case.get("time") or 0.0), tier, name))
    found.sort(reverse=True)
    return found[:count], missing


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    count = int(argv[1]) if len(argv) > 1 else 15
    rows, missing = slowest(Path(argv[0]), count)
    print(f"== the {len(rows)} slowest tests of this run (set-up + call + tear-down) ==")
    for seconds, tier, name in rows:
        print(f"  {seconds:7.1f} s  {tier:<8} {name}")
    if missing:
        print(f"  (no report from: {', '.join(missing)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
