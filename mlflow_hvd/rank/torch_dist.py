"""Rank side: ``torch.distributed`` code as users write it under ``torchrun``, in a rank.

The agent starts each worker with torchrun's variables that stay the same from job to job
(:func:`mlflow_hvd.common.layout.torch_env`: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` of the driver, ...). Here, per job: the variables the driver sent with the
job set before its code is unpickled and restored after it (:func:`mlflow_hvd.common.layout
.job_vars`: the run id, the store's port, the attempt), the driver told to start the store
once torch.distributed is imported (:mod:`mlflow_hvd.driver.torch_store`: a driver that
never hears it never imports torch), and after a warm rank's job the default process group
destroyed, so that the next job's ``init_process_group`` can run.
"""

from __future__ import annotations

import gc
import importlib.abc
import importlib.machinery
import linecache
import logging
import os
import sys
import types
from collections.abc import Callable, Sequence

from mlflow_hvd.rank.after_import import spec_then

log = logging.getLogger(__name__)

MODULE = "torch.distributed"  # imported by `import torch` itself


class _Notify(importlib.abc.MetaPathFinder):
    """Calls ``wanted`` once torch.distributed is imported."""

    def __init__(self, wanted: Callable[[], None]) -> None:
        self.wanted = wanted

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != MODULE:
            return None
        return spec_then(fullname, path, self._then)

    def _then(self, module: types.ModuleType) -> None:
        del module
        self.wanted()


class TorchJobs:
    """One worker's side of the torch.distributed store, job after job.

    ``notify`` tells the driver that this rank imported torch.distributed (it sends
    :class:`~mlflow_hvd.protocol.messages.TorchStoreWanted`); it is called at most once per
    job, and only when the job has a store."""

    def __init__(self, notify: Callable[[], None]) -> None:
        self._notify = notify
        self._told = False  # the driver heard from us during this job
        self._saved: dict[str, str | None] = {}  # what the job's variables replaced

    def install(self) -> None:
        """Hear of torch.distributed's import from now on (before any user code runs)."""
        if not any(isinstance(f, _Notify) for f in sys.meta_path):
            sys.meta_path.insert(0, _Notify(self._wanted))

    def start_job(self, env: Sequence[tuple[str, str]]) -> None:
        """Before a job's code is unpickled: its variables set (``env``, as the driver built
        them: :func:`mlflow_hvd.common.layout.job_vars`), what they replace kept for
        :meth:`end_job`, and the driver told at once if torch.distributed is already
        imported (a warm rank's earlier job imported it)."""
        self._restore()  # a job that never reached end_job (it failed) leaves nothing
        self._saved = {name: os.environ.get(name) for name, _ in env}
        os.environ.update(env)
        self._told = False
        if MODULE in sys.modules:
            self._wanted()

    def end_job(self) -> None:
        """After a warm rank's job: destroy the default process group the job left (a
        second ``init_process_group`` in this process would fail), then give back the
        variables the job's replaced."""
        dist = sys.modules.get(MODULE)
        if dist is not None and dist.is_available() and dist.is_initialized():
            log.info("destroying the process group the job left")
            dist.destroy_process_group()
        self._restore()

    def _restore(self) -> None:
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved = {}

    def _wanted(self) -> None:
        if self._told or not os.environ.get("MASTER_PORT"):
            return
        self._told = True
        self._notify()


class Call:
    """What each rank of a :class:`~mlflow_hvd.distributor.TorchDistributor` job runs:
    ``target(*args, **kwargs)`` for a function; for a script (a path, ``source`` its text
    read on the driver: the executors need no copy) the script as ``__main__`` with
    ``sys.argv = [path, *args]``, as ``torchrun script.py args`` runs it. Returns the
    function's value (None for a script)."""

    def __init__(self, target: Callable[..., object] | str, args: tuple[object, ...],
                 source: str = "") -> None:
        self.target, self.args, self.source = target, args, source

    def __repr__(self) -> str:
        target = self.target
        return target if isinstance(target, str) else getattr(target, "__qualname__",
                                                               repr(target))

    def __call__(self, **kwargs: object) -> object:
        if not isinstance(self.target, str):  # its locals outlive it (call_holding_locals)
            return call_holding_locals(self.target, *self.args, **kwargs)
        path = self.target
        argv, sys.argv = sys.argv, [path, *map(str, self.args)]
        folder = os.path.dirname(os.path.abspath(path))
        added = os.path.isdir(folder) and folder not in sys.path
        if added:  # the script's own modules, where this host has them
            sys.path.insert(0, folder)
        try:
            # its lines in tracebacks, where this host has no copy of the file
            linecache.cache[path] = (len(self.source), None,
                                     self.source.splitlines(keepends=True), path)
            code = compile(self.source, path, "exec")
            exec(code, {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__})
        finally:
            sys.argv = argv
            if added:
                sys.path.remove(folder)
        return None


