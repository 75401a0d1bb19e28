"""Driver side: which Spark master a job runs on, chosen the way Spark users already do.

Precedence (the same as ``spark-submit``'s): an explicit ``spark_master`` option, then
``--master`` in ``PYSPARK_SUBMIT_ARGS``, then ``spark.master`` in ``spark-defaults.conf``
(in ``SPARK_CONF_DIR``, else ``$SPARK_HOME/conf``), then the ``MASTER`` variable. Only when
none is set does HorovodRunner embed a ``local[N]`` session.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

from mlflow_hvd.errors import BackendError, ConfigurationError

AUTO = "auto"


@dataclass(frozen=True)
class MasterChoice:
    """The master to use and where that choice came from (for messages and tags)."""

    master: str
    source: str


def _from_submit_args(args: str) -> str | None:
    words = shlex.split(args)
    for i, word in enumerate(words):
        if word == "--master" and i + 1 < len(words):
            return words[i + 1]
        if word.startswith("--master="):
            return word.split("=", 1)[1]
    return None


def _defaults_file(environ: Mapping[str, str]) -> str | None:
    conf_dir = environ.get("SPARK_CONF_DIR")
    if not conf_dir and environ.get("SPARK_HOME"):
        conf_dir = os.path.join(environ["SPARK_HOME"], "conf")
    return os.path.join(conf_dir, "spark-defaults.conf") if conf_dir else None


def _from_defaults(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        m = re.match(r"^\s*spark\.master(?:\s*=\s*|\s+)(\S+)\s*$", line)
        if m:
            return m.group(1)
    return None


def choose_master(explicit: str | None, environ: Mapping[str, str]) -> MasterChoice | None:
    """The configured master, or None when nothing configures one (embed ``local[N]``).

    ``explicit`` of None, ``""`` or ``"auto"`` means "whatever Spark's settings say".
    """
    if explicit and explicit != AUTO:
        return MasterChoice(explicit, "the spark_master option")
    submit = _from_submit_args(environ.get("PYSPARK_SUBMIT_ARGS", ""))
    if submit:
        return MasterChoice(submit, "--master in PYSPARK_SUBMIT_ARGS")
    path = _defaults_file(environ)
    from_file = _from_defaults(path) if path else None
    if from_file:
        return MasterChoice(from_file, f"spark.master in {path}")
    if environ.get("MASTER"):
        return MasterChoice(environ["MASTER"], "the MASTER environment variable")
    return None


def standalone_addresses(master: str) -> list[tuple[str, int]]:
    """``(host, port)`` of each master in a ``spark://h1:p1,h2:p2`` URL; [] for others."""
    if not master.startswith("spark://"):
        return []
    out = []
    for part in master[len("spark://") :].split(","):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigurationError(
                f"Spark master {master!r}: {part!r} is not host:port (e.g. spark://host:7077)"
            )
        out.append((host, int(port)))
    return out


def check_reachable(choice: MasterChoice, timeout: float) -> None:
    """Fail fast when no standalone master of ``choice`` accepts a connection.

    Spark itself would retry registration for a minute and then leave the job waiting for
    executors; this names the master and where it was configured instead.

    Raises:
        BackendError: None of the masters answered within ``timeout`` seconds.
    """
    addresses = standalone_addresses(choice.master)
    if not addresses:
        return
    deadline = time.monotonic() + timeout
    errors = []
    while True:
        for host, port in addresses:
            try:
                socket.create_connection((host, port), timeout=max(0.1, min(2.0, timeout))).close()
                return
            except OSError as exc:
                errors.append(f"{host}:{port}: {exc}")
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    raise BackendError(
        f"cannot reach the Spark master {choice.master} (from {choice.source}) within "
        f"{timeout:g}s: {errors[-1]}. Start the master, fix the URL, or raise "
        "HorovodRunner(job=JobConfig(slot_timeout=...)) if it is still starting"
    )
