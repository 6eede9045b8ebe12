"""`deepspeed.comm` for DeepSpeed scripts: a thin layer over torch.distributed.

    from zenflow import comm as dist      # was: from deepspeed import comm as dist
    dist.init_distributed()
    if dist.get_rank() == 0: ...

`init_distributed` sets up the default process group the way `deepspeed.init_distributed` does
(launched by torchrun or the deepspeed launcher: from RANK/WORLD_SIZE/LOCAL_RANK and
MASTER_ADDR/MASTER_PORT; NCCL with CUDA, gloo otherwise). `zenflow.initialize` calls it when the
environment says there are several ranks and no group exists yet, so replicas never train alone.

In a single process without a group, the queries answer for rank 0 of 1 and the collectives are
identities, so a script written for several ranks also runs as `python script.py`.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from datetime import timedelta

import torch
import torch.distributed as _dist

from zenflow.config.conventions import DIST_BACKENDS

log = logging.getLogger("zenflow.comm")

ReduceOp = _dist.ReduceOp if _dist.is_available() else None
DEFAULT_TIMEOUT = timedelta(minutes=30)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


def is_initialized() -> bool:
    return _dist.is_available() and _dist.is_initialized()


def is_available() -> bool:
    return _dist.is_available()


def env_world_size() -> int:
    """The world size the launcher announced ($WORLD_SIZE), whether or not a group exists."""
    return _env_int("WORLD_SIZE", 1)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: timedelta = DEFAULT_TIMEOUT, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Initialize the default process group unless one exists (DeepSpeed's signature).

    Rank and world size come from the arguments, else $RANK/$WORLD_SIZE, else 0 of 1. A single
    process gets a group with an in-memory store (no port is opened); several ranks rendezvous
    through `init_method` or $MASTER_ADDR:$MASTER_PORT (MASTER_PORT defaults to
    `distributed_port`, as in DeepSpeed). With CUDA, the device is set from $LOCAL_RANK first.
    `auto_mpi_discovery` and `config` are accepted for compatibility and not used.
    """
    if dist_init_required is False or is_initialized():
        return
    if not _dist.is_available():
        raise RuntimeError("init_distributed: this torch build has no torch.distributed")
    backend = dist_backend or default_backend()
    if backend not in DIST_BACKENDS:
        raise ValueError(f"init_distributed: dist_backend={backend!r} is not a torch.distributed "
                         f"backend; allowed: {', '.join(DIST_BACKENDS)}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("init_distributed: dist_backend='nccl' needs CUDA, which this machine "
                         "(or torch build) lacks; use 'gloo'")
    rank = rank if rank >= 0 else _env_int("RANK", 0)
    world_size = world_size if world_size > 0 else env_world_size()
    if not 0 <= rank < world_size:
        raise ValueError(f"init_distributed: rank {rank} is outside the world of {world_size} "
                         "(from the arguments or $RANK/$WORLD_SIZE)")
    local_rank = _env_int("LOCAL_RANK", 0)
    if torch.cuda.is_available():
        # Before any CUDA work, so that each rank opens its context on its own GPU.
        torch.cuda.set_device(local_rank)
    if world_size == 1 and init_method is None:
        _dist.init_process_group(backend, store=_dist.HashStore(), rank=0, world_size=1,
                                 timeout=timeout)
    else:
        if init_method is None:
            missing = [k for k in ("MASTER_ADDR",) if k not in os.environ]
            if missing:
                raise RuntimeError(f"init_distributed: WORLD_SIZE={world_size} but "
                                   f"{', '.join(missing)} is not set; launch with torchrun (or "
                                   "the deepspeed launcher), or pass init_method=")
            os.environ.setdefault("MASTER_PORT", str(distributed_port))
            init_method = "env://"
        _dist.init_process_group(backend, init_method=init_method, rank=rank,
                                 world_size=world_size, timeout=timeout)
    if verbose:
        log.info("initialized torch.distributed: backend %s, rank %d of %d", backend, rank,
                 world_size)


