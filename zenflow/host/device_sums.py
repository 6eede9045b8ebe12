"""The window's gradient sums of host-owned rows, kept on the device where memory allows.

A matrix summed here costs the bus and the host nothing per step: each step adds its gradient
rows, times the step's scale, into an fp32 buffer (bf16 with device_sum_dtype="bfloat16", which
halves its memory and its bytes over the bus) with one fused launch on the device, and only at a
window end does the sum cross to the host, once, on the copy stream, while the next steps run.
Matrices that do not fit the budget are summed on the host as before (their rows cross every step
and the worker adds them: zenflow/host/pipeline.py).

The copy of a window's sums reads the buffers the next window adds into: the first add of the
next window waits for it (on CUDA the compute stream waits on the copy's event, the Python
thread never does; on a CPU "device" the training thread waits for the copy thread).

With deferred_credit="moments" (docs/semantics.md) a summed matrix also keeps the sum of its
gradients' squares, which the host's moments need, and the AdamW rate per value of the host's
last installed update, 1 / (sqrt(v_hat) + eps), in the rates' dtype: each step moves the
deferred columns by -lr * g * rate (`move`), and an install lowers the host's values by
lr * sum * rate, a momentum-free step for each gradient of the window the host has not applied
(`correct`). All of it is device work in a few fused launches.
"""
from __future__ import annotations

import torch

from zenflow.host.buffers import add_scaled_
from zenflow.host.transfers import DONE, Ticket, Transfers


def takes_moments(credit: str, budget: int | str, cuda: bool, splits_rows: bool) -> bool:
    """Whether deferred_credit `credit` can put any matrix under "moments": not under data
    parallel, where each rank sums only its rows and every replica must move alike (the interim
    steps would need every rank's sums and rates), nor where no sum can be on the device (a
    budget of 0; "auto" on a CPU "device", which has none to spare)."""
    return (credit == "moments" and not splits_rows and budget != 0
            and not (budget == "auto" and not cuda))


def choose_device_summed(numels: list[int], budget_bytes: int,
                         bytes_per_element: int = 4) -> list[int]:
    """The matrices (indices into `numels`, this rank's element counts) whose sums
    (`bytes_per_element`: 4 for the fp32 sum, more with the squares and rates) fit
    `budget_bytes`, taken in order: every matrix saves the same bus bytes per byte of device
    memory, so the order does not matter and the split is easy to predict."""
    chosen, used = [], 0
    for i, numel in enumerate(numels):
        if numel and used + bytes_per_element * numel <= budget_bytes:
            chosen.append(i)
            used += bytes_per_element * numel
    return chosen


def choose_placement(numels: list[int], budget_bytes: int, moments_bytes: int = 0,
                     sum_bytes: int = 4) -> tuple[list[int], list[int]]:
    """(summed, moving): the matrices whose sums (`sum_bytes` per element: 4 for fp32, 2 for
    bf16) fit `budget_bytes`, and of those, with what is left, the ones that also fit
    `moments_bytes` per element more (the squares and rates of deferred_credit "moments"; 0:
    none), and an fp32 sum (a "moments" matrix's sum is fp32). Every sum first: a matrix summed
    on the device saves the bus and the host a copy of its gradient every step, which a tight
    device cannot afford to trade for better windows."""
    summed = choose_device_summed(numels, budget_bytes, sum_bytes)
    if not moments_bytes:
        return summed, []
    spare = budget_bytes - sum_bytes * sum(numels[i] for i in summed)
    chosen = set(summed)
    moving = choose_device_summed([n if i in chosen else 0 for i, n in enumerate(numels)],
                                  spare, moments_bytes + 4 - sum_bytes)
    return summed, moving


_CHUNK_ELEMENTS = 1 << 26   # the temporaries of one launch of move() and correct(): 256 MiB fp32


