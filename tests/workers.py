"""Tiny training functions the integration tests run on every rank.

This module is pickled by value by HorovodRunner, so workers don't need ``tests`` on their
path.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any


def collectives(scale: float = 1.0) -> dict[str, Any]:
    """Real allreduce / allgather / broadcast; returns what this rank saw."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import mlflow_hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    total = hvd.allreduce(tf.constant([float(rank + 1) * scale]), op=hvd.Sum)
    mean = hvd.allreduce(tf.constant([float(rank)]), op=hvd.Average)
    gathered = hvd.allgather(tf.constant([rank * 10, rank * 10 + 1]))
    bcast = hvd.broadcast(tf.constant([float(rank + 100)]), root_rank=0)
    print(f"hello from rank {rank} on stdout")
    mlflow_hvd.log_to_driver(f"rank {rank} of {size} says hi")
    return {
        "rank": rank,
        "size": size,
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(),
        "cross_size": hvd.cross_size(),
        "sum": total.numpy().tolist(),
        "mean": mean.numpy().tolist(),
        "gathered": gathered.numpy().tolist(),
        "broadcast": bcast.numpy().tolist(),
        "pid": os.getpid(),
    }


def raise_on_rank_1() -> None:
    import horovod.tensorflow as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("boom from rank 1")
    time.sleep(120)  # rank 0 idles until the driver stops it


def exit_3_on_rank_1() -> None:
    import horovod.tensorflow as hvd

    hvd.init()
    if hvd.rank() == 1:
        print("rank 1 about to exit with status 3", flush=True)
        os._exit(3)
    time.sleep(120)


def sigkill_on_rank_1() -> None:
    import horovod.tensorflow as hvd

    hvd.init()
    if hvd.rank() == 1:
        print("rank 1 about to SIGKILL itself", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)


def echo(**kwargs: Any) -> dict[str, Any]:
    """No Horovod at all: returns its kwargs and rank from the environment."""
    return {"kwargs": kwargs, "rank": int(os.environ["HOROVOD_RANK"])}


def long_line(nbytes: int) -> int:
    print("x" * nbytes, flush=True)
    print("after the long line", flush=True)
    return nbytes
