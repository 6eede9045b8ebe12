"""Per-thread fp32 scratch buffers that the host's update passes share (host/buffers.py's chunks,
host/factored.py's row blocks): kept between chunks and windows, since a fresh allocation would
fault its pages in again each time. A thread runs one chunk or block at a time, so one set serves
every pass it runs."""
from __future__ import annotations

import threading

import torch

_held = threading.local()


def thread_scratch(numel: int, count: int = 2) -> tuple[torch.Tensor, ...]:
    """`count` fp32 buffers of at least `numel` elements, this thread's own (the first two are
    the passes' temporaries; host_moments_dtype="bfloat16" takes three more: the moments
    widened, and the rounding's random bits)."""
    held = getattr(_held, "buffers", None)
    if held is None or held[0].numel() < numel or len(held) < count:
        size = max(numel, held[0].numel() if held is not None else 0)
        held = _held.buffers = tuple(torch.empty(size) for _ in range(count))
    return held[:count]
