"""The one place that knows about CUDA streams, events and pinned memory.

On a CUDA device, gradients go to the host on a side stream that starts after the kernels that
produced them (an event recorded on the current stream), into page-locked staging buffers, so the
copy of one matrix overlaps the host-side accumulation of the previous one; installed weights go
back on a side stream that the current stream waits for with an event, so compute queued after
step() is ordered after the install without blocking the Python thread. Host buffers that the
worker shares are page-locked in place (cudaHostRegister) rather than reallocated, because
memory from `pin_memory=True` cannot be shared with another process.

On CPU-only torch (or a CPU "device") every function here is the plain copy: no streams, no
pinning (`pin_memory=True` and `torch.cuda.Stream()` raise there).
"""
from __future__ import annotations

from typing import Iterator

import torch

from zenflow import columns


def uses_cuda(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def pin_in_place(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Page-lock existing host tensors (shared memory included) for fast async copies. Returns
    the tensors it registered, for `unpin`. A no-op without CUDA."""
    if not torch.cuda.is_available():
        return []
    cudart = torch.cuda.cudart()
    pinned = []
    for t in tensors:
        if t.device.type == "cpu" and not t.is_pinned() and t.numel():
            if int(cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)) == 0:
                pinned.append(t)
    return pinned


def unpin(tensors: list[torch.Tensor]) -> None:
    if tensors and torch.cuda.is_available():
        cudart = torch.cuda.cudart()
        for t in tensors:
            cudart.cudaHostUnregister(t.data_ptr())


class Transfers:
    """Device<->host copies for one optimizer; CUDA specifics stay inside."""

    def __init__(self, device: torch.device):
        self.cuda = uses_cuda(device)
        self._staging: dict[int, torch.Tensor] = {}
        if self.cuda:
            self._d2h = torch.cuda.Stream(device)
            self._h2d = torch.cuda.Stream(device)

    def to_host(self, tensors: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        """Yields each tensor's host copy, in order, each one ready when yielded. On CUDA all
        copies are queued at once so later copies overlap the caller's work on earlier ones."""
        if not self.cuda:
            for t in tensors:
                yield t.cpu()
            return
        produced = torch.cuda.current_stream().record_event()
        self._d2h.wait_event(produced)
        done = []
        with torch.cuda.stream(self._d2h):
            for i, t in enumerate(tensors):  # callers pass the same matrices in the same order
                buf = self._staging.get(i)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    self._staging[i] = buf
                buf.copy_(t, non_blocking=True)
                t.record_stream(self._d2h)
                done.append((buf, self._d2h.record_event()))
        for buf, event in done:
            event.synchronize()
            yield buf

    def to_device(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """dst.copy_(src) for each (device dst, host src). On CUDA the copies run on a side stream
        and the current stream waits for them; the host sources are free again on return (the
        worker may overwrite them next)."""
        if not self.cuda:
            for dst, src in pairs:
                columns.copy_(dst, src)
            return
        self._h2d.wait_stream(torch.cuda.current_stream())  # dst is not in use by earlier work
        with torch.cuda.stream(self._h2d):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        installed = self._h2d.record_event()
        torch.cuda.current_stream().wait_event(installed)
        installed.synchronize()
