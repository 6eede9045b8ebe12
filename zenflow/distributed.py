"""Data parallel ZenFlow on torch.distributed: which host rows a rank owns, and the few collectives.

Every rank holds the same (averaged) gradients, so the device side, which updates the selected
columns and the vectors, computes the same result everywhere with no communication. The host
side is partitioned ZeRO-2 style: each rank's host (and worker) holds the master values, moments
and gradient sums of only its share of each matrix's *rows*. The host AdamW is element-wise, so
rows are as good a unit of ownership as columns, and a row range of a row-major matrix is one
contiguous block (no gathers). After a host update, the ranks all-gather the updated rows.

Selection needs the column norms of the whole matrix. Each rank computes them over its own rows
and the ranks sum the squares: one number per column crosses the network, never a gradient.

A collective that fails (a rank died, the network broke) raises a RuntimeError that says so;
the process group's timeout bounds how long a lost peer can make the others wait.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Partition:
    """This rank's place in the process group (a single process is rank 0 of 1), and the bytes
    its collectives have sent, by purpose."""
    rank: int = 0
    world_size: int = 1
    group: object = None
    bytes_sent: dict = field(default_factory=dict)

    @classmethod
    def from_group(cls, group=None) -> "Partition":
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def rows(self, num_rows: int) -> slice:
        """This rank's rows of a matrix with `num_rows` rows: equal contiguous blocks."""
        per_rank = math.ceil(num_rows / self.world_size)
        start = min(num_rows, self.rank * per_rank)
        return slice(start, min(num_rows, start + per_rank))

    def rows_per_rank(self, num_rows: int) -> int:
        return math.ceil(num_rows / self.world_size)

    # -- collectives --------------------------------------------------------------------------
    def _count(self, what: str, tensor: torch.Tensor) -> None:
        self.bytes_sent[what] = (self.bytes_sent.get(what, 0) +
                                 tensor.numel() * tensor.element_size())

    def _run(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # gloo/nccl raise RuntimeError or DistBackendError
            raise RuntimeError(
                f"ZenFlowAdamW: {what} across {self.world_size} ranks failed on rank {self.rank} "
                f"({type(exc).__name__}: {exc}); another rank may have died or stopped "
                "stepping in lockstep") from exc

    def sum_(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """All-reduce (sum) in place; a no-op on one rank."""
        if self.active:
            self._count(what, tensor)
            self._run(what, dist.all_reduce, tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def any(self, flag: bool, what: str) -> bool:
        """True on every rank if it is true on any rank (decisions all ranks must share)."""
        if not self.active:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        self._count(what, t)
        self._run(what, dist.all_reduce, t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def gather_objects(self, obj, what: str) -> list:
        """Every rank's picklable `obj`, in rank order."""
        if not self.active:
            return [obj]
        out = [None] * self.world_size
        self._run(what, dist.all_gather_object, out, obj, group=self.group)
        return out

    def barrier(self, what: str) -> None:
        if self.active:
            self._run(what, dist.barrier, group=self.group)

    def gather_rows(self, own_rows: torch.Tensor, num_rows: int, what: str) -> torch.Tensor:
        """Every rank's row block of a [num_rows, n] matrix, concatenated: [num_rows, n]."""
        if not self.active:
            return own_rows
        per_rank = self.rows_per_rank(num_rows)
        padded = own_rows.new_zeros((per_rank, *own_rows.shape[1:]))
        padded[: own_rows.shape[0]] = own_rows
        out = own_rows.new_empty((per_rank * self.world_size, *own_rows.shape[1:]))
        self._count(what, padded)
        # all_gather_single is the newer name (torch >= 2.13) of all_gather_into_tensor.
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._run(what, all_gather, out, padded, group=self.group)
        return out[:num_rows]


def local_rank_share(cores: list[int]) -> list[int]:
    """This process's share of the machine's cores when several ranks run on one machine
    (torchrun sets LOCAL_RANK and LOCAL_WORLD_SIZE): ranks never share a worker core."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_world <= 1 or len(cores) < local_world:
        return cores
    per_rank = len(cores) // local_world
    return cores[local_rank * per_rank:(local_rank + 1) * per_rank]
