"""Rank side: who this rank is - its place in the job's layout as its agent started it (the
``HOROVOD_*`` variables :mod:`mlflow_hvd.common.layout` builds, the host's name the driver
knows it by) - read in one place. Outside a worker (code run directly on the driver) it is
rank 0 of 1 on this host.

This is the layout the job was started with; the collective a training function
initialised (``hvd.init()`` or ``init_process_group``) is :mod:`mlflow_hvd.torch.world`'s.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from mlflow_hvd.common.layout import HOST_VARIABLE


@dataclass(frozen=True)
class RankIdentity:
    """A rank's place in the job (see the module docstring)."""

    rank: int
    size: int
    local_rank: int
    host: str
    in_worker: bool  # started by an agent as a rank of a job


def current() -> RankIdentity:
    """This process's identity, from its environment."""
    env = os.environ
    return RankIdentity(
        rank=int(env.get("HOROVOD_RANK", "0")),
        size=int(env.get("HOROVOD_SIZE", "1")),
        local_rank=int(env.get("HOROVOD_LOCAL_RANK", "0")),
        host=env.get(HOST_VARIABLE) or env.get("HOROVOD_HOSTNAME") or socket.gethostname(),
        in_worker=env.get("HOROVOD_RANK") is not None,
    )
