"""Rank side: load Triton before TensorFlow where TensorFlow would otherwise crash it.

TensorFlow's wheels from 2.20 on load ``_pywrap_tensorflow_internal.so`` with
``RTLD_GLOBAL`` (they ship ``tensorflow/python/pywrap_dlopen_global_flags.py``), which puts
the LLVM they link statically into the process's global symbol table. Triton — installed with
every CUDA build of PyTorch, which is what ``pip install torch`` gives on Linux — links its
own, different LLVM into ``libtriton.so`` and exports it: loaded *after* TensorFlow, its
initialisers bind to TensorFlow's copy and the interpreter dies of SIGSEGV (tensorflow/
tensorflow#124205). PyTorch loads Triton whenever ``torch._dynamo`` is imported, which
``torch.optim``'s optimizers do on their first step, so a rank that ran Keras and then
PyTorch (a DataFrame job using both, a pooled rank's next job) crashes.

Loaded first, ``libtriton.so`` keeps its own symbols (loaded locally, it is not in the global
table, and TensorFlow's references find TensorFlow's): :func:`before_tensorflow` does that,
when TensorFlow is imported in a rank and only where both conditions hold. Measured here
(2026-12-05, TensorFlow 2.21.0, Triton 3.8.0): ``import triton`` takes 0.15 s.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os

log = logging.getLogger(__name__)

GLOBAL_FLAGS_MODULE = os.path.join("python", "pywrap_dlopen_global_flags.py")


def tensorflow_loads_globally(tensorflow_dir: str | None) -> bool:
    """Whether the TensorFlow package at ``tensorflow_dir`` loads its library with
    ``RTLD_GLOBAL`` (its wheel ships the module that sets the flag)."""
    return bool(tensorflow_dir) and os.path.isfile(
        os.path.join(str(tensorflow_dir), GLOBAL_FLAGS_MODULE))


def before_tensorflow() -> bool:
    """Import Triton if it is installed and the TensorFlow about to be imported would load
    its LLVM globally; True if it did. Called once, when a rank first imports TensorFlow
    (before TensorFlow's code runs). A Triton that fails to import is left to fail where the
    user's code imports it."""
    spec = importlib.machinery.PathFinder.find_spec("tensorflow")
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    if not any(tensorflow_loads_globally(d) for d in locations):
        return False
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401  (loaded for its library's symbols)
    except Exception as exc:  # the user's own import will report it
        log.debug("triton did not import before TensorFlow: %s", exc)
        return False
    log.debug("triton loaded before TensorFlow (TensorFlow loads its LLVM globally)")
    return True
