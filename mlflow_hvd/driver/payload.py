"""What every rank runs: ``main`` and its kwargs, checked against ``main``'s signature and
cloudpickled once on the driver.

Functions defined in the user's own modules (a script, its helpers, a notebook's project)
are pickled by value, because Spark executors cannot import them.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import os
import pickle
import sys
import sysconfig
import threading
from collections.abc import Callable
from typing import Any

import cloudpickle

from mlflow_hvd.common import code_sources
from mlflow_hvd.common.naming import callable_name
from mlflow_hvd.driver import captured
from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.protocol.messages import Code, Payload, TrackingTarget

_PICKLING = threading.Lock()  # concurrent runs (a sweep's slots) pickle in turn


def dumps_code(main: Callable[..., Any], kwargs: dict[str, Any]
               ) -> tuple[Code, dict[str, Any]]:
    """cloudpickle ``(main, kwargs)`` once per ``run``; the caller's own modules go by value.
    Returns the code and the DataFrames it holds that must be fed to the ranks
    (:mod:`mlflow_hvd.driver.captured`: argument -> DataFrame).

    Installed packages and the standard library stay by reference (workers import them).
    The module of ``main`` and the other user modules loaded here (a script's helpers, a
    test file's fixtures) are pickled by value, so workers whose ``sys.path`` differs from
    the driver's (Spark executors) can still run them. Modules imported *inside* ``main``
    must be importable on the workers.

    Raises:
        ConfigurationError: ``main`` or a kwarg cannot be pickled.
    """
    with _PICKLING, captured.capturing() as frames:  # cloudpickle's by-value registry is
        return _dumps_code(main, kwargs), dict(frames)  # global: one run at a time


def _dumps_code(main: Callable[..., Any], kwargs: dict[str, Any]) -> Code:
    module = sys.modules.get(getattr(main, "__module__", "") or "")
    by_value = _user_modules(module)
    for mod in by_value:
        cloudpickle.register_pickle_by_value(mod)
    try:
        # cloudpickle sends __main__ (a script, a notebook) by value too
        files, texts = code_sources.collect(
            [main, kwargs], {"__main__", *(m.__name__ for m in by_value)}
        )
        return Code(cloudpickle.dumps((main, kwargs)), files, texts)
    except Exception as exc:
        raise ConfigurationError(
            f"cannot pickle main or its kwargs for the workers: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        for mod in by_value:
            cloudpickle.unregister_pickle_by_value(mod)


def dumps_payload(code: Code, target: TrackingTarget | None = None, attempt: int = 0) -> bytes:
    """One job's payload: the code pickled by :func:`dumps_code` plus its run and attempt
    (cheap: the code is not pickled again)."""
    return pickle.dumps(Payload(code, target, attempt),
                        protocol=pickle.HIGHEST_PROTOCOL)


def _user_modules(main_module: Any) -> list[Any]:
    """Every user module loaded in this process, ``main``'s first: a script's helpers and a
    notebook's imports from its project are installed nowhere on the workers."""
    found = [m for m in list(sys.modules.values()) if _is_user_module(m)]
    if main_module in found:
        found.remove(main_module)
        found.insert(0, main_module)
    return found


def _is_user_module(module: Any) -> bool:
    """A module of the user's own code: not installed (site-packages), not the standard
    library, not mlflow_hvd, not ``__main__`` (which cloudpickle already sends by value)."""
    name = getattr(module, "__name__", "")
    path = getattr(module, "__file__", None)
    if name == "__main__" or not path or not isinstance(path, str):
        return False
    if name.split(".")[0] == "mlflow_hvd":
        return False
    return _is_user_path(path)


@functools.cache
def _is_user_path(path: str) -> bool:
    """Whether a module file is user code (cached: with TensorFlow loaded there are
    thousands of modules, and resolving every path on each ``run`` is measurable)."""
    path = os.path.realpath(path)
    if "site-packages" in path or "dist-packages" in path:
        return False
    return not path.startswith(_stdlib() + os.sep)


@functools.lru_cache(maxsize=1)
def _stdlib() -> str:
    return os.path.realpath(sysconfig.get_paths()["stdlib"])


def check_call(main: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """Refuses, on the driver, a ``main`` that is not callable or whose signature does not
    accept ``kwargs``: names it does not take (with the closest parameter) and required
    parameters missing, all in one message.

    Raises:
        ConfigurationError: Naming ``main`` and the arguments.
    """
    if not callable(main):
        raise ConfigurationError(f"main must be callable, got {type(main).__name__}")
    try:
        signature = inspect.signature(main)
    except (TypeError, ValueError):  # a callable Python cannot describe: ranks will tell
        return
    params = signature.parameters
    by_keyword = {n for n, p in params.items()
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    problems = []
    for name in kwargs:
        if name not in by_keyword and not (takes_any and name not in params):
            close = difflib.get_close_matches(name, sorted(by_keyword), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"it takes no argument {name!r}{hint}")
    missing = [n for n, p in params.items() if p.default is p.empty
               and (n not in kwargs or n not in by_keyword)
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if missing:
        problems.append(f"it needs {', '.join(map(repr, missing))}")
    if problems:
        plain = signature.replace(
            parameters=[p.replace(annotation=p.empty) for p in params.values()],
            return_annotation=signature.empty)
        raise ConfigurationError(
            f"run({callable_name(main)}, ...): {'; '.join(problems)}: main{plain}. run(main, "
            "**kwargs) calls main(**kwargs) on every rank")


