"""Rank side: snapshots of a PyTorch training loop every N steps, kept on the job's own hosts
(the state copied in memory on the training thread, written to the host's local disk by a
thread beside it; never sent to the tracking server), and resume from the newest of them or
the run's latest checkpoint, mid-epoch included.

Replicated state (DistributedDataParallel, ``horovod.torch``) is written once per host, by
the host's lowest rank, with every rank's RNG state: each host's copy is a whole snapshot,
so a retried attempt resumes from the newest one any surviving host holds. The lowest rank
holding it reads it and sends it to the others over the job's collective. A snapshot is
complete once its file is renamed into place; the two newest are kept per host
(``KEEP``), in ``<temporary directory>/mlflow-hvd-snapshots/<run id>`` (or
``$MLFLOW_HVD_SNAPSHOT_DIR/<run id>``), and removed when the loop's ``with`` block ends
without an error. A snapshot that cannot be written (a full disk) is skipped and said;
training goes on.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import random
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.rank import context
from mlflow_hvd.rank.tracking import api as tracking_api
from mlflow_hvd.rank.tracking import checkpoints
from mlflow_hvd.torch import state, world

log = logging.getLogger(__name__)

ROOT_ENV = "MLFLOW_HVD_SNAPSHOT_DIR"
KEEP = 2  # complete snapshots kept per host: the newest, and one while it is written
STALE_SECONDS = 24 * 3600.0  # another run's snapshots untouched this long are removed
_FILE = re.compile(r"^step-(\d{10})-epoch-(\d+)-batch-(\d+)\.pt$")


@dataclass(frozen=True)
class Position:
    """Where a resumed loop continues: ``epoch`` and, within it, ``batch`` (the first one
    not yet trained: 0 from a checkpoint or at the start), and what it was restored from
    (``"start"``, ``"checkpoint"`` or ``"snapshot"``)."""

    epoch: int
    batch: int
    source: str
    _rng: Any = field(default=None, repr=False, compare=False)

    def batches(self, epoch: int, loader: Any) -> Iterator[tuple[int, Any]]:
        """``enumerate(loader)`` for ``epoch``, without the batches trained before a
        failure when this is the epoch a snapshot was taken in. The skipped batches are
        still read (the loader's order must depend on the epoch only, as
        ``DistributedSampler.set_epoch`` and this package's shard loaders make it), then
        this rank's RNG state is set to the snapshot's, as it was at the next batch."""
        batches = enumerate(loader)
        if epoch != self.epoch or not self.batch:
            return batches
        for _ in range(self.batch):
            if next(batches, None) is None:
                break
        _set_rng(self._rng)
        return batches


class Snapshots:
    """Snapshots of ``model`` and ``optimizer`` every ``every`` steps, kept on the job's own
    hosts; :meth:`resume` continues from the newest one or from the run's latest
    checkpoint, whichever is newer. Create it on every rank after the model is wrapped
    (DistributedDataParallel) or the optimizer is (``hvd.DistributedOptimizer``), and use
    it as a context manager: the block's end without an error removes this run's
    snapshots from the host.

    Args:
        model: The module trained (DistributedDataParallel's is saved as its inner one).
        optimizer: Its optimizer.
        every: Steps between snapshots: a failure repeats fewer than this many.
        directory: Where each host keeps them (default: ``$MLFLOW_HVD_SNAPSHOT_DIR``, else
            the temporary directory), in a folder per MLflow run.

    Raises:
        ConfigurationError: ``every`` is not a positive integer; the model is sharded
            (FSDP); no collective is initialised.
    """

    def __init__(self, model: Any, optimizer: Any, every: int,
                 directory: str | None = None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigurationError(
                f"Snapshots(every={every!r}): the number of steps between snapshots must be "
                "a positive integer (a failure repeats fewer steps than this)")
        if state.is_sharded(model):
            raise ConfigurationError(
                "Snapshots of a model sharded with fully_shard are not supported yet: "
                "save sharded checkpoints per epoch (save_checkpoint(sharded=True))")
        self._model, self._optimizer, self._every = model, optimizer, every
        self._world = world.current()
        run_id = tracking_api.run_id()
        root = directory or os.environ.get(ROOT_ENV) or os.path.join(
            tempfile.gettempdir(), "mlflow-hvd-snapshots")
        self.directory = None if run_id is None else os.path.join(root, run_id)
        host = socket.gethostname()
        hosts = self._world.all_gather(host) if self._world.size > 1 else [host]
        self._hosts = hosts
        self._writer = hosts.index(host) == self._world.rank  # the host's lowest rank
        self._steps = 0
        self._thread: threading.Thread | None = None
        self._said_size = False
        self.taken = self.skipped = 0
        if self.directory is None:
            if self._world.rank == 0:
                log.warning("snapshots are off: the job tracks to no MLflow run, whose id "
                            "names them across attempts")
        elif self._writer:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            if os.stat(self.directory).st_uid != os.getuid():  # its files are unpickled
                raise ConfigurationError(
                    f"the snapshot folder {self.directory} belongs to another user: pass "
                    f"Snapshots(directory=...) or set {ROOT_ENV} to a folder of your own")
            _remove_partial(self.directory)
            _remove_stale(root, keep=self.directory)

    def __enter__(self) -> Snapshots:
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        self.flush()
        if kind is None and self._writer and self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    def resume(self) -> Position:
        """Every rank: restore the newest of the snapshots the job's hosts hold and the run's
        latest checkpoint into the model and optimizer (a snapshot only when it is from a
        later epoch than the checkpoint), and return where to continue. Call it once,
        before the loop.

        Raises:
            ConfigurationError: As :func:`mlflow_hvd.torch.restore_from_checkpoint`.
        """
        held = _held(self.directory) if self.directory is not None else []
        every: list[list[tuple[int, int, int]]] = (
            self._world.all_gather(held) if self._world.size > 1 else [held])  # type: ignore[assignment]
        newest = max((s for h in every for s in h), default=None)  # (step, epoch, batch)
        checkpoint = -1
        if self._world.rank == 0 and newest is not None:
            ref, _ = checkpoints.to_resume()
            checkpoint = ref.epoch if ref is not None else -1
        if self._world.size > 1 and newest is not None:
            checkpoint = int(self._world.broadcast(checkpoint))  # type: ignore[call-overload]
        if newest is None or newest[1] <= checkpoint:
            from mlflow_hvd.torch import restore_from_checkpoint

            start = restore_from_checkpoint(self._model, self._optimizer)
            return Position(start, 0, "checkpoint" if start else "start")
        step, epoch, batch = newest
        holder = min(r for r, h in enumerate(every) if newest in h)
        loaded = None
        if self._world.rank == holder:
            import torch

            assert self.directory is not None
            loaded = torch.load(os.path.join(self.directory, _name(*newest)),
                                map_location="cpu", weights_only=False)
        if self._world.size > 1:
            loaded = self._world.broadcast_from(loaded, holder)
        assert isinstance(loaded, dict)
        state.unwrapped(self._model).load_state_dict(loaded["model"])
        self._optimizer.load_state_dict(loaded["optimizer"])
        rngs = loaded["rng"]
        resized = len(rngs) != self._world.size
        mine = None if resized else rngs[self._world.rank]
        _set_rng(mine)  # also after the skipped batches: Position.batches
        self._steps = step
        # after a resize each rank's shard of the epoch is another size: skip as large a
        # part of it as the ranks had trained (an approximation: another split of the rows)
        skip = (batch + 1) * len(rngs) // self._world.size if resized else batch + 1
        if self._world.rank == 0:
            tracking_api.set_tag("mlflow_hvd.resumed_from",
                                 f"{tracking_api.run_id()}@epoch_{epoch}_batch_{batch}")
            # the steps since the snapshot run again: what they logged is in the run once
            through = tracking_api.skip_repeated_steps()
            context.log_to_driver(
                f"resuming from the snapshot of step {step} (epoch {epoch}, after batch "
                f"{batch}) held on {self._hosts[holder]}; the run's latest checkpoint is "
                + (f"of epoch {checkpoint}" if checkpoint >= 0 else "none")
                + ("; metric values at steps the run already has are not logged again "
                   "(latest: " + ", ".join(f"{k} {v}" for k, v in sorted(through.items()))
                   + ")" if through else "")
                + (f"; written by {len(rngs)} ranks, {self._world.size} now: each skips "
                   f"{skip} batches of its shard, and the RNG states are not restored"
                   if resized else ""))
        return Position(epoch, skip, "snapshot", mine)

    def step(self, epoch: int, batch: int) -> None:
        """Every rank, after the optimizer's step of ``batch`` (0-based) in ``epoch``: every
        ``every``-th call takes a snapshot (a collective: each rank's RNG state)."""
        self._steps += 1
        if self._steps % self._every == 0:
            self.take(epoch, batch)

    def take(self, epoch: int, batch: int) -> None:
        """Every rank: a snapshot now, after ``batch`` of ``epoch`` (a collective). The
        state is copied on this thread; the host's writer writes it beside training. A
        snapshot due while the previous one is still being written is skipped."""
        if self.directory is None:  # no run to name them (every rank knows): none taken
            return
        rng = _get_rng()
        rngs = self._world.all_gather(rng) if self._world.size > 1 else [rng]
        if not self._writer:
            return
        if self._thread is not None and self._thread.is_alive():
            self.skipped += 1
            log.warning("snapshot of step %d skipped: the previous one is still being "
                        "written (snapshot less often: Snapshots(every=...))", self._steps)
            return
        copied = {"model": _to_cpu(state.unwrapped(self._model).state_dict()),
                  "optimizer": _to_cpu(self._optimizer.state_dict()), "rng": rngs,
                  "epoch": epoch, "batch": batch, "step": self._steps}
        name = _name(self._steps, epoch, batch)
        self._thread = threading.Thread(target=self._write, args=(copied, name),
                                        name="mlflow-hvd-snapshot", daemon=True)
        self._thread.start()

    def flush(self, timeout: float = 600.0) -> None:
        """Wait until the snapshot being written, if any, is on disk (at most ``timeout``
        seconds)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _write(self, copied: dict[str, Any], name: str) -> None:
        import torch

        assert self.directory is not None
        final = os.path.join(self.directory, name)
        partial = final + ".partial"
        started = time.monotonic()
        file: _Recorded | None = None
        try:
            with open(partial, "wb") as raw:
                file = _Recorded(raw)
                torch.save(copied, file)  # type: ignore[arg-type]
            os.replace(partial, final)
        except (OSError, RuntimeError) as exc:  # a full disk: skipped, training goes on
            # torch.save reports its file's OSError as a RuntimeError of its own
            cause: BaseException = exc
            if file is not None and file.error is not None:
                cause = file.error
            with contextlib.suppress(OSError):
                os.unlink(partial)
            self.skipped += 1
            log.warning("snapshot %s skipped: %s; training goes on", name, cause)
            context.log_to_driver(f"snapshot {name} skipped on {socket.gethostname()}: "
                                  f"{cause}; training goes on")
            return
        self.taken += 1
        for old in _held(self.directory)[:-KEEP]:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.directory, _name(*old)))
        if not self._said_size and self._world.rank == 0:
            self._said_size = True
            size = os.path.getsize(final) / 2**20
            context.log_to_driver(
                f"snapshots every {self._every} steps in {self.directory} on each host: "
                f"{size:.1f} MiB each, {KEEP} kept ({KEEP * size:.1f} MiB); the first took "
                f"{time.monotonic() - started:.2f}s to write")


class _Recorded:
    """A file for ``torch.save`` that keeps the ``OSError`` of a failed write (ENOSPC),
    which ``torch.save`` turns into a RuntimeError naming neither."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return int(self.raw.write(data))
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.raw.flush()


def _name(step: int, epoch: int, batch: int) -> str:
    return f"step-{step:010d}-epoch-{epoch}-batch-{batch}.pt"


def _held(directory: str | None) -> list[tuple[int, int, int]]:
    """The complete snapshots in ``directory``: (step, epoch, batch), oldest first."""
    try:
        names = os.listdir(directory) if directory else []
    except OSError:
        return []
    found = [_FILE.match(n) for n in names]
    return sorted((int(m.group(1)), int(m.group(2)), int(m.group(3))) for m in found if m)


def _remove_partial(directory: str) -> None:
    """Files a killed writer left half written."""
    for name in os.listdir(directory):
        if name.endswith(".partial"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))


def _remove_stale(root: str, keep: str) -> None:
    """Other runs' snapshot folders untouched for ``STALE_SECONDS`` (jobs that failed for
    good, or ended without the ``with`` block)."""
    now = time.time()
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            path = os.path.join(root, name)
            if path == keep:
                continue
            with contextlib.suppress(OSError):
                if now - os.stat(path).st_mtime > STALE_SECONDS:
                    shutil.rmtree(path, ignore_errors=True)


def _to_cpu(value: Any) -> Any:
    """A copy of a state dict whose tensors are on the CPU and no longer change."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return copy.deepcopy(value)


def _get_rng() -> dict[str, Any]:
    """This rank's random states: Python's, NumPy's global one (if imported), PyTorch's CPU
    generator and, if CUDA is initialised, its devices'."""
    import torch

    rng: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        rng["numpy"] = numpy.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def _set_rng(rng: dict[str, Any] | None) -> None:
    if not rng:
        return
    import torch

    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if "numpy" in rng:
        import numpy

        numpy.random.set_state(rng["numpy"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