def _require_group_if_launched(what: str) -> bool:
    """True when a group exists; False in a lone process; an error for an unjoined rank."""
    if is_initialized():
        return True
    if env_world_size() > 1:
        raise RuntimeError(f"zenflow.compat.deepspeed.comm.{what}: WORLD_SIZE={env_world_size()} but "
                           "torch.distributed is not initialized; call "
                           "zenflow.init_distributed() (or zenflow.initialize) first")
    return False


def get_rank(group=None) -> int:
    return _dist.get_rank(group) if _require_group_if_launched("get_rank") else 0


def get_world_size(group=None) -> int:
    return _dist.get_world_size(group) if _require_group_if_launched("get_world_size") else 1


def get_local_rank() -> int:
    return _env_int("LOCAL_RANK", 0)


def get_global_rank(group=None, group_rank: int = 0) -> int:
    if not _require_group_if_launched("get_global_rank"):
        return group_rank
    return _dist.get_global_rank(group, group_rank) if group is not None else group_rank


# Barriers of the default group made through this module so far, the one in progress included
# once it returns: the same count on every rank, since every rank makes the same barriers.
barriers_passed = 0
# Who is told that this rank waits in a barrier: functions taking the barrier's name
# ("barrier<n>", n counting from 1) and returning a context manager held while it waits. The
# engine registers one (zenflow/engine/rank_agreement.py): a rank that reads the model while the
# others wait here knows they will not come to read, and reads at once.
barrier_watchers: list[Callable[[str], AbstractContextManager]] = []


def barrier(group=None, async_op: bool = False, device_ids=None):
    global barriers_passed
    if not _require_group_if_launched("barrier"):
        return None
    if group is not None or async_op:   # not every rank's, or no wait here: not counted
        return _dist.barrier(group=group, async_op=async_op, device_ids=device_ids)
    with ExitStack() as waiting:
        for watcher in list(barrier_watchers):
            waiting.enter_context(watcher(f"barrier{barriers_passed + 1}"))
        result = _dist.barrier(device_ids=device_ids)
    barriers_passed += 1
    return result


def all_reduce(tensor, op=None, group=None, async_op: bool = False):
    if _require_group_if_launched("all_reduce"):
        return _dist.all_reduce(tensor, op=op if op is not None else _dist.ReduceOp.SUM,
                                group=group, async_op=async_op)
    return None


def broadcast(tensor, src: int, group=None, async_op: bool = False):
    if _require_group_if_launched("broadcast"):
        return _dist.broadcast(tensor, src, group=group, async_op=async_op)
    return None


def reduce(tensor, dst: int, op=None, group=None, async_op: bool = False):
    if _require_group_if_launched("reduce"):
        return _dist.reduce(tensor, dst, op=op if op is not None else _dist.ReduceOp.SUM,
                            group=group, async_op=async_op)
    return None


def all_gather(tensor_list, tensor, group=None, async_op: bool = False):
    if _require_group_if_launched("all_gather"):
        return _dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    tensor_list[0].copy_(tensor)
    return None


def all_gather_object(object_list, obj, group=None):
    if _require_group_if_launched("all_gather_object"):
        return _dist.all_gather_object(object_list, obj, group=group)
    object_list[0] = obj
    return None


def broadcast_object_list(object_list, src: int = 0, group=None, device=None):
    if _require_group_if_launched("broadcast_object_list"):
        return _dist.broadcast_object_list(object_list, src, group=group, device=device)
    return None


def new_group(ranks=None, **kwargs):
    return _dist.new_group(ranks, **kwargs)


def get_backend(group=None) -> str | None:
    return _dist.get_backend(group) if is_initialized() else None


def destroy_process_group(group=None) -> None:
    if is_initialized():
        _dist.destroy_process_group(group)
