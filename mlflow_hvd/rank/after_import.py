"""Run a function on a module right after Python imports it, with the module's own loader
(the import guard of :mod:`mlflow_hvd.rank.keras_guard` uses it)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import types
from collections.abc import Callable, Sequence


class _Then(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader,
                 then: Callable[[types.ModuleType], None]) -> None:
        self.inner, self.then = inner, then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.inner.exec_module(module)
        self.then(module)


def spec_then(fullname: str, path: Sequence[str] | None,
              then: Callable[[types.ModuleType], None]) -> importlib.machinery.ModuleSpec | None:
    """The spec the path finders give ``fullname``, loading it as usual and then calling
    ``then(module)``; None if no path finder has it (the import goes on without us)."""
    spec = importlib.machinery.PathFinder.find_spec(fullname, path)
    if spec is None or spec.loader is None:
        return None
    spec.loader = _Then(spec.loader, then)
    return spec
