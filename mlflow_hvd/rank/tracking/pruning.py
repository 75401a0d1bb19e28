"""Rank side of pruning in a sweep: rank 0 reports the watched metric per epoch, every rank
learns the driver's verdict at the same epoch boundary.

In a job that prunes (``TrackingTarget.prune_metric`` set by :func:`mlflow_hvd.sweep.sweep`),
each value of that metric rank 0 logs with a step (``MlflowCallback``,
``mlflow_hvd.tracking.log_metrics(..., step=epoch)``, ``mlflow.log_metric(..., step=...)``)
is also sent to the driver as an :class:`~mlflow_hvd.protocol.messages.EpochReport`, on a
connection of its own, and the answer kept: one round trip per epoch, while the other ranks
are still in the epoch's last collective or about to wait in :func:`should_prune`.

:func:`should_prune` is a collective: every rank calls it at the same point after the
epoch's metrics are logged, rank 0 broadcasts the verdict (one Horovod broadcast, with
whichever of ``horovod.tensorflow`` and ``horovod.torch`` is initialised), and every
rank returns the same answer, so they all leave the training loop after the same epoch and
none is left waiting in an allreduce. Outside a pruning job it returns False at once, on
every rank alike, without any collective.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
from collections.abc import Mapping
from typing import Any

from mlflow_hvd.errors import ChannelError, ConfigurationError
from mlflow_hvd.protocol.channel import ChannelClient
from mlflow_hvd.protocol.messages import EpochReport, EpochVerdict, TrackingTarget
from mlflow_hvd.rank import context

REPORT_TIMEOUT = 30.0  # seconds the driver has to answer one epoch report

log = logging.getLogger(__name__)


class _Watch:
    """One job's pruning state in this process (reset for every job by :func:`reset`)."""

    def __init__(self, target: TrackingTarget | None, rank: int) -> None:
        self.metric = target.prune_metric if target is not None else ""
        self.run_id = target.run_id if target is not None else ""
        self.rank = rank
        self.verdict: EpochVerdict | None = None  # rank 0: the latest, not yet broadcast
        self.pruned_at = 0  # epochs completed when every rank learnt to stop; 0: not pruned
        self.calls = 0  # should_prune calls: names each broadcast alike on every rank
        self.channel: ChannelClient | None = None
        self.silent = False  # the driver could not be asked: said once, training goes on
        self.lock = threading.Lock()


_watch = _Watch(None, 0)


def reset(target: TrackingTarget | None, rank: int) -> None:
    """A new job: forget the previous one's verdicts (warm ranks run many jobs)."""
    global _watch
    close()
    _watch = _Watch(target, rank)


def close() -> None:
    """The job ended: close rank 0's connection for reports."""
    watch = _watch
    with watch.lock:
        channel, watch.channel = watch.channel, None
    if channel is not None:
        channel.close()


def observe(metrics: Mapping[str, Any], step: int | None) -> None:
    """Rank 0, as metrics are logged: report the watched one to the driver (when it is
    among ``metrics`` and has a step) and keep the verdict for :func:`should_prune`."""
    watch = _watch
    if not watch.metric or watch.rank != 0 or step is None or watch.metric not in metrics:
        return
    try:
        value = float(metrics[watch.metric])  # a tensor: its value now, at the epoch's end
    except (TypeError, ValueError):
        return
    if not math.isfinite(value):
        value = math.inf  # a diverged trial is the worst there is, not "no value"
    verdict = _ask(watch, EpochReport(watch.run_id, watch.metric, int(step), value))
    if verdict is not None:
        watch.verdict = verdict


def _ask(watch: _Watch, report: EpochReport) -> EpochVerdict | None:
    connect = context.connector()
    if connect is None or watch.silent:
        return None
    with watch.lock:
        try:
            if watch.channel is None:
                watch.channel = connect()
            answer = watch.channel.request(report, REPORT_TIMEOUT)
        except ChannelError as exc:
            channel, watch.channel = watch.channel, None
            if channel is not None:
                channel.close()
            watch.silent = True
            sys.stderr.write(f"mlflow_hvd: rank 0 cannot report {watch.metric!r} to the "
                             f"driver ({exc}); this trial will not be pruned\n")
            return None
    return answer if isinstance(answer, EpochVerdict) else None


def should_prune() -> bool:
    """Whether the sweep's driver decided to stop this trial after the epoch just logged.

    A collective: call it on every rank at the same point of every epoch, after rank 0
    logged the epoch's metrics, and leave the training loop on True (every rank gets the
    same answer). ``MlflowCallback`` calls it for Keras' ``fit``; a custom loop writes::

        tracking.log_metrics({"val_loss": val_loss}, step=epoch)
        if tracking.should_prune():
            break

    Outside a sweep that prunes, False at once on every rank (no collective).

    Raises:
        ConfigurationError: Neither Horovod nor ``torch.distributed`` is initialised (call
            ``hvd.init()`` or ``init_process_group()`` first).
    """
    watch = _watch
    if not watch.metric:
        return False
    watch.calls += 1
    verdict, watch.verdict = watch.verdict, None
    decision = (verdict.epoch if verdict is not None and verdict.prune else 0)
    decision = int(_broadcast(decision, f"mlflow_hvd.prune.{watch.calls}"))
    if decision and not watch.pruned_at:
        watch.pruned_at = decision
        if watch.rank == 0 and verdict is not None:
            sys.stderr.write(f"mlflow_hvd: the sweep prunes this trial after epoch "
                             f"{decision}: {verdict.reason}\n")
    return decision > 0


def was_pruned() -> bool:
    """True on every rank once :func:`should_prune` returned True in this job: e.g. to skip
    a final evaluation or ``log_model`` that a pruned trial does not need."""
    return _watch.pruned_at > 0


def _broadcast(value: int, name: str) -> int:
    """Rank 0's ``value`` on every rank: one broadcast of a one-element tensor
    (``broadcast_object`` would take two collectives and a pickle), through Horovod if the
    function initialised it, else through ``torch.distributed``'s default group."""
    dist = _torch_distributed()
    hvd = _horovod(required=dist is None)
    if hvd is None:
        return _broadcast_torch(dist, value)
    if hvd.size() == 1:
        return value
    if hvd.__name__ == "horovod.torch":
        import torch

        return int(hvd.broadcast(torch.tensor([value], dtype=torch.int64), 0, name=name)[0])
    import tensorflow as tf

    return int(hvd.broadcast(tf.constant([value], dtype=tf.int64), 0, name=name).numpy()[0])


def _horovod(required: bool = True) -> Any:
    """The initialised Horovod frontend (the same on every rank: the same code runs); None
    when there is none and ``required`` is False."""
    for name in ("horovod.tensorflow", "horovod.torch"):
        module = sys.modules.get(name)
        if module is not None and module.is_initialized():
            return module
    if not required:
        return None
    raise ConfigurationError(
        "should_prune() is a collective: call hvd.init() (horovod.tensorflow or "
        "horovod.torch) or torch.distributed's init_process_group() before it, on every rank"
    )


def _torch_distributed() -> Any:
    """``torch.distributed`` if the function initialised its default process group."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


def _broadcast_torch(dist: Any, value: int) -> int:
    """Rank 0's ``value`` over the default process group (on the rank's GPU for NCCL)."""
    import torch

    if dist.get_world_size() == 1:
        return value
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    box = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(box, src=0)
    return int(box[0])


__all__ = ["close", "observe", "reset", "should_prune", "was_pruned"]