# Frames of training functions kept past their return (see call_holding_locals)
_held: list[types.FrameType] = []


def call_holding_locals(fn: Callable[..., object], *args: object, **kwargs: object) -> object:
    """``fn(*args, **kwargs)``, its frame (and so its locals) kept alive after it returns,
    until :func:`release_locals`.

    Why: a DistributedDataParallel model dropped with the function's locals may take the
    last reference to its Gloo process group through its C++ reducer, whose destructor
    joins Gloo's threads while holding the GIL (pytorch#56297) - and a Gloo thread that has
    just finished the function's last collective needs the GIL to free that work's
    tensors: a deadlock, seen on one job in three that ends with a collective and
    ``destroy_process_group()``. Under torchrun the process exits there; here a rank
    reports first, and a warm rank then frees the frame before its next job, in an order
    that cannot deadlock (:func:`release_locals`); a rank that ends exits with
    ``os._exit``, which frees nothing. The profile hook sees only the call of ``fn`` (it
    removes itself there)."""
    def hook(frame: types.FrameType, event: str, arg: object) -> None:
        del arg
        if event == "call":
            _held.append(frame)
            sys.setprofile(None)

    sys.setprofile(hook)
    try:
        return fn(*args, **kwargs)
    finally:
        sys.setprofile(None)


def release_locals() -> None:
    """Drop the frames :func:`call_holding_locals` kept, each DDP model's process group
    outliving its reducer.

    A DDP model holds its group twice: as ``process_group`` (a Python object, whose last
    reference torch drops without the GIL, pytorch#154976) and inside its C++ reducer
    (dropped with the GIL held, pytorch#56297). Dropped with the frame, the reducer may go
    last and join Gloo's threads holding the GIL: here each group is held from Python
    while the frames go, then let go, so the group's destructor runs where Gloo's threads
    can take the GIL."""
    if not _held:
        return
    groups = _ddp_groups()
    _held.clear()  # the reducers go; their groups stay (``groups``)
    groups.clear()  # now the groups: without the GIL


def _ddp_groups() -> list[object]:
    """The process group of every DistributedDataParallel model alive (none unless torch's
    DDP was imported)."""
    ddp = sys.modules.get("torch.nn.parallel.distributed")
    if ddp is None:
        return []
    kind = ddp.DistributedDataParallel
    return [obj.process_group for obj in gc.get_objects()
            if isinstance(obj, kind) and getattr(obj, "process_group", None) is not None]


# torch's words (2.13's CPU build: RuntimeError; 2.14's CUDA build on a host without a GPU:
# ValueError)
_NO_GPU_FOR_NCCL = ("doesn't have NCCL built in", "ProcessGroupNCCL is only supported with GPUs")


def hint(exc: BaseException) -> str:
    """What to do about ``exc``, a rank's error, when torch's own words do not say it
    (appended to the rank's error); "" otherwise."""
    text = str(exc)
    if isinstance(exc, RuntimeError | ValueError) and any(w in text for w in _NO_GPU_FOR_NCCL):
        return (" - init_process_group(\"nccl\") needs a GPU for each rank, and this rank has "
                "none (a CPU-only host, a CPU build of torch, or TorchDistributor(use_gpu="
                "False)): use \"gloo\" on CPUs, e.g. init_process_group(\"nccl\" if "
                "torch.cuda.is_available() else \"gloo\")")
    return ""
