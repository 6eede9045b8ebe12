"""Per-thread fp32 scratch buffers that the host's update passes share (host/buffers.py's chunks,
host/factored.py's row blocks): kept between chunks and windows, since a fresh allocation would
fault its pages in again each time. A thread runs one chunk or block at a time, so one pair serves
every pass it runs."""
from __future__ import annotations

import threading

import torch

_held = threading.local()


def thread_scratch(numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two fp32 buffers of at least `numel` elements, this thread's own."""
    held = getattr(_held, "buffers", None)
    if held is None or held[0].numel() < numel:
        held = _held.buffers = (torch.empty(numel), torch.empty(numel))
    return held