def _chunks(indices: list[int], tensors: dict[int, torch.Tensor]):
    """`indices` in runs of at most _CHUNK_ELEMENTS elements (at least one matrix each)."""
    run, size = [], 0
    for i in indices:
        if run and size + tensors[i].numel() > _CHUNK_ELEMENTS:
            yield run
            run, size = [], 0
        run.append(i)
        size += tensors[i].numel()
    if run:
        yield run


def _kept(grads: list[torch.Tensor], coef: torch.Tensor) -> list[torch.Tensor]:
    """`grads` where the step's factor `coef` (0-dim, on their device) is not 0, else zeros, in
    fp32 (the interim step's arithmetic, as the reference's: products of bf16 gradients and
    rates rounded to bf16 put a bf16 model's weights 2 ulps off it in a few steps). The interim
    step writes the weights, so a skipped step (coef 0), whose gradients may hold inf or NaN (and
    0 times those is NaN), must move them by exactly nothing; a kept step's gradients are finite
    and pass unchanged."""
    keep = coef != 0
    return [torch.where(keep, g, 0.0).float() for g in grads]


def _bounded_step(weights: list[torch.Tensor], steps: list[torch.Tensor], bound: float,
                  lr: float) -> None:
    """weights -= lr * clamp(steps, -bound, bound), in fp32 (the fp32 steps promote the add) and
    rounded once to the weights' dtype; `steps` is overwritten."""
    torch._foreach_clamp_min_(steps, -bound)
    torch._foreach_clamp_max_(steps, bound)
    torch._foreach_add_(weights, steps, alpha=-lr)


