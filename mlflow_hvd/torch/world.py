"""Rank side: the collective a PyTorch training function initialised - ``torch.distributed``
(DistributedDataParallel, FSDP) or ``horovod.torch`` - as :mod:`mlflow_hvd.torch` needs it:
this rank, the number of ranks, and an object sent from rank 0 to all."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from mlflow_hvd.errors import ConfigurationError


@dataclass(frozen=True)
class World:
    """The ranks a job's collective joined. ``broadcast(value)`` returns rank 0's
    ``value`` on every rank (a collective: every rank calls it); ``kind`` is
    ``"torch.distributed"`` or ``"horovod"``."""

    kind: str
    rank: int
    size: int
    broadcast: Callable[[object], object]


def current() -> World:
    """The initialised collective: ``torch.distributed``'s default process group if there is
    one, else Horovod's.

    Raises:
        ConfigurationError: Neither is initialised yet.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():

        def broadcast(value: object) -> object:
            box = [value]
            dist.broadcast_object_list(box, src=0)
            return box[0]

        return World("torch.distributed", dist.get_rank(), dist.get_world_size(), broadcast)
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None and hvd.is_initialized():
        return World("horovod", hvd.rank(), hvd.size(),
                     lambda value: hvd.broadcast_object(value, root_rank=0))
    raise ConfigurationError(
        "mlflow_hvd.torch needs the ranks' collective: call dist.init_process_group(...) "
        "(torch.distributed: DDP, FSDP) or hvd.init() (horovod.torch) first")
