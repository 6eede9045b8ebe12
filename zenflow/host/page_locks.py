"""Host buffers page-locked in place for one CUDA device (part of the CUDA seam, used by
zenflow/host/transfers.py).

The host state lives in a shared memory file that the worker maps too, so `pin_memory=True`
cannot allocate it: its buffers are registered with the driver where they are
(cudaHostRegister). Three things a GPU run needs and a CPU test cannot see:

- A refused registration (RLIMIT_MEMLOCK, a container's limit, a range registered already) is
  also left as the CUDA runtime's "last error", which PyTorch's next kernel-launch check would
  report as that kernel's failure. PyTorch's runtime binding (`torch.cuda.cudart()`) has no
  cudaGetLastError, so the error is cleared through the libcudart this process already loaded.
- Every return code is checked: a refused registration leaves the buffer pageable (its copies
  are slower and synchronous, which a warning says once), a refused release is reported.
- The registrations are released by close() or, for an optimizer dropped without it (HF Trainer
  and Lightning never call close(); notebooks, sweeps), by a finalizer: otherwise tens of GiB
  stay locked until the process exits. The finalizer holds the buffers themselves, so their
  memory stays mapped until it is unlocked, and waits for the copies in flight first.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import weakref

import torch

log = logging.getLogger("zenflow")


class PageLocks:
    """The page-locked buffers of one device. `streams`: the copy streams whose copies read or
    write them (synchronized before any is unlocked)."""

    def __init__(self, device: torch.device, streams: tuple = ()):
        self.device = device
        self._locked: list[torch.Tensor] = []
        self._release = weakref.finalize(self, _unlock, device, self._locked, streams)
        # At exit the process's pages are released with it; a CUDA call then is only a risk.
        self._release.atexit = False

    @property
    def buffers(self) -> list[torch.Tensor]:
        return list(self._locked)

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in self._locked)

    def lock(self, tensors: list[torch.Tensor]) -> None:
        """Page-lock each of `tensors` (contiguous host memory) that is not locked already; a
        refused one stays pageable, with one warning for the call."""
        cudart = torch.cuda.cudart()
        refused = []
        with torch.cuda.device(self.device):   # never the implicit current device
            for t in tensors:
                if not t.numel() or t.is_pinned():
                    continue
                code = int(cudart.cudaHostRegister(t.data_ptr(), _nbytes(t), 0))
                if code == 0:
                    self._locked.append(t)
                else:
                    clear_last_cuda_error(self.device)
                    refused.append((_nbytes(t), code))
        if refused:
            log.warning("page-locking %d host buffer(s) of %.2f GiB failed (cudaHostRegister "
                        "error %d: %s); their copies stay pageable: slower, and synchronous with "
                        "the Python thread. Raise the locked-memory limit (ulimit -l) to fix it.",
                        len(refused), sum(n for n, _ in refused) / 2**30, refused[0][1],
                        _error_name(refused[0][1]))

    def release(self) -> None:
        """Unlock every buffer, once no copy in flight reads or writes them; idempotent."""
        self._release()


def _unlock(device: torch.device, locked: list[torch.Tensor], streams: tuple) -> None:
    if not locked:
        return
    for stream in streams:
        stream.synchronize()
    cudart = torch.cuda.cudart()
    failed = []
    with torch.cuda.device(device):
        for t in locked:
            code = int(cudart.cudaHostUnregister(t.data_ptr()))
            if code != 0:
                clear_last_cuda_error(device)
                failed.append(code)
    locked.clear()
    if failed:
        log.warning("releasing %d page-locked host buffer(s) failed (cudaHostUnregister error "
                    "%d: %s)", len(failed), failed[0], _error_name(failed[0]))


def clear_last_cuda_error(device: torch.device) -> None:
    """Reset the CUDA runtime's last error of this thread (after a call that failed and whose
    code was handled), so that PyTorch's next launch check does not report it."""
    library = _loaded_cudart()
    if library is not None:
        library.cudaGetLastError()
        return
    # A statically linked runtime: PyTorch's launch check reads the error, and so resets it.
    try:
        torch.empty(1, device=device).zero_()
    except RuntimeError:
        pass


@functools.lru_cache(maxsize=1)
def _loaded_cudart():
    """The CUDA runtime library this process has loaded (PyTorch's), or None."""
    try:
        with open(f"/proc/{os.getpid()}/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        library.cudaGetLastError.restype = ctypes.c_int
        library.cudaGetErrorName.restype = ctypes.c_char_p
        library.cudaGetErrorName.argtypes = [ctypes.c_int]
        return library
    return None


def _error_name(code: int) -> str:
    library = _loaded_cudart()
    if library is None:
        return "see cudaError_t"
    return library.cudaGetErrorName(code).decode()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
