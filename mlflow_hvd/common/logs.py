"""The lifecycle log: standard :mod:`logging` under ``mlflow_hvd.*``, quiet by default.

Every job, attempt, generation of warm ranks, rank start and exit, and tracking outage says
so at INFO (``job mlflow-hvd-3f2a...: rank 1 started on node-b (2 of 4, 1.9s)``). Nothing is shown
unless asked, with one switch: ``MLFLOW_HVD_LOG_LEVEL=INFO`` in the driver's environment (or
``mlflow_hvd.enable_logging()``). The driver hands its level to every job, so the host agents
(in Spark tasks: the executor's stderr log) and the ranks (their stderr, relayed to the
driver) log at the same level. Applications that configure :mod:`logging` themselves can
instead set the level of the ``mlflow_hvd`` logger.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

ENV = "MLFLOW_HVD_LOG_LEVEL"
FORMAT = "%(asctime)s mlflow_hvd[%(process)d] %(levelname)s %(name)s: %(message)s"
_ROOT = "mlflow_hvd"
_handler: logging.Handler | None = None


def enable(level: str | int = "INFO", stream: TextIO | None = None) -> None:
    """Show the lifecycle log on ``stream`` (default stderr) from ``level`` up; idempotent.

    Raises:
        ValueError: ``level`` is not a logging level name or number.
    """
    global _handler
    number = _level_number(level)
    logger = logging.getLogger(_ROOT)
    if _handler is None:
        _handler = logging.StreamHandler(stream or sys.stderr)
        _handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(_handler)
    logger.setLevel(number)


def from_env() -> None:
    """Apply :data:`ENV` if set (at import of the package: driver, agents and ranks)."""
    level = os.environ.get(ENV, "").strip()
    if level:
        enable(level)


def handed_level() -> str:
    """The level to hand to a job's agents and ranks: the ``mlflow_hvd`` logger's own level
    when set (by :func:`enable` or the application), else ""."""
    level = logging.getLogger(_ROOT).level
    return logging.getLevelName(level) if level else ""


def _level_number(level: str | int) -> int:
    if isinstance(level, int):
        return level
    number = logging.getLevelName(level.upper())
    if not isinstance(number, int):
        raise ValueError(
            f"{ENV}={level!r} is not a logging level: use DEBUG, INFO, WARNING or ERROR"
        )
    return number
