"""Where each window sum lives: on the device within `device_sum_budget`, or on the host.

Decided once, at the first step (the budget's "auto" reads the device's peak memory after the
first backward, with room for the activations to double: zenflow/host/transfers.py): the
deferred-credit rule says which matrices' sums, and which of those its own device state, fit
(zenflow/host/credit.py). What the copies of that placement touch is page-locked, and nothing
else. With "auto", each window end watches the device's peak memory since.
"""
from __future__ import annotations

import logging

log = logging.getLogger("zenflow")


class SumPlacement:
    """The placement of one pipeline's window sums; `budget` is device_sum_budget."""

    def __init__(self, budget: int | str):
        self.budget = budget
        self.placed = False
        self._warned = False

    def place(self, pipe) -> None:
        """Place the sums of `pipe` (a HostPipeline), at its first step."""
        budget = self.budget
        if budget == "auto":
            budget = pipe.transfers.spare_device_bytes()
        matrices = pipe.layout.matrices
        summed, moving = pipe.credit.place([m.numel for m in matrices], int(budget),
                                           pipe.device_sums.dtype.itemsize,
                                           [m.dtype for m in matrices],
                                           [(m.rows, m.cols) for m in matrices])
        pipe.device_sums.allocate({i: (matrices[i].rows, matrices[i].cols) for i in summed},
                                  pipe.device, fp32=set(moving) if pipe.credit.fp32_sums else set(),
                                  runs=pipe.layout.back_to_back(sorted(summed)))
        pipe.credit.allocate({i: (matrices[i].rows, matrices[i].cols, matrices[i].dtype)
                              for i in moving}, pipe.device)
        for i in summed:   # a window restored before the first step summed on the host so far
            if pipe.num_grads[i]:
                pipe.device_sums.sums[i].copy_(pipe.host.fp32(f"grad_sum{pipe._sum_slot}", i))
        pipe.early_copies.stop_watching(summed)
        _lock_copied_spans(pipe, summed)
        self.placed = True
        # (DDP's ranks move the matrices every rank placed: fewer than `moving`, maybe)
        moved = sum(map(pipe.credit.moves, range(len(matrices))))
        log.info("window sums of %d of %d matrices on the device (%.2f GiB of a budget of "
                 "%.2f GiB); the rest on the host; deferred_credit %r on %d of them",
                 len(summed), len(matrices), pipe.device_sums.nbytes() / 2**30,
                 int(budget) / 2**30, pipe.credit.name, moved if moving else len(matrices))

    def watch(self, pipe) -> None:
        """At a window end: with "auto" the sums were placed for the first step's activations
        (with room for them to double); a longer batch since may have taken that room. Say so
        once, while there is still a margin: 5% of the device."""
        if self.budget != "auto" or self._warned or not pipe.device_sums.sums:
            return
        peak, total = pipe.transfers.device_memory()
        if peak > 0.95 * total:
            self._warned = True
            log.warning("the device's peak memory has reached %.1f of %.1f GiB since the window "
                        "sums were placed (device_sum_budget='auto': %.2f GiB of sums, placed for "
                        "the first step's activations); a longer batch could now run out of "
                        "device memory. Set device_sum_budget to fewer bytes (0: every sum on "
                        "the host) or shorten the longest batch.", peak / 2**30, total / 2**30,
                        pipe.device_sums.nbytes() / 2**30)


def _lock_copied_spans(pipe, on_device: list[int]) -> None:
    """Page-lock what the copies of this placement touch, and nothing else: the staging buffers
    over the matrices summed on the host (their gradients cross every step), and the sum buffers
    over those summed on the device (their sums, and a credit rule's own, cross at window ends).
    Every sum on the device: no staging buffer is locked."""
    placed = set(on_device)
    on_host = [i for i in range(len(pipe.params)) if i not in placed]
    spans = [view for s in range(pipe.layout.staging_slots)
             for view in pipe.host.span(f"staging{s}", on_host)]
    spans += [view for s in range(pipe.layout.sum_slots)
              for view in pipe.host.span(f"grad_sum{s}", on_device)]
    pipe.transfers.pin(spans)
