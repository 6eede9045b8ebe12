"""The window's gradient sums of host-owned rows, kept on the device where memory allows.

A matrix summed here costs the bus and the host nothing per step: each step adds its gradient
rows, times the step's scale, into an fp32 buffer (bf16 with device_sum_dtype="bfloat16", which
halves its memory and its bytes over the bus) with one fused launch on the device, and only at a
window end does the sum cross to the host, once, on the copy stream, while the next steps run.
Matrices that do not fit the budget are summed on the host as before (their rows cross every step
and the worker adds them: zenflow/host/pipeline.py). Which matrices fit, and what a
deferred-credit rule keeps beside their sums, is the rule's to say (zenflow/host/credit.py).

The copy of a window's sums reads the buffers the next window adds into: the first add of the
next window waits for it (on CUDA the compute stream waits on the copy's event, the Python
thread never does; on a CPU "device" the training thread waits for the copy thread).
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch

from zenflow.host.buffers import add_scaled_
from zenflow.host.transfers import DONE, Ticket, Transfers

_CHUNK_ELEMENTS = 1 << 26   # matrices per launch of the add: at most 256 MiB of fp32 sums


def sum_dtype(setting: str, weights: list[torch.dtype]) -> torch.dtype:
    """device_sum_dtype as a dtype: "auto" is bf16 where every matrix is bf16 (its gradients are
    bf16 already), else fp32."""
    if setting == "auto":
        bf16 = bool(weights) and all(dtype == torch.bfloat16 for dtype in weights)
        return torch.bfloat16 if bf16 else torch.float32
    return getattr(torch, setting)


def picker(positions: list[int]) -> Callable[[Sequence], Sequence]:
    """A function taking a sequence to its items at `positions` (a tuple) in one C-level call:
    operator.itemgetter, no Python bytecode per item."""
    if not positions:
        return lambda items: ()
    if len(positions) == 1:
        return lambda items, at=positions[0]: (items[at],)
    return operator.itemgetter(*positions)


def launch_runs(items: list, numel, limit: int):
    """`items` in runs whose numel(item) add up to at most `limit` (at least one item each): the
    tensors of one multi-tensor launch, so that its temporaries stay bounded."""
    run, size = [], 0
    for item in items:
        if run and size + numel(item) > limit:
            yield run
            run, size = [], 0
        run.append(item)
        size += numel(item)
    if run:
        yield run


class DeviceSums:
    """Sums on the device of this rank's rows of some host-owned matrices, each in its dtype
    (fp32, or bf16 to halve their memory and bus bytes)."""

    def __init__(self, transfers: Transfers, dtype: torch.dtype = torch.float32):
        self.transfers = transfers
        self.dtype = dtype   # device_sum_dtype: what the sums are kept in unless told otherwise
        self.sums: dict[int, torch.Tensor] = {}   # host index -> [rows, cols] on the device
        # alike small matrices back to back on the host (HostLayout.back_to_back): their fp32
        # sums are the slots of one [n, rows, cols] tensor, copied out in one copy
        self._blocks: list[tuple[list[int], torch.Tensor]] = []
        self._copied: Ticket = DONE               # the last copy of the sums to the host
        self.version = 0                          # allocations so far (which matrices are here)
        self._runs: dict[tuple[int, ...], list] = {}   # add()'s launch runs, by matrices

    def allocate(self, shapes: dict[int, tuple[int, int]], device: torch.device,
                 fp32: set[int] = frozenset(), runs: list[list[int]] = ()) -> None:
        """A zeroed sum for each matrix (index -> (rows, cols)); those in `fp32` are fp32
        whatever `dtype` is (a deferred-credit rule that reads them on the device wants them
        so). `runs`: alike matrices back to back on the host, whose fp32 sums share a block."""
        def dtype_of(i: int) -> torch.dtype:
            return torch.float32 if i in fp32 else self.dtype
        self.sums, self._blocks = {}, []
        self.version += 1
        for run in runs:
            if len(run) > 1 and all(dtype_of(i) == torch.float32 for i in run):
                block = torch.zeros(len(run), *shapes[run[0]], device=device)
                self._blocks.append((list(run), block))
                self.sums.update(zip(run, block.unbind(0)))
        self.sums.update((i, torch.zeros(shape, device=device, dtype=dtype_of(i)))
                         for i, shape in shapes.items() if i not in self.sums)

    def __contains__(self, i: int) -> bool:
        return i in self.sums

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.sums.values())

    def add(self, rows: dict[int, torch.Tensor], fresh: list[int], coef: torch.Tensor) -> None:
        """sum[i] += coef * rows[i] in fp32, rounded to a bf16 sum's dtype (= for the `fresh`
        ones: the window's first gradient), in a few launches per chunk on the device. `coef` is
        the step's 0-dim factor, 0 on a skipped step, whose gradients may hold inf or NaN: those
        spoil the sums, and the optimizer drops the window they are in when it ends
        (docs/semantics.md, "Skipped steps"), so the step pays no pass to keep them out."""
        if not rows:
            return
        self.fence()
        if fresh:
            torch._foreach_zero_(list(picker(fresh)(self.sums)))
        key = tuple(rows)   # (the runs are kept per list of matrices: the same every step)
        picks = self._runs.get(key)
        if picks is None:
            if len(self._runs) >= 8:
                self._runs.clear()
            picks = self._runs[key] = [picker(run) for run in launch_runs(
                list(rows), lambda i: rows[i].numel(), _CHUNK_ELEMENTS)]
        for pick in picks:
            add_scaled_(list(pick(self.sums)), list(pick(rows)), coef)

    def fence(self) -> None:
        """Later device work on the sums waits until the last window's sums have left them."""
        self.transfers.fence(self._copied)

    def clear(self) -> None:
        """Zero every sum (a window with a skipped step: they may hold inf or NaN, and the
        window counts for nothing)."""
        self.fence()
        if self.sums:
            torch._foreach_zero_(list(self.sums.values()))

    def copy_out(self, matrices: list[int], target, span,
                 also: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> tuple[Ticket, int]:
        """Queue the copy of sum[i] into the host buffer target(i) for each of `matrices`, in
        the sum's own dtype (buffers.landing_of), a block's at once into span(first, last) (its
        members' fp32 sums back to back: HostState.span), and of the (host, device) pairs `also` (a credit
        rule's own sums); returns its Ticket (the host may read the targets once it is done)
        and the bytes it moves."""
        wanted, pairs = set(matrices), []
        for members, block in self._blocks:
            if wanted.issuperset(members):
                pairs.append((span(members[0], members[-1]), block.view(-1)))
                wanted.difference_update(members)
        pairs += [(target(i), self.sums[i]) for i in matrices if i in wanted] + list(also)
        if not pairs:
            return DONE, 0
        self._copied = self.transfers.to_host(pairs)
        return self._copied, sum(src.numel() * src.element_size() for _, src in pairs)

    def wait_copied(self) -> float:
        """Block until the last copy out has landed (before reading or overwriting the sums
        from the Python thread: saving or loading a state)."""
        return self._copied.wait()
