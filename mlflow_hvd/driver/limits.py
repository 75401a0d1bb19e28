"""Driver side: the open-file limit, raised for jobs of many ranks.

The driver holds a few files per rank while a job runs (``FILES_PER_RANK``): for a local
rank its output pipes, a pidfd and its channel connection; for every rank a held rendezvous
request at ``hvd.init()``. Before a job the soft limit is raised to what the job needs, up
to the hard limit (no privileges needed, as servers do); where even that is too low, a
warning names the fix before the job can fail with ``EMFILE`` in the driver's threads.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

FILES_PER_RANK = 5
BASE_FILES = 256  # the interpreter, MLflow's store, Spark's gateway, the servers


def files_needed(np: int) -> int:
    return BASE_FILES + FILES_PER_RANK * abs(np)


def ensure_open_files(np: int) -> None:
    """Raise this process's soft limit on open files to what a job of ``np`` ranks needs,
    up to the hard limit; log a warning naming the fix when even that is too low."""
    need = files_needed(np)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    target = need if hard == resource.RLIM_INFINITY else min(hard, need)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        log.info("raised the driver's open-file limit from %d to %d for %d ranks", soft,
                 target, abs(np))
    if target < need:
        log.warning(
            "a job of %d ranks needs about %d open files on the driver, and this process may "
            "open at most %d (its hard limit): raise it (ulimit -Hn in the shell that starts "
            "the driver, LimitNOFILE= for a systemd service) or the job may fail with 'Too "
            "many open files'", abs(np), need, hard)
