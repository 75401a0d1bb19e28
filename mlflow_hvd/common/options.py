"""Validation of the options users pass (to HorovodRunner, the CLI, the sweep): one check
and one message per option, wherever it is given."""

from __future__ import annotations

from mlflow_hvd.errors import ConfigurationError


def check_np(np: object) -> int:
    """``np`` as HorovodRunner takes it: a non-zero int.

    Raises:
        ConfigurationError: Not an int, or 0; the message says what each sign means.
    """
    if isinstance(np, bool) or not isinstance(np, int):
        raise ConfigurationError(
            f"np must be a non-zero integer, got {np!r} ({type(np).__name__}): use np=-N for N "
            "processes on the driver, np=N for N Spark barrier tasks"
        )
    if np == 0:
        raise ConfigurationError(
            "np=0 is not a valid number of processes: use np=-N for N processes on the "
            "driver (np=-1 to test on one process first), np=N for N Spark barrier tasks"
        )
    return np


def check_seconds(name: str, value: object) -> float:
    """A positive number of seconds."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigurationError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def check_positive_int(name: str, value: object, minimum: int = 1) -> int:
    """An int of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value
