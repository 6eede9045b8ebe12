"""Host memory shared with the worker: one anonymous shared file, carved into flat typed buffers.

Every host tensor of an optimizer (fp32 master values, both moments, the gradient sums, and the
staging and install buffers in the parameters' dtype) is a view into one memory file. The number
of file descriptors, mappings and page-lock registrations is therefore one, whatever the number
of matrices, and a whole kind ("every master value") is one flat tensor, so host arithmetic runs
as a few large kernels instead of one per matrix.

The file is a memfd (Linux) or an unlinked temporary file elsewhere: it has no name in /dev/shm,
so nothing can be left behind by a crash, and the kernel frees it when the last process holding
it exits. Its pages are reserved at creation (posix_fallocate), so a machine without the memory
fails here with a clear error instead of a SIGBUS in the middle of training.
"""
from __future__ import annotations

import errno
import math
import mmap
import os
import tempfile
import weakref
from dataclasses import dataclass, field

import torch

_ALIGN = 4096  # regions start on page boundaries: page-locking and DMA want whole pages


class HostMemoryError(MemoryError):
    """The host cannot hold the optimizer's host state; the message says how much is missing."""


@dataclass(frozen=True)
class Region:
    """A named run of `numel` elements of `dtype` at byte `offset` of the file."""
    name: str
    dtype: torch.dtype
    numel: int
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def plan(regions: list[tuple[str, torch.dtype, int]]) -> tuple[list[Region], int]:
    """Byte offsets for (name, dtype, numel) regions, each page aligned; returns them and the size."""
    placed, offset = [], 0
    for name, dtype, numel in regions:
        placed.append(Region(name, dtype, numel, offset))
        offset += math.ceil(numel * _itemsize(dtype) / _ALIGN) * _ALIGN
    return placed, offset


def available_host_bytes() -> int:
    """Memory the host can still give: MemAvailable, capped by the cgroup's limit if any."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:  # cgroup v2: what is left under memory.max
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read())
        if limit != "max":
            available = min(available, int(limit) - current)
    except (OSError, ValueError):
        pass
    return max(0, available)


def check_fits(nbytes: int, owner: str, available: int | None = None) -> None:
    """Raise HostMemoryError, before anything is allocated, when `nbytes` will not fit."""
    available = available_host_bytes() if available is None else available
    if nbytes > available:
        gib = 1 << 30
        raise HostMemoryError(
            f"{owner}: the host state needs {nbytes / gib:.2f} GiB of host memory but only "
            f"{available / gib:.2f} GiB is available (MemAvailable, or the container's memory "
            "limit). It is fp32 master values, two Adam moments and gradient sums for every "
            "matrix parameter, whatever topk_ratio is, so a smaller topk_ratio does not help. "
            "Free host memory, raise the container's memory limit (docker run --memory), "
            "or train on more ranks: data parallel splits the host state across them. "
            "(The memory is not in /dev/shm, so --shm-size does not matter.)")


def _memory_file(nbytes: int) -> int:
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("zenflow-host-state", os.MFD_CLOEXEC)
    else:
        handle = tempfile.TemporaryFile()
        fd = os.dup(handle.fileno())
        handle.close()
    try:
        os.ftruncate(fd, nbytes)
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise HostMemoryError(f"could not reserve {nbytes / (1 << 30):.2f} GiB of shared "
                                  f"host memory for the optimizer: {exc}") from exc
        raise
    return fd


@dataclass
class Arena:
    """A mapped memory file and typed flat views of its regions (views[name] is 1-D)."""
    regions: list[Region]
    size: int
    fd: int | None = None
    views: dict[str, torch.Tensor] = field(default_factory=dict)
    _map: mmap.mmap | None = None

    @classmethod
    def create(cls, regions: list[tuple[str, torch.dtype, int]], owner: str = "ZenFlowAdamW",
               available: int | None = None) -> Arena:
        placed, size = plan(regions)
        check_fits(size, owner, available)
        fd = _memory_file(max(size, _ALIGN))
        return cls._mapped(placed, size, fd)

    @classmethod
    def attach(cls, regions: list[Region], size: int, fd: int) -> Arena:
        """The same arena in another process, from the file descriptor it was handed."""
        return cls._mapped(regions, size, fd)

    @classmethod
    def _mapped(cls, regions: list[Region], size: int, fd: int) -> Arena:
        # Fault every page in now (in each process that maps it): otherwise the first touches
        # of a few GB, page by page, land in the first window's host update and in the first
        # steps' copies (measured: 1.1 s instead of 0.1 s for 92M parameters' first update).
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        memory = mmap.mmap(fd, max(size, _ALIGN), flags=flags)
        data = torch.frombuffer(memory, dtype=torch.uint8)
        views = {r.name: data[r.offset:r.offset + r.nbytes].view(r.dtype) for r in regions}
        arena = cls(regions, size, fd, views, memory)
        # An optimizer dropped without close() must not leak its descriptor.
        arena._close = weakref.finalize(arena, os.close, fd)
        return arena

    def close_fd(self) -> None:
        """Drop the descriptor (the mapping stays); idempotent."""
        if self.fd is not None:
            self._close()
            self.fd = None

    def region(self, name: str) -> Region:
        return next(r for r in self.regions if r.name == name)

    def release(self) -> None:
        """Unmap, once no view is used any more (views dangle afterwards: drop them first)."""
        self.close_fd()
        self.views = {}
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a view is still referenced somewhere; the mapping goes with it
            self._map = None
