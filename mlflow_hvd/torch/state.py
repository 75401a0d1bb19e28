"""Rank side: a model's and optimizer's state as a checkpoint holds it, whatever wraps the
model: a plain module or Horovod's (``model.state_dict()``), DistributedDataParallel (its
inner module's: the checkpoint loads into a plain module too), or FSDP (``fully_shard``:
each rank holds a shard; the full state is gathered to rank 0's CPU and, on restore, sent
from it, with ``torch.distributed.checkpoint.state_dict``)."""

from __future__ import annotations

from typing import Any

from mlflow_hvd.errors import ConfigurationError

FSDP_FULL = "fsdp-full"  # the checkpoint's "format" for an FSDP model's gathered state


def unwrapped(model: Any) -> Any:
    """The module DistributedDataParallel wraps (``model`` itself otherwise)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def is_sharded(model: Any) -> bool:
    """Whether ``model`` (or a submodule) is sharded by FSDP2's ``fully_shard``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def gather(model: Any, optimizer: Any) -> dict[str, Any] | None:
    """The full state of ``model`` and ``optimizer``: on rank 0 a dict for ``torch.save``,
    None on other ranks of a sharded model (call on every rank: gathering an FSDP model is
    a collective)."""
    if not is_sharded(model):
        return {"model": unwrapped(model).state_dict(), "optimizer": optimizer.state_dict()}
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    return {"model": model_state, "optimizer": optim_state, "format": FSDP_FULL}


def load(model: Any, optimizer: Any, state: dict[str, Any] | None) -> None:
    """Load ``state`` (as :func:`gather` made it, on rank 0; None on others of a sharded
    model, which receive theirs from rank 0: call on every rank then)."""
    if not is_sharded(model):
        if state is None:  # a caller's error, not the user's
            raise ValueError("a checkpoint of an unsharded model loads where it was read")
        if state.get("format") == FSDP_FULL:
            raise ConfigurationError(
                "the checkpoint is an FSDP model's (gathered from its shards): restore it "
                "into a model sharded with fully_shard, as the job that wrote it was")
        unwrapped(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if state is not None and state.get("format") != FSDP_FULL:
        raise ConfigurationError(
            "the checkpoint is an unsharded model's (a plain, DistributedDataParallel or "
            "Horovod model): restore it into such a model, not one sharded with fully_shard")
    # model, then optimizer, in two calls: set_state_dict() takes a rank given an empty
    # model state (as ranks other than 0 are) for an optimizer-only load, and skips the
    # model's broadcast there while rank 0 sends it (torch 2.13)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, state["model"] if state is not None else {}, options=options)
    set_optimizer_state_dict(model, optimizer, state["optimizer"] if state is not None else {},
                             options=options)
