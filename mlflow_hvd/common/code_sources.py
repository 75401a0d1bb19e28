"""Real file names and source lines for code that cloudpickle sends by value.

cloudpickle names every by-value code object ``<dynamic-code>``, so a rank's traceback of a
function defined in the user's script, module or notebook cell would show neither the file
nor the line. The driver records, for each function reachable from the payload, the file its
code came from and that file's lines as Python's ``linecache`` has them (which includes
IPython/Jupyter cells); the rank gives every unpickled function its file name back and
registers the lines, so tracebacks read as they would on the driver.
"""

from __future__ import annotations

import linecache
import types
from collections.abc import Iterable, Iterator
from typing import Any

DYNAMIC = "<dynamic-code>"
Key = tuple[str, str, int]  # (module, qualname, first line): how a function is found again


def _key(fn: types.FunctionType) -> Key:
    return (fn.__module__ or "", fn.__qualname__, fn.__code__.co_firstlineno)


def _functions(roots: Iterable[Any], modules: set[str] | None) -> Iterator[types.FunctionType]:
    """Functions reachable from ``roots`` through function globals, closures, classes and
    containers, restricted to ``modules`` if given."""
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            if modules is not None and obj.__module__ not in modules:
                continue
            yield obj
            stack.extend(obj.__globals__.values())
            stack.extend(c.cell_contents for c in obj.__closure__ or () if _filled(c))
            stack.extend(obj.__defaults__ or ())
        elif isinstance(obj, types.MethodType | staticmethod | classmethod):
            stack.append(obj.__func__)
        elif isinstance(obj, property):
            stack.extend(f for f in (obj.fget, obj.fset, obj.fdel) if f is not None)
        elif isinstance(obj, type):
            if modules is None or obj.__module__ in modules:
                stack.extend(vars(obj).values())
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            stack.extend(obj)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def collect(roots: Iterable[Any], modules: set[str]) -> tuple[dict[Key, str], dict[str, str]]:
    """Driver: ``(function -> file name, file name -> source text)`` for the functions of
    ``modules`` (those sent by value) reachable from ``roots``."""
    files: dict[Key, str] = {}
    texts: dict[str, str] = {}
    for fn in _functions(roots, modules):
        name = fn.__code__.co_filename
        files[_key(fn)] = name
        if name not in texts:
            texts[name] = "".join(linecache.getlines(name))
    return files, texts


def restore(roots: Iterable[Any], files: dict[Key, str], texts: dict[str, str]) -> int:
    """Rank: put the file names back on unpickled functions and register their source lines
    with ``linecache``; returns how many functions were fixed."""
    for name, text in texts.items():
        if text:
            linecache.cache[name] = (len(text), None, text.splitlines(keepends=True), name)
    fixed = 0
    for fn in _functions(roots, None):
        real = files.get(_key(fn))
        if real is not None and fn.__code__.co_filename == DYNAMIC:
            fn.__code__ = _renamed(fn.__code__, real)
            fixed += 1
    return fixed


def _renamed(code: types.CodeType, name: str) -> types.CodeType:
    consts = tuple(
        _renamed(c, name) if isinstance(c, types.CodeType) and c.co_filename == DYNAMIC else c
        for c in code.co_consts
    )
    return code.replace(co_filename=name, co_consts=consts)