class DeviceSums:
    """Sums on the device of this rank's rows of some host-owned matrices: in `dtype` (fp32, or
    bf16 to halve their memory and bus bytes), fp32 under "moments"."""

    def __init__(self, transfers: Transfers, dtype: torch.dtype = torch.float32):
        self.transfers = transfers
        self.dtype = dtype
        self.sums: dict[int, torch.Tensor] = {}   # host index -> [rows, cols] on the device
        self.squares: dict[int, torch.Tensor] = {}   # "moments": the sums of squares, fp32
        self.rates: dict[int, torch.Tensor] = {}     # "moments": the host's last rates
        self._copied: Ticket = DONE              # the last copy of the sums to the host

    def allocate(self, shapes: dict[int, tuple[int, int, torch.dtype | None]],
                 device: torch.device) -> None:
        """A zeroed sum for each matrix (index -> (rows, cols, rates' dtype)); with a rates'
        dtype (deferred_credit="moments") also its squares and rates."""
        self.sums = {i: torch.zeros(shape[:2], device=device,
                                    dtype=self.dtype if shape[2] is None else torch.float32)
                     for i, shape in shapes.items()}
        moving = {i: shape for i, shape in shapes.items() if shape[2] is not None}
        self.squares = {i: torch.zeros(shape[:2], dtype=torch.float32, device=device)
                        for i, shape in moving.items()}
        self.rates = {i: torch.zeros(shape[:2], dtype=shape[2], device=device)
                      for i, shape in moving.items()}

    def __contains__(self, i: int) -> bool:
        return i in self.sums

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for part in (self.sums, self.squares, self.rates) for t in part.values())

    def add(self, rows: dict[int, torch.Tensor], fresh: list[int], coef: torch.Tensor) -> None:
        """sum[i] += coef * rows[i] in fp32, rounded to a bf16 sum's dtype (= for the `fresh`
        ones: the window's first gradient), the squares likewise, in a few fused launches per
        chunk on the device. `coef` is the step's 0-dim factor, 0 on a skipped step, whose
        gradients may hold inf or NaN: those spoil the sums, and the optimizer drops the window
        they are in when it ends (docs/semantics.md, "Skipped steps"), so the step pays no pass
        to keep them out."""
        if not rows:
            return
        self.transfers.fence(self._copied)   # the last window's sums have left these buffers
        if fresh:
            torch._foreach_zero_([self.sums[i] for i in fresh]
                                 + [self.squares[i] for i in fresh if i in self.squares])
        for chunk in _chunks(list(rows), rows):
            grads = [rows[i] for i in chunk]
            add_scaled_([self.sums[i] for i in chunk], grads, coef)
            squared = [i for i in chunk if i in self.squares]
            if squared:   # (coef * g)^2 from an fp32 product, as the reference sums it
                scaled = torch._foreach_mul([rows[i].float() for i in squared], coef)
                torch._foreach_addcmul_([self.squares[i] for i in squared], scaled, scaled)

    def clear(self) -> None:
        """Zero every sum and square (a window with a skipped step: they may hold inf or NaN, and
        the window counts for nothing)."""
        self.transfers.fence(self._copied)   # the last window's sums have left these buffers
        tensors = [*self.sums.values(), *self.squares.values()]
        if tensors:
            torch._foreach_zero_(tensors)

    def move(self, weights: dict[int, torch.Tensor], rows: dict[int, torch.Tensor],
             coef: torch.Tensor, steps: dict[int, tuple[float, float]]) -> None:
        """weights[i] -= lr * clamp(coef * rows[i] * rate[i], -bound, bound), (lr, bound) =
        steps[i]: the interim step of every value the device does not update itself (its own
        columns are written over afterwards). `bound` is AdamW's own bound on a step, in units
        of lr (zenflow.adamw.step_bound): it keeps a value whose rate is stale from moving further than
        AdamW could, where a row that saw no gradient for long (an embedding's rare token) has v
        near 0 and a rate near 1 / eps. On a skipped step (coef 0) the step is 0. A few fused
        launches per (lr, bound) and chunk."""
        groups: dict[tuple, list[int]] = {}
        for i in rows:
            if i in self.rates:
                groups.setdefault(steps[i], []).append(i)
        for (lr, bound), indices in groups.items():
            for chunk in _chunks(indices, rows):
                moves = torch._foreach_mul(_kept([rows[i] for i in chunk], coef),
                                           [self.rates[i] for i in chunk])
                torch._foreach_mul_(moves, coef)
                _bounded_step([weights[i] for i in chunk], moves, bound, lr)

    def correct(self, weights: dict[int, torch.Tensor], steps: dict[int, tuple[float, float]],
                counts: dict[int, int]) -> None:
        """weights[i] -= lr * clamp(sum[i] * rate[i], -counts[i] * bound, counts[i] * bound): an
        install's step for the counts[i] gradients summed since the update it installs was
        handed off (weights[i] holds the installed values), each bounded as move() bounds one."""
        groups: dict[tuple, list[int]] = {}
        for i in weights:
            groups.setdefault((*steps[i], counts[i]), []).append(i)
        for (lr, bound, count), indices in groups.items():
            for chunk in _chunks(indices, self.sums):
                moves = torch._foreach_mul([self.sums[i] for i in chunk],
                                           [self.rates[i] for i in chunk])
                _bounded_step([weights[i] for i in chunk], moves, count * bound, lr)

    def copy_out(self, targets: dict[int, torch.Tensor],
                 square_targets: dict[int, torch.Tensor] | None = None) -> Ticket:
        """Queue the copy of sum[i] into the host buffer targets[i] for each i, in the sum's own
        dtype (buffers.landing_of), and of the squares into square_targets[i]; returns its Ticket
        (the host may read the targets once it is done)."""
        pairs = [(targets[i], self.sums[i]) for i in targets]
        pairs += [(dst, self.squares[i]) for i, dst in (square_targets or {}).items()]
        if not pairs:
            return DONE
        self._copied = self.transfers.to_host(pairs)
        return self._copied

    def wait_copied(self) -> float:
        """Block until the last copy out has landed (before reading or overwriting the sums
        from the Python thread: saving or loading a state)."""
        return self._copied.wait()
