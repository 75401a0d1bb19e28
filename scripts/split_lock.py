"""Split one hash-locked requirements file into what users run and what only developers use.

``make lock`` resolves the whole tested set once (runtime + the ``dev`` extra) and the runtime
alone under it as constraints (same versions); this script then writes

- ``requirements/lock-py3.11.txt``: the runtime entries (``python_env.yaml`` installs it: the
  environment ``mlflow run`` makes and ships to executors carries no development tools);
- ``requirements/lock-dev-py3.11.txt``: every other entry of the whole set (test, lint, type,
  docs and browser tooling), installed beside it by ``make setup``.

Each entry is copied verbatim from the whole set (version, hashes, ``via`` comments), so the
two files together are exactly the resolved set.

Run: ``python scripts/split_lock.py WHOLE RUNTIME_RESOLVED RUNTIME_OUT DEV_OUT``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ENTRY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.\-]*)(\[[^\]]*\])?==\S+")


def entries(text: str) -> dict[str, str]:
    """Locked entries by normalised name: the ``name==version`` line and its indented
    continuation lines (hashes, ``via`` comments)."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines(keepends=True):
        match = ENTRY.match(line)
        if match:
            current = found.setdefault(normalise(match.group(1)), [])
            current.append(line)
        elif current is not None and line.startswith((" ", "\t")):
            current.append(line)
        else:
            current = None
    return {name: "".join(lines) for name, lines in found.items()}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def split(whole: str, runtime_resolved: str) -> tuple[str, str]:
    """(runtime lock, dev lock) from the whole set and the runtime-only resolution."""
    every, runtime = entries(whole), entries(runtime_resolved)
    missing = sorted(set(runtime) - set(every))
    if missing:
        raise SystemExit(f"split_lock: the runtime resolution has entries the whole set lacks: "
                         f"{', '.join(missing)} (resolve both under the same constraints)")
    for name in runtime:
        if runtime[name].split()[0] != every[name].split()[0]:
            raise SystemExit(f"split_lock: {name} differs: {runtime[name].split()[0]} in the "
                             f"runtime resolution, {every[name].split()[0]} in the whole set")
    run = "".join(text for name, text in sorted(every.items()) if name in runtime)
    dev = "".join(text for name, text in sorted(every.items()) if name not in runtime)
    return run, dev


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    whole, resolved, run_out, dev_out = map(Path, argv)
    run, dev = split(whole.read_text(), resolved.read_text())
    run_out.write_text(run)
    dev_out.write_text(
        f"# Development tools only (tests, lint, types, docs, browser), resolved with\n"
        f"# {run_out.name} (the runtime set) in one pass: `make lock`. Install both.\n" + dev)
    print(f"split_lock: {run.count('==')} runtime entries -> {run_out}, "
          f"{dev.count('==')} development entries -> {dev_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
