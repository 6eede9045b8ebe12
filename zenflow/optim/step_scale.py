"""The step's scale and whether it is kept (docs/semantics.md, "Clipping" and "Skips").

`step_scale` computes, as device tensors, what a step multiplies its gradients by (1 / the loss
scale times the clipping factor) and whether it is kept: a step whose gradients are not finite, or
in which GradScaler found inf or NaN, changes no state. `Skips` reads those flags: a step strictly
inside a window reads nothing back from the device (its flag travels to every kernel) and is
settled at the window's end in one read with the others; a window with a skipped step is dropped.
A window's first step (and a warm-up step) reads its flag at once, since selecting columns needs
finite gradients: a skip found there is undone entirely, as if step() had not been called.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from zenflow.host.device_sums import picker
from zenflow.host.transfers import STACK_ELEMENTS

log = logging.getLogger("zenflow")


class NormRun(NamedTuple):
    """Positions of gradients whose norms are taken together (`alike_runs`)."""
    positions: list[int]
    pick: Callable[[Sequence], Sequence]   # the gradients at `positions`, in one C-level call
    index: torch.Tensor                    # `positions` as a CPU index
    stacked: bool                          # alike small ones, stacked: one norm per row


def alike_runs(shapes: list[tuple]) -> list[NormRun]:
    """How a CPU takes the norms of gradients of `shapes` ((shape, dtype) each): the alike
    small ones stacked, a run per shape and dtype, and the rest in one multi-tensor call. Kept
    per set of gradients (zenflow/optim/step_plan.py)."""
    alike: dict[tuple, list[int]] = {}
    for j, key in enumerate(shapes):
        alike.setdefault(key, []).append(j)
    runs, rest = [], []
    for (shape, _), positions in alike.items():
        if len(positions) > 1 and math.prod(shape) <= STACK_ELEMENTS:
            runs.append(NormRun(positions, picker(positions), torch.tensor(positions), True))
        else:
            rest += positions
    if rest:
        rest.sort()
        runs.append(NormRun(rest, picker(rest), torch.tensor(rest), False))
    return runs


def gradient_norms(grads: Sequence[torch.Tensor], alike: list[NormRun] | None = None
                   ) -> torch.Tensor:
    """The L2 norm of each gradient, as one fp32 vector (computed in fp32 for any dtype), in one
    multi-tensor launch per device and dtype. On a CPU, where a multi-tensor call is a loop over
    its tensors, alike small gradients (an MoE's experts) are stacked and take one norm per row
    instead: the same values bit for bit (a test holds it), 4x faster at 5,000 matrices.
    `alike`: alike_runs() of the gradients' shapes, where the caller keeps it."""
    if not grads:
        return torch.zeros(0, dtype=torch.float32)
    if grads[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(list(grads), 2, dtype=torch.float32))
    if alike is None:
        alike = alike_runs([(tuple(g.shape), g.dtype) for g in grads])
    parts = []   # (run, its norms)
    for run in alike:
        if run.stacked:
            rows = torch.stack(run.pick(grads)).view(len(run.positions), -1)
            parts.append((run, torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32)))
        else:
            parts.append((run, torch.stack(torch._foreach_norm(list(run.pick(grads)), 2,
                                                               dtype=torch.float32))))
    if len(parts) == 1:   # (positions 0..n-1, in order)
        return parts[0][1]
    norms = torch.empty(len(grads), dtype=torch.float32)
    for run, values in parts:
        norms.index_copy_(0, run.index, values)
    return norms


@dataclass
class StepScale:
    """What a step multiplies its gradients by, and whether it is kept, as 0-dim fp32 tensors on
    the device, computed without reading anything back: every kernel of the step takes them, so
    the Python thread launches the step without waiting for the backward to finish."""
    coef: torch.Tensor       # 1 / grad_scale times the clipping factor; 0 on a skipped step
    kept: torch.Tensor       # 1.0, or 0.0 when the step is skipped
    skip: torch.Tensor       # 1.0 - kept: the skip flag in the form the fused AdamW kernel takes
    overflow: torch.Tensor   # GradScaler's found_inf (0.0 without a scaler)
    loss_scale: torch.Tensor  # GradScaler's scale (1.0 without a scaler)

    def flags(self) -> torch.Tensor:
        """[kept, overflow, loss scale], to read together with other steps' (`read_flags`)."""
        return torch.stack([self.kept, self.overflow, self.loss_scale])


def read_flags(scales: list[StepScale]) -> list[tuple[bool, bool, float]]:
    """(kept, GradScaler overflow, loss scale) of each step, in one read of the device."""
    if not scales:
        return []
    rows = torch.stack([s.flags() for s in scales]).tolist()
    return [(kept > 0, overflow > 0, scale) for kept, overflow, scale in rows]


def _scalar(value, device: torch.device, default: float) -> torch.Tensor:
    """`value` (a tensor, a number or None for `default`) as a 0-dim fp32 tensor on `device`,
    made with a device kernel: a number is filled in, never copied from host memory."""
    if isinstance(value, torch.Tensor):
        return value.to(device, torch.float32).reshape(())
    return torch.full((), float(default if value is None else value), dtype=torch.float32,
                      device=device)


