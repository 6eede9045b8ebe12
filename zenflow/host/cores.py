"""Which cores the training process and its host worker use: this rank's share of the node's
CPUs, split by physical core.

On a GPU server the training process needs few cores: a Python thread that queues kernels and
autograd's device thread. The host worker's AdamW is bound by memory bandwidth, which only many
cores on every socket reach. So by default the training process keeps `TRAINING_CORES` physical
cores of its rank's share and the worker takes all the others, on every socket of the share
(zenflow/host/numa.py puts each socket's part of the host state on that socket's memory). A
config that sets `pt_reserved_cores_perc` gets DeepSpeed's split instead: that fraction of the
cores for the training process. While the worker is drained (a reselection moves columns in
host memory), the training thread borrows its cores (`lent_threads`).

The functions taking `cores` (physical cores as lists of CPU ids, socket by socket) are pure; the
others read the machine (affinity, /sys topology, torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE).
"""
from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Physical cores the training process keeps by default, per rank: its Python thread and
# autograd's device thread (the backward on a GPU). A data loader with worker processes wants
# more: set pt_reserved_cores_perc then.
TRAINING_CORES = 2

SYS_CPU = "/sys/devices/system/cpu"


def _physical_cores(cpus: list[int], topology: str = SYS_CPU) -> list[list[int]]:
    """`cpus` grouped by physical core (hyperthread siblings together), socket by socket, in
    ascending order within each: consecutive cores share a socket, so a rank given a run of
    them keeps its worker's memory on one socket (zenflow/host/numa.py). Without /sys topology
    every CPU counts as its own core."""
    groups: dict[tuple, list[int]] = {}
    for cpu in cpus:
        base = f"{topology}/cpu{cpu}/topology"
        try:
            with open(f"{base}/physical_package_id") as f:
                package = int(f.read())
            with open(f"{base}/core_id") as f:
                core = int(f.read())
            key = (package, core)
        except (OSError, ValueError):
            key = (0, -1 - cpu)
        groups.setdefault(key, []).append(cpu)
    return [sorted(g) for _, g in sorted(groups.items(), key=lambda kv: (kv[0][0], min(kv[1])))]


def _flat(cores: list[list[int]]) -> list[int]:
    return [cpu for core in cores for cpu in core]


def split(cores: list[list[int]], reserved_perc: float | None) -> tuple[list[int], list[int]]:
    """(training cpus, worker cpus) of a rank's physical `cores` (socket by socket).

    `reserved_perc` None (the default): the training process keeps the first TRAINING_CORES
    cores and the worker the rest, on every socket. A fraction (DeepSpeed's
    pt_reserved_cores_perc, set by a config): the training process keeps ceil(fraction * n) of
    the n cores. Either way each side keeps at least one core when there are two, and
    hyperthread siblings are split only when there is a single physical core. With one CPU the
    worker shares it.
    """
    if len(_flat(cores)) <= 1:
        return _flat(cores), _flat(cores)
    if len(cores) == 1:          # one physical core with several hyperthreads
        cores = [[c] for c in cores[0]]
    n = len(cores)
    wanted = TRAINING_CORES if reserved_perc is None else math.ceil(reserved_perc * n)
    keep = min(n - 1, max(1, wanted))
    return _flat(cores[:keep]), _flat(cores[keep:])


def rank_share(cores: list[list[int]], local_rank: int, local_world: int) -> list[list[int]]:
    """Local rank `local_rank`'s share of the machine's physical `cores` (socket by socket) when
    `local_world` ranks run on it: an equal run of whole physical cores each, so ranks never
    share a core and each rank's run lies on as few sockets as it can. With fewer physical
    cores than ranks, hyperthread siblings are split; with fewer CPUs than ranks, every rank
    gets every core."""
    if local_world <= 1 or len(_flat(cores)) < local_world:
        return cores
    if len(cores) < local_world:    # fewer physical cores than ranks: split the siblings
        cores = [[c] for c in sorted(_flat(cores))]
    per_rank = len(cores) // local_world
    return cores[local_rank * per_rank:(local_rank + 1) * per_rank]


def _check_perc(reserved_perc: float | None) -> None:
    if reserved_perc is not None and not 0.0 <= reserved_perc <= 1.0:
        raise ValueError(f"pt_reserved_cores_perc must be between 0 and 1 (a fraction of the "
                         f"cores) or None (keep {TRAINING_CORES}), got {reserved_perc!r}")


def split_cores(reserved_perc: float | None, cpus: list[int] | None = None
                ) -> tuple[list[int], list[int]]:
    """(training cpus, worker cpus) from `cpus` (default: the CPUs this process may use), read
    as physical cores from /sys; see split()."""
    _check_perc(reserved_perc)
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            list(range(os.cpu_count() or 1))
    return split(_physical_cores(sorted(cpus)), reserved_perc)


def local_rank_share(cpus: list[int]) -> list[int]:
    """This process's share of `cpus` when several ranks run on one machine (torchrun sets
    LOCAL_RANK and LOCAL_WORLD_SIZE); see rank_share()."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_world <= 1:
        return cpus
    return _flat(rank_share(_physical_cores(cpus), local_rank, local_world))


@functools.cache
def _openmp() -> bool:
    """Whether torch's CPU operators run on OpenMP, whose team a thread count can resize at any
    time (torch's native pool warns and keeps its size once parallel work has started)."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


@contextmanager
def lent_threads(cores: list[int] | None) -> Iterator[int]:
    """Run the block on the process's torch threads plus one for each of `cores` (the worker's,
    idle while the host is drained: a reselection's column moves, a state's copies in host
    memory), at most one per CPU this process may use; then on as many as before. Yields the
    count. The count is the process's: another thread's CPU operators meanwhile (the copy thread's,
    idle while drained) may take the lent cores too. Under torch's native thread pool (not
    OpenMP) nothing is lent."""
    before = torch.get_num_threads()
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    wanted = min(allowed, before + len(cores or ()))
    if wanted <= before or not _openmp():
        yield before
        return
    torch.set_num_threads(wanted)
    try:
        yield wanted
    finally:
        torch.set_num_threads(before)
