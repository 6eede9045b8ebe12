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

from zenflow.host.numa import place_host_memory

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


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_headroom(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup"
                     ) -> int | None:
    """What this process's memory cgroup still allows (limit - usage), v2 or v1, at the
    process's own cgroup or, where that is not visible (a container's namespace), at the root;
    None without a limit."""
    v2_paths, v1_paths = [""], [""]
    for line in (_read(proc_cgroup) or "").splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            v2_paths.insert(0, path)
        elif "memory" in controllers.split(","):
            v1_paths.insert(0, path)
    candidates = [(f"{root}{p}".rstrip("/"), "memory.max", "memory.current") for p in v2_paths]
    candidates += [(f"{root}/memory{p}".rstrip("/"), "memory.limit_in_bytes",
                    "memory.usage_in_bytes") for p in v1_paths]
    for directory, limit_file, usage_file in candidates:
        limit, usage = _read(f"{directory}/{limit_file}"), _read(f"{directory}/{usage_file}")
        if limit is None or usage is None:
            continue
        if limit == "max" or int(limit) >= 1 << 60:   # v1 writes "no limit" as a huge number
            return None
        return int(limit) - int(usage)
    return None


def _address_space_headroom() -> int | None:
    """What `ulimit -v` (RLIMIT_AS) still allows this process to map; None without a limit."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, OSError, AttributeError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    for line in (_read("/proc/self/status") or "").splitlines():
        if line.startswith("VmSize:"):
            return soft - int(line.split()[1]) * 1024
    return None


def available_host_bytes() -> int:
    """Memory the host can still give this process: MemAvailable, capped by the memory
    cgroup's limit (v2 or v1) and by the address-space limit (ulimit -v)."""
    return host_memory()[0]


def host_memory() -> tuple[int, str]:
    """available_host_bytes(), and which of the limits it comes from, in words."""
    available, source = None, "MemAvailable"
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    for headroom, what in ((_cgroup_headroom(), "the container's memory limit (cgroup)"),
                           (_address_space_headroom(), "the address-space limit (ulimit -v)")):
        if headroom is not None and headroom < available:
            available, source = headroom, what
    return max(0, available), source


def check_fits(nbytes: int, owner: str, available: int | None = None) -> None:
    """Raise HostMemoryError, before anything is allocated, when `nbytes` will not fit."""
    source = "as given"
    if available is None:
        available, source = available_host_bytes(), host_memory()[1]
    if nbytes > available:
        gib = 1 << 30
        raise HostMemoryError(
            f"{owner}: the host state needs {nbytes / gib:.2f} GiB of host memory but only "
            f"{available / gib:.2f} GiB is available (limited by {source}). It is fp32 master "
            "values, two Adam moments and gradient sums for every matrix parameter, whatever "
            "topk_ratio is, so a smaller topk_ratio does not help. Free host memory, raise the "
            "container's memory limit (docker run --memory) or `ulimit -v`, "
            "or train on more ranks: data parallel splits the host state across them. "
            "(The memory is not in /dev/shm, so --shm-size does not matter.)")


def anonymous_file(name: str) -> int:
    """A descriptor of a new, empty file in memory that no path names (a memfd; elsewhere an
    unlinked temporary file): nothing is left behind when its last descriptor closes."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name, os.MFD_CLOEXEC)
    handle = tempfile.TemporaryFile()
    fd = os.dup(handle.fileno())
    handle.close()
    return fd


def _memory_file(nbytes: int, nodes: list[int] | None = None,
                 regions: list[Region] | None = None) -> int:
    fd = anonymous_file("zenflow-host-state")
    try:
        os.ftruncate(fd, nbytes)
        if nodes:   # before the pages exist: they are allocated by the policy then
            place_host_memory(fd, nbytes, nodes, [(r.offset, r.numel, _itemsize(r.dtype))
                                                  for r in regions or []])
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
    # The NUMA nodes its buffers were shared out over, in share order (numa.share_bounds);
    # [] when Linux placed it. A worker attaching it is told them.
    nodes: list[int] = field(default_factory=list)

    @classmethod
    def create(cls, regions: list[tuple[str, torch.dtype, int]], owner: str = "ZenFlowAdamW",
               available: int | None = None, nodes: list[int] | None = None) -> Arena:
        """A new arena; `nodes`: the NUMA nodes its pages should come from
        (zenflow/host/numa.py; None or [] leaves it to Linux)."""
        placed, size = plan(regions)
        check_fits(size, owner, available)
        fd = _memory_file(max(size, _ALIGN), nodes, placed)
        try:
            return cls._mapped(placed, size, fd, list(nodes or []))
        except OSError as exc:
            os.close(fd)
            if exc.errno != errno.ENOMEM:
                raise
            raise HostMemoryError(
                f"{owner}: could not map {size / (1 << 30):.2f} GiB of host state: {exc}. The "
                "address-space limit (ulimit -v) or the memory limit is too small for it; raise "
                "it, or train on more ranks (data parallel splits the host state)") from None

    @classmethod
    def attach(cls, regions: list[Region], size: int, fd: int,
               nodes: list[int] | None = None) -> Arena:
        """The same arena in another process, from the file descriptor it was handed (and the
        nodes it was placed on)."""
        return cls._mapped(regions, size, fd, list(nodes or []))

    @classmethod
    def _mapped(cls, regions: list[Region], size: int, fd: int,
                nodes: list[int] | None = None) -> Arena:
        # Fault every page in now (in each process that maps it): otherwise the first touches
        # of a few GB, page by page, land in the first window's host update and in the first
        # steps' copies (measured: 1.1 s instead of 0.1 s for 92M parameters' first update).
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        memory = mmap.mmap(fd, max(size, _ALIGN), flags=flags)
        data = torch.frombuffer(memory, dtype=torch.uint8)
        views = {r.name: data[r.offset:r.offset + r.nbytes].view(r.dtype) for r in regions}
        arena = cls(regions, size, fd, views, memory, list(nodes or []))
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