def step_scale(norms: torch.Tensor, max_grad_norm: float | None,
               grad_scale: float | torch.Tensor | None = None,
               found_inf: torch.Tensor | None = None, partition=None) -> StepScale:
    """The step's `StepScale`: 1 / grad_scale (a loss scale still in the gradients) times what
    clip_grad_norm_ would scale the unscaled gradients by; the step is skipped when GradScaler
    found inf/NaN (`found_inf`) or the global gradient norm is not finite.

    Where each rank holds only some rows of every gradient (FSDP2: `partition.shards_gradients`),
    `norms` are the local shards' norms: one all-reduce sums their squares (and GradScaler's
    flags) across ranks, so every rank clips by the same global norm and skips the same steps."""
    total = torch.linalg.vector_norm(norms)
    device = total.device
    overflow = _scalar(found_inf if isinstance(found_inf, torch.Tensor) else None, device, 0.0)
    if partition is not None and partition.shards_gradients:
        summed = partition.sum_(torch.stack([total.square(), overflow]),
                                "summing the squared gradient norms")
        total, overflow = summed[0].sqrt(), summed[1]
    loss_scale = _scalar(grad_scale, device, 1.0)
    factor = 1.0 / loss_scale
    if max_grad_norm is not None:
        # The same fp32 tensor arithmetic as torch.nn.utils.clip_grad_norm_, so results match it.
        factor = torch.clamp(max_grad_norm / (total / loss_scale + 1e-6), max=1.0) / loss_scale
    kept = torch.isfinite(total) & (overflow == 0)
    coef = torch.where(kept, factor, torch.zeros_like(total))
    kept = kept.float()
    return StepScale(coef, kept, 1.0 - kept, overflow, loss_scale)


class Skips:
    """The kept flags of a window's steps not read yet, and the count and log of skips.
    `counters` is the optimizer's StepCounters (skipped_steps is saved with them)."""

    def __init__(self, counters, owner: str):
        self.counters, self.owner = counters, owner
        self._unsettled: list[tuple[int, StepScale]] = []
        self._consecutive = 0
        self._dropped_in_a_row = 0   # windows ended dropped, one after the other

    def read_now(self, step: int, scale: StepScale) -> bool:
        """Read step `step`'s flag now (one read); whether it is kept. A skip is counted, but
        not as a step of its window: the caller undoes the step."""
        (kept, overflow, loss_scale), = read_flags([scale])
        if kept:
            self._consecutive = 0
        else:
            self._count(step, overflow, loss_scale, counted=False)
        return kept

    def defer(self, step: int, scale: StepScale) -> None:
        """A step inside a window: its flag is read at settle()."""
        self._unsettled.append((step, scale))

    def settle(self) -> bool:
        """Read the flags deferred so far, in one read: count and log the skipped steps.
        Returns whether any was skipped (its window is then spoiled: dropped at its end)."""
        unsettled, self._unsettled = self._unsettled, []
        flags = read_flags([scale for _, scale in unsettled])
        for (step, _), (kept, overflow, loss_scale) in zip(unsettled, flags):
            if kept:
                self._consecutive = 0
            else:
                self._count(step, overflow, loss_scale, counted=True)
        return not all(kept for kept, _, _ in flags)

    def window_ended(self, dropped: bool) -> None:
        """A window ended, `dropped` for a skipped step in it. Windows dropped one after the other
        mean the deferred columns are not training at all (GradScaler's overflows, say, one in
        every window), which the steps' own messages (INFO for an overflow) do not say: a
        WARNING does, at 2, 4, 8, ... in a row."""
        self._dropped_in_a_row = self._dropped_in_a_row + 1 if dropped else 0
        n = self._dropped_in_a_row
        if n >= 2 and n & (n - 1) == 0:
            log.warning("%s: %d windows in a row were dropped for a skipped step in each: the "
                        "columns the host updates have not trained since. Steps overflow too "
                        "often for the window (a loss scale that never settles, or non-finite "
                        "gradients); shorter windows (update_interval) or a lower initial loss "
                        "scale keep some windows whole", self.owner, n)

    def forget(self) -> None:
        """The window's steps so far are replaced (a state was loaded)."""
        self._unsettled = []

    def _count(self, step: int, amp_overflow: bool, loss_scale: float, counted: bool) -> None:
        """Count and log the skip of step `step`; `counted`: it was a step of its window (one
        inside a window, found at the window's end), not undone."""
        self.counters.skipped_steps += 1
        self._consecutive += 1
        n = self._consecutive
        what = "skipped, and its window's deferred gradients dropped" if counted else "skipped"
        if amp_overflow:
            # Ordinary mixed-precision life: GradScaler found inf/NaN at this scale and lowers it.
            # DeepSpeed logs these at INFO with the new scale; so do we.
            log.info("%s: gradient overflow at loss scale %g: step %d %s; GradScaler lowers "
                     "the scale (to %g with its default backoff_factor 0.5)", self.owner,
                     loss_scale, step, what, loss_scale * 0.5)
        elif n & (n - 1) == 0:   # 1, 2, 4, 8, ...: loud at first, then rate-limited
            log.warning("%s: step %d %s: the gradients are not finite (%d consecutive "
                        "skipped steps, %d in all)", self.owner, step, what, n,
                        self.counters.skipped_steps)
