"""The staging buffers: a step's gradient rows on their way to the host's window sums.

    put(grads, coef, ...)   copy the rows of `grads`, and the step's factor `coef`, into the
                            next staging buffer (on CUDA queued on a side stream: the Python
                            thread does not wait), once the host has read what that buffer held
    accumulate(...)         tell the host to add that buffer, times its `coef`, to the window's
                            sums, once the copy has landed (a `Ticket`, through the worker link)

A backward hook may copy a gradient into the next buffer before step() (zenflow/host/early_copies.py
asks free_staging_slot() and calls copy_to_staging()). Where copies land within the step (the
CPU), one buffer is enough: the worker adds a step's gradients during the next forward and
backward. Where they land later (CUDA: the step returns with the copy in flight, and the link's
dispatch thread sends the accumulate once it has landed), two buffers alternate, so the worker has
a whole step to add one before it is reused.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from zenflow.distributed import Partition
from zenflow.host.buffers import HostState
from zenflow.host.commands import Accumulate
from zenflow.host.device_sums import picker
from zenflow.host.transfers import DONE, Ticket, Transfers, all_of
from zenflow.host.weight_views import host_view
from zenflow.host.worker_link import Command, WorkerLink


class _CopyPlan(NamedTuple):
    """How copy_to_staging() copies the gradients of a list of matrices."""
    runs: list[list[int]]              # HostLayout.back_to_back's
    picks: list[Callable[[Sequence], Sequence]]   # each run's gradients, by position in the list
    own_rows_are_whole: bool           # each gradient is its own rows (own_rows: no view)
    nbytes: int
    staged: list[int]                  # 1 for each matrix of the list, by index, else 0


class Staging:
    """The staging buffers of a pipeline's host state, and what reads each."""

    def __init__(self, host: HostState, transfers: Transfers, link: WorkerLink,
                 partition: Partition, rows: list[slice]):
        """`rows`: this rank's rows of each matrix (the rows its host state holds)."""
        self.host, self.transfers, self.link = host, transfers, link
        self.partition, self.rows = partition, rows
        self.start_over()

    def start_over(self) -> None:
        """No buffer being read, nothing staged: the next copy goes to the first buffer."""
        self.slot = 0   # the buffer the next put() writes
        # the accumulate reading each buffer (sent, or queued until its copy lands)
        self._readers: list[Command | None] = [None] * self.host.layout.staging_slots
        self._staged: tuple[int, list[int], Ticket] | None = None
        self.last_copy: Ticket = DONE   # every copy to the host queued since the last fence
        self._plans: dict[tuple[int, ...], _CopyPlan] = {}   # by the matrices copied

    def own_rows(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """This rank's rows of matrix i's gradient as [rows, cols] (a slice is an operator a
        matrix: none when it holds them all)."""
        view, rows = host_view(grad), self.rows[i]
        return view if view.shape[0] == rows.stop - rows.start else view[rows]

    def free_staging_slot(self) -> int | None:
        """The buffer the next put() writes, or None while a host command reads it (or is queued
        to). Never blocks: a backward hook asks (zenflow/host/early_copies.py)."""
        reader = self._readers[self.slot]
        if reader is None:
            return self.slot
        try:
            return self.slot if self.link.done(reader) else None
        except RuntimeError:   # the next step() reports it (check()); a hook only skips its copy
            return None

    def copy_to_staging(self, slot: int, grads: dict[int, torch.Tensor],
                        coef: torch.Tensor | None = None) -> tuple[Ticket, int]:
        """Queue the copy of the rows of `grads` (index -> gradient) into buffer `slot`, and of
        the step's factor `coef` into the buffer's step_coef (put() does; a backward hook copies
        gradients only); returns its ticket and the bytes it moves."""
        host = self.host
        pairs = [] if coef is None else [(host.step_coef(slot), coef.reshape(()))]
        plan = self._plan(grads)
        sources = list(grads.values())
        if not plan.own_rows_are_whole:
            sources = [self.own_rows(i, grad) for i, grad in grads.items()]
        for run, pick in zip(plan.runs, plan.picks):
            if len(run) == 1:
                pairs.append((host.staging(slot, run[0]), pick(sources)[0]))
            else:   # one copy for all (a launch and a small copy each cost more)
                pairs.append((host.span(f"staging{slot}", [run[0], run[-1]])[0],
                              torch.stack(pick(sources)).view(-1)))
        return (self.transfers.to_host(pairs) if pairs else DONE), plan.nbytes

    def _plan(self, grads: dict[int, torch.Tensor]) -> _CopyPlan:
        """How the gradients of `grads`' matrices are copied, worked out at their first copy
        (the same matrices come step after step: no Python per matrix then)."""
        key = tuple(grads)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 8:
                self._plans.clear()
            runs = self.host.layout.back_to_back(list(key))
            position = {i: j for j, i in enumerate(key)}
            rows = {i: self.own_rows(i, grad) for i, grad in grads.items()}
            plan = self._plans[key] = _CopyPlan(
                runs, [picker([position[i] for i in run]) for run in runs],
                all(rows[i] is grad for i, grad in grads.items()),
                sum(r.numel() * r.element_size() for r in rows.values()),
                counted_once(key, len(self.rows)))
        return plan

    def put(self, grads: dict[int, torch.Tensor], coef: torch.Tensor, early: set[int],
            early_copies: Ticket) -> tuple[int, float]:
        """Stage `grads` (index -> gradient) and `coef` into the next buffer, once the host has
        read it; those of `early` are there already (copied in backward: `early_copies`, which
        the host's read waits for too). Returns the bytes copied and the seconds waited."""
        self.last_copy = early_copies
        if not grads:
            return 0, 0.0
        slot, waited = self.slot, 0.0
        reader = self._readers[slot]
        if reader is not None:   # the previous accumulate of this buffer, sent or still queued
            waited = self.link.wait(reader)
            self._readers[slot] = None
        ticket, nbytes = self.copy_to_staging(
            slot, {i: g for i, g in grads.items() if i not in early} if early else grads, coef)
        self.last_copy = ticket = all_of(self.last_copy, ticket)
        self._staged = (slot, list(grads), ticket)
        return nbytes, waited

    def accumulate(self, num_grads: list[int], sum_slot: int) -> None:
        """Have the host add what put() staged, times its coef, into the sums of slot
        `sum_slot` (overwriting those of the matrices with no gradient yet in `num_grads`, the
        window's count of each, which this counts on)."""
        if self._staged is None:
            return
        slot, matrices, ticket = self._staged
        self._staged = None
        if not matrices:
            return
        fresh = first_gradients(matrices, num_grads)
        added = (matrices if not fresh else [] if len(fresh) == len(matrices)
                 else [i for i in matrices if num_grads[i] > 0])
        plan = self._plans.get(tuple(matrices))
        if plan is not None:
            num_grads[:] = map(operator.add, num_grads, plan.staged)
        else:
            for i in matrices:
                num_grads[i] += 1
        self._readers[slot] = self.link.submit(
            ticket, Accumulate(slot, sum_slot, tuple(added), tuple(fresh)))
        self.slot = (slot + 1) % len(self._readers)


def counted_once(matrices: Sequence[int], size: int) -> list[int]:
    """1 for each of `matrices`, 0 for the others of `size`: what a step adds to the window's
    counts (num_grads[:] = map(operator.add, num_grads, this), in one C-level pass)."""
    counts = [0] * size
    for i in matrices:
        counts[i] = 1
    return counts


def first_gradients(matrices: list[int], num_grads: list[int]) -> list[int]:
    """Those of `matrices` with no gradient in the window yet (`num_grads`, the window's count
    of each): C-level passes in the common cases, none of them (inside a window) or all (its
    first step)."""
    counts = picker(matrices)(num_grads)
    if 0 not in counts:
        return []
    if counts.count(0) == len(counts):
        return matrices
    return [i for i, n in zip(matrices, counts) if n == 0]
