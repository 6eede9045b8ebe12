"""Which cores the training process and its host worker use: this rank's share of the node's
CPUs, split by physical core."""
from __future__ import annotations

import math
import os


def _physical_cores(cpus: list[int], topology: str = "/sys/devices/system/cpu"
                    ) -> list[list[int]]:
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


def split_cores(reserved_perc: float, cpus: list[int] | None = None) -> tuple[list[int], list[int]]:
    """(training cpus, worker cpus) from the CPUs this process may use.

    The training process keeps ceil(reserved_perc * n) cores (at least one when n > 1, at most
    n - 1 so the worker has one); the worker gets the rest. Whole physical cores go to each side
    first; hyperthread siblings are split only when there is a single physical core. With one CPU
    the worker shares it.
    """
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            list(range(os.cpu_count() or 1))
    cpus = sorted(cpus)
    if len(cpus) <= 1:
        return cpus, cpus
    cores = _physical_cores(cpus)
    if len(cores) == 1:          # one physical core with several hyperthreads
        cores = [[c] for c in cores[0]]
    n = len(cores)
    keep = min(n - 1, max(1, math.ceil(reserved_perc * n)))
    training = [c for core in cores[:keep] for c in core]
    worker = [c for core in cores[keep:] for c in core]
    return training, worker


def local_rank_share(cores: list[int]) -> list[int]:
    """This process's share of the machine's cores when several ranks run on one machine
    (torchrun sets LOCAL_RANK and LOCAL_WORLD_SIZE): ranks never share a worker core, and each
    gets whole physical cores (hyperthread siblings together), as many as the others."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_world <= 1 or len(cores) < local_world:
        return cores
    groups = _physical_cores(cores)
    if len(groups) < local_world:    # fewer physical cores than ranks: split the siblings
        groups = [[c] for c in sorted(cores)]
    per_rank = len(groups) // local_world
    return [c for g in groups[local_rank * per_rank:(local_rank + 1) * per_rank] for c in g]
