"""mlflow_hvd's cache directory on a machine (Horovod wheels, Spark's class-data archives,
packed environments) and the one rule for what is kept in it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def cache_root(env: Mapping[str, str] = os.environ) -> Path:
    """``$MLFLOW_HVD_CACHE``, else ``$XDG_CACHE_HOME/mlflow_hvd``, else
    ``~/.cache/mlflow_hvd`` (where ``scripts/setup.sh`` keeps the Horovod wheel too)."""
    if env.get("MLFLOW_HVD_CACHE"):
        return Path(env["MLFLOW_HVD_CACHE"])
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlflow_hvd"


def keep_newest(directory: Path, pattern: str, keep: int) -> list[Path]:
    """Delete all but the ``keep`` files matching ``pattern`` in ``directory`` whose
    modification time is newest (their users touch them when they use them); returns what
    was deleted."""
    found = sorted(directory.glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in found[keep:]:
        old.unlink(missing_ok=True)
    return found[keep:]
