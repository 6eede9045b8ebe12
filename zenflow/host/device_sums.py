"""The window's gradient sums of host-owned rows, kept on the device where memory allows.

A matrix summed here costs the bus and the host nothing per step: each step adds its gradient
rows, times the step's scale, into an fp32 buffer with one fused launch on the device, and only
at a window end does the sum cross to the host, once, on the copy stream, while the next steps
run. Matrices that do not fit the budget are summed on the host as before (their rows cross
every step and the worker adds them: zenflow/host/pipeline.py).

The copy of a window's sums reads the buffers the next window adds into: the first add of the
next window waits for it (on CUDA the compute stream waits on the copy's event, the Python
thread never does; on a CPU "device" the training thread waits for the copy thread).
"""
from __future__ import annotations

import torch

from zenflow.host.transfers import DONE, Ticket, Transfers


def choose_device_summed(numels: list[int], budget_bytes: int) -> list[int]:
    """The matrices (indices into `numels`, this rank's element counts) whose fp32 sums fit
    `budget_bytes`, taken in order: every matrix saves the same bus bytes per byte of device
    memory, so the order does not matter and the split is easy to predict."""
    chosen, used = [], 0
    for i, numel in enumerate(numels):
        if numel and used + 4 * numel <= budget_bytes:
            chosen.append(i)
            used += 4 * numel
    return chosen


class DeviceSums:
    """fp32 sums on the device of this rank's rows of some host-owned matrices."""

    def __init__(self, transfers: Transfers):
        self.transfers = transfers
        self.sums: dict[int, torch.Tensor] = {}   # host index -> [rows, cols] fp32 on the device
        self._copied: Ticket = DONE              # the last copy of the sums to the host

    def allocate(self, shapes: dict[int, tuple[int, int]], device: torch.device) -> None:
        self.sums = {i: torch.zeros(shape, dtype=torch.float32, device=device)
                     for i, shape in shapes.items()}

    def __contains__(self, i: int) -> bool:
        return i in self.sums

    def nbytes(self) -> int:
        return sum(s.numel() * 4 for s in self.sums.values())

    def add(self, rows: dict[int, torch.Tensor], fresh: list[int], scale: float) -> None:
        """sum[i] += scale * rows[i] in fp32 (= for the `fresh` ones: the window's first
        gradient), in one fused launch on the device."""
        if not rows:
            return
        self.transfers.fence(self._copied)   # the last window's sums have left these buffers
        if fresh:
            torch._foreach_zero_([self.sums[i] for i in fresh])
        indices = list(rows)
        torch._foreach_add_([self.sums[i] for i in indices], [rows[i] for i in indices],
                            alpha=scale)

    def copy_out(self, targets: dict[int, torch.Tensor]) -> Ticket:
        """Queue the copy of sum[i] into the host buffer targets[i] for each i; returns its
        Ticket (the host may read the targets once it is done)."""
        if not targets:
            return DONE
        self._copied = self.transfers.to_host([(targets[i], self.sums[i]) for i in targets])
        return self._copied

    def wait_copied(self) -> float:
        """Block until the last copy out has landed (before reading or overwriting the sums
        from the Python thread: saving or loading a state)."""
        return self._copied.wait()
