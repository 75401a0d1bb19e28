"""Rank side: sharded checkpoints, for a model too big for one host
(``torch.distributed.checkpoint``, DCP).

Saving, every rank writes its own part of the model's and the optimizer's state into a
directory of its own disk (:func:`write`: DCP's ``__<rank>_0.distcp`` files, and rank 0's
``.metadata``); the files then travel to rank 0 one chunk at a time, each handed on (to the
run's upload queue) before the next arrives (:func:`to_rank0`). Restoring, rank 0 sends the
checkpoint's files to every rank the same way (:func:`from_rank0`) and each rank reads from
them the part the job's own sharding gives it (:func:`read`): a checkpoint written by
another number of ranks is resharded. No rank holds more of the state in memory than its
own part and one chunk; hosts need disk for the files (rank 0 for the whole checkpoint
until it is uploaded).

The files move over the job's process group, through a Gloo group where the default one
is NCCL's (CPU tensors), made for the transfer and destroyed after it. Every function here
is a collective: every rank calls it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

CHUNK = 8 << 20  # bytes per message: the memory a transfer takes


def write(model: Any, optimizer: Any, directory: str) -> None:
    """Write this rank's part of ``model``'s and ``optimizer``'s state into ``directory``
    (DCP's files; rank 0 adds the checkpoint's metadata)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state},
             storage_writer=dcp.FileSystemWriter(directory))


def read(model: Any, optimizer: Any, directory: str) -> None:
    """Load into ``model`` and ``optimizer`` this rank's part of the checkpoint whose files
    are in ``directory``, for the way the model is sharded now (the optimizer's state is
    created first where it does not exist yet, as DCP loads into it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


def to_rank0(directory: str, upload: Callable[[str], None] | None) -> list[str]:
    """Every rank's files of ``directory`` to rank 0: there, ``upload(path)`` is called for
    each (rank 0's own first, then rank 1's, ...), and a file received from another rank is
    deleted once ``upload`` returns. Returns the names of all the files, in that order."""
    with _cpu_group() as group:
        return _to_rank0(directory, upload, group)


def _to_rank0(directory: str, upload: Callable[[str], object] | None, group: Any) -> list[str]:
    import torch.distributed as dist

    rank = dist.get_rank()
    mine = [(name, os.path.getsize(os.path.join(directory, name)))
            for name in sorted(os.listdir(directory))]
    listing: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(listing, mine, group=group)
    names = [name for files in listing for name, _ in files]
    if len(set(names)) != len(names):
        raise RuntimeError(f"ranks wrote checkpoint files of the same name: {sorted(names)}")
    for src, files in enumerate(listing):
        for name, size in files:
            path = os.path.join(directory, name)
            if src == 0:
                if rank == 0 and upload is not None:
                    upload(path)
            elif rank == src:
                _send(path, 0, group)
            elif rank == 0:
                _receive(path, size, src, group)
                try:
                    if upload is not None:
                        upload(path)
                finally:
                    os.remove(path)
    return names


def from_rank0(directory: str) -> None:
    """Rank 0's files of ``directory`` into the same directory name on every other rank
    (``directory`` may differ from rank to rank: each names its own)."""
    with _cpu_group() as group:
        _from_rank0(directory, group)


def _from_rank0(directory: str, group: Any) -> None:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    box: list[Any] = [None]
    if rank == 0:
        box[0] = [(name, os.path.getsize(os.path.join(directory, name)))
                  for name in sorted(os.listdir(directory))]
    dist.broadcast_object_list(box, src=0, group=group)
    buffer = torch.empty(CHUNK, dtype=torch.uint8)
    for name, size in box[0]:
        path = os.path.join(directory, name)
        if rank == 0:
            with open(path, "rb") as source:
                for n in _chunks(size):
                    source.readinto(buffer[:n].numpy().data)
                    dist.broadcast(buffer[:n], src=0, group=group)
        else:
            with open(path, "wb") as sink:
                for n in _chunks(size):
                    dist.broadcast(buffer[:n], src=0, group=group)
                    sink.write(buffer[:n].numpy().data)


def _chunks(size: int) -> list[int]:
    """The sizes of the messages a file of ``size`` bytes travels in."""
    return [min(CHUNK, size - start) for start in range(0, size, CHUNK)]


def _send(path: str, dst: int, group: Any) -> None:
    import torch
    import torch.distributed as dist

    buffer = torch.empty(CHUNK, dtype=torch.uint8)
    with open(path, "rb") as f:
        for n in _chunks(os.path.getsize(path)):
            f.readinto(buffer[:n].numpy().data)
            dist.send(buffer[:n], dst, group=group)


def _receive(path: str, size: int, src: int, group: Any) -> None:
    import torch
    import torch.distributed as dist

    buffer = torch.empty(CHUNK, dtype=torch.uint8)
    with open(path, "wb") as f:
        for n in _chunks(size):
            dist.recv(buffer[:n], src, group=group)
            f.write(buffer[:n].numpy().data)


@contextlib.contextmanager
def _cpu_group() -> Iterator[Any]:
    """The group the files move over: the default process group where it is Gloo's, else
    a side group of Gloo (:func:`_side_group`)."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        yield dist.group.WORLD
    else:
        with _side_group() as group:
            yield group


@contextlib.contextmanager
def _side_group() -> Iterator[Any]:
    """A Gloo group of the job's ranks for one transfer (a collective), destroyed after it:
    a group left behind would keep a full mesh of sockets and Gloo's threads per rank for
    the job's life, one more per checkpoint."""
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    try:
        yield group
    finally:
        dist.destroy_process_group(group)
