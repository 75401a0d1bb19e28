"""Rank side: the collective a PyTorch training function initialised - ``torch.distributed``
(DistributedDataParallel, FSDP) or ``horovod.torch`` - as :mod:`mlflow_hvd.torch` needs it:
this rank, the number of ranks, an object sent from one rank to all, and every rank's
object gathered on all."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from mlflow_hvd.errors import ConfigurationError


@dataclass(frozen=True)
class World:
    """The ranks a job's collective joined. ``broadcast(value)`` returns rank 0's
    ``value`` on every rank, ``broadcast_from(value, root)`` rank ``root``'s, and
    ``all_gather(value)`` every rank's, in rank order (collectives: every rank calls them);
    ``kind`` is ``"torch.distributed"`` or ``"horovod"``."""

    kind: str
    rank: int
    size: int
    broadcast_from: Callable[[object, int], object]
    all_gather: Callable[[object], list[object]]

    def broadcast(self, value: object) -> object:
        return self.broadcast_from(value, 0)


def current() -> World:
    """The initialised collective: ``torch.distributed``'s default process group if there is
    one, else Horovod's.

    Raises:
        ConfigurationError: Neither is initialised yet.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():

        def broadcast_from(value: object, root: int) -> object:
            box = [value]
            dist.broadcast_object_list(box, src=root)
            return box[0]

        def all_gather(value: object) -> list[object]:
            every: list[object] = [None] * dist.get_world_size()
            dist.all_gather_object(every, value)
            return every

        return World("torch.distributed", dist.get_rank(), dist.get_world_size(),
                     broadcast_from, all_gather)
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None and hvd.is_initialized():
        # named: Horovod otherwise names them after the object's type, which differs
        # between the sender and the receivers (None), and the op waits forever
        return World("horovod", hvd.rank(), hvd.size(),
                     lambda value, root: hvd.broadcast_object(
                         value, root_rank=root, name="mlflow_hvd.broadcast_object"),
                     lambda value: list(hvd.allgather_object(
                         value, name="mlflow_hvd.allgather_object")))
    raise ConfigurationError(
        "mlflow_hvd.torch needs the ranks' collective: call dist.init_process_group(...) "
        "(torch.distributed: DDP, FSDP) or hvd.init() (horovod.torch) first")
