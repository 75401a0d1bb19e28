"""Executor side: does the environment a job shipped (``spark.archives``) fit this host?

Checked in every barrier task before it feeds data or starts its rank, so a wrong archive
is one error naming the host and each difference, not an ``ImportError`` inside a rank:

1. the task runs the shipped interpreter (``PYSPARK_PYTHON`` was the shipped one);
2. Python's version, the platform and C library, Horovod's version and which of its
   extensions exist match what the archive was packed with (read from package metadata:
   milliseconds);
3. Horovod's extensions load, from the unpacked archive, and have Gloo: a fresh
   interpreter imports ``horovod.tensorflow`` / ``horovod.torch`` and their frameworks, as
   ``mlflow_hvd.cli.horovod`` does after a build on the driver. That costs a framework
   import (seconds), so it is done once per executor and archive: the first task does it
   under a file lock in the executor's working directory (where Spark unpacked the archive)
   and leaves the result there for the others.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import sys
from pathlib import Path

from mlflow_hvd.common.environment import current
from mlflow_hvd.common.horovod_probe import load_extensions
from mlflow_hvd.protocol.environment import (
    FINGERPRINT_FILE,
    SHIPPED_PYTHON,
    EnvironmentFingerprint,
)

log = logging.getLogger(__name__)

LOAD_TIMEOUT = 300.0  # seconds one executor's extension check may take


def environment_differences(shipped: EnvironmentFingerprint | None,
                            workdir: str = ".") -> tuple[str, ...]:
    """What this interpreter and host lack of the environment the job shipped (nothing
    when it shipped none), each as ``what: expected X, found Y``."""
    if shipped is None:
        return ()
    if not os.path.isfile(os.path.join(sys.prefix, FINGERPRINT_FILE)):
        return (f"interpreter: expected the shipped {SHIPPED_PYTHON}, found {sys.executable} "
                "(PYSPARK_PYTHON was not the shipped one when the session started)",)
    differences = shipped.differences(current(with_packages=False))
    if differences or not shipped.extensions:
        return tuple(differences)
    return extension_failures(shipped, Path(workdir))


def extension_failures(shipped: EnvironmentFingerprint, workdir: Path) -> tuple[str, ...]:
    """Horovod's extensions of ``shipped`` that do not load here (or lack Gloo), each
    described; loaded once per executor and archive, the result kept in ``workdir``."""
    key = hashlib.sha256(shipped.dumps().encode()).hexdigest()[:16]
    result = workdir / f".mlflow-hvd-extensions-{key}.json"
    with open(workdir / f".mlflow-hvd-extensions-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second task waits for the first one's answer
        if result.is_file():
            return tuple(json.loads(result.read_text()))
        log.info("loading Horovod's extensions %s from %s", ", ".join(shipped.extensions),
                 sys.prefix)
        checks = load_extensions(shipped.extensions, LOAD_TIMEOUT)
        failures = [f"Horovod's {c.extension} extension: {c.describe()}"
                    for c in checks if not c.ok]
        log.info("Horovod's extensions: %s", "; ".join(c.describe() for c in checks))
        result.write_text(json.dumps(failures))
        return tuple(failures)
