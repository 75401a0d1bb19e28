"""How a user's callable is named in messages, logs and the Spark UI."""

from __future__ import annotations

from typing import Any


def callable_name(fn: Any) -> str:
    """``fn``'s qualified name (``Trainer.fit``, ``main.<locals>.step``); for a callable
    without one (a ``functools.partial``, an instance with ``__call__``) its repr."""
    return getattr(fn, "__qualname__", None) or repr(fn)
