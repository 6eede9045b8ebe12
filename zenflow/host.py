"""Host side of ZenFlow: fp32 master weights, Adam moments and gradient sums of every matrix.

The host keeps each matrix at full width [out, in]. It updates all columns each window and the
optimizer installs only the columns the host owns: a device-owned column's host copy is dead
weight until the column comes back, when the device's values overwrite it. Full width costs ~10%
more host arithmetic than keeping only the unselected columns, but accumulating a gradient becomes
one streaming add instead of a column gather, which on CPU is 3x cheaper (9 ms vs 26 ms for a
4096x4096 fp32 matrix).

`HostState` is plain tensors and `HostJob`s are plain tuples, so the same object works in the
training process or in a worker process that received it with shared-memory tensors.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from zenflow.kernels import adamw_


class HostJob(NamedTuple):
    """One matrix's host update for one window (everything the worker needs, nothing else)."""
    matrix: int          # index into HostState.matrices
    step: int            # the matrix's host step count after this update
    num_grads: int       # gradients summed in the buffer; the update uses their mean
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


@dataclass
class HostMatrix:
    """Host state of one matrix parameter, every tensor fp32 and [out, in]."""
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad_sums: list[torch.Tensor]  # one buffer per slot: one fills while the other is consumed

    def tensors(self) -> list[torch.Tensor]:
        return [self.master, self.exp_avg, self.exp_avg_sq, *self.grad_sums]


class HostState:
    """All host buffers of one optimizer and the host AdamW over them."""

    def __init__(self, matrices: list[HostMatrix]):
        self.matrices = matrices

    @classmethod
    def allocate(cls, initial_values: list[torch.Tensor], num_slots: int,
                 shared: bool = False, pin: bool = False) -> "HostState":
        """Buffers for matrices starting at `initial_values` (any device/dtype, viewed [out, in])."""
        def new(shape):
            t = torch.zeros(shape, dtype=torch.float32, pin_memory=pin)
            return t.share_memory_() if shared else t

        matrices = []
        for value in initial_values:
            shape = ((value.shape[0], math.prod(value.shape[1:])) if value.ndim >= 2
                     else (1, value.numel()))
            master = new(shape)
            master.copy_(value.detach().reshape(shape))
            matrices.append(HostMatrix(master, new(shape), new(shape),
                                       [new(shape) for _ in range(num_slots)]))
        return cls(matrices)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for m in self.matrices for t in m.tensors())

    def update(self, jobs: list[HostJob], slot: int, clear: bool = True) -> None:
        """AdamW on each job's matrix with the mean of its gradient sum; then clears the sum
        (unless the caller overwrites it next time anyway).

        Jobs sharing hyperparameters, step and window length go to the fused kernel together.
        """
        groups: dict[tuple, list[HostJob]] = {}
        for job in jobs:
            groups.setdefault(job[1:], []).append(job)
        for (step, num_grads, lr, beta1, beta2, eps, weight_decay), group in groups.items():
            mats = [self.matrices[job.matrix] for job in group]
            sums = [m.grad_sums[slot] for m in mats]
            adamw_([m.master for m in mats], sums, [m.exp_avg for m in mats],
                   [m.exp_avg_sq for m in mats], step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                   weight_decay=weight_decay, grad_divisor=float(num_grads))
            if clear:
                torch._foreach_zero_(sums)


class InlineHostRunner:
    """Runs host updates in the calling process, at once. The worker runner has the same methods."""

    def __init__(self, host: HostState):
        self.host = host
        self.busy_seconds = 0.0
        self.updates: list[tuple[float, float]] = []  # (start, end) perf_counter of each update

    def ready(self) -> bool:
        """Whether no update is in flight: always, since submit() runs it to completion."""
        return True

    @property
    def last_update_seconds(self) -> float:
        # In process, nothing overlaps the update: there is no host time to hide.
        return 0.0

    def submit(self, jobs: list[HostJob], slot: int) -> None:
        start = time.perf_counter()
        self.host.update(jobs, slot)
        end = time.perf_counter()
        self.busy_seconds += end - start
        self.updates.append((start, end))

    def wait(self) -> float:
        """Block until submitted work is done; returns the seconds spent blocked."""
        return 0.0

    def check(self) -> None:
        """Raise if the runner can no longer run updates (never, in process)."""

    def close(self) -> None:
        pass
