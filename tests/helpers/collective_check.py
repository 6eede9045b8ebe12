"""Catch, on a CPU, a collective that would break under NCCL on GPUs.

`CheckedDist` stands in for torch.distributed inside zenflow.distributed (the one handle zenflow
has on it) and declares the group's backend: every tensor handed to a collective must be where
that backend takes it, the CPU for gloo, the rank's device for NCCL. The run itself is gloo on
the CPU, so under a declared "nccl" the rank's device is the CPU too, and a device check alone
proves nothing. `HostTaint` makes it meaningful: it follows host data through every torch call of
the training process and marks as host memory

- every tensor that lies in an optimizer's host arena (master values, moments, sums, staging
  and install buffers),
- every result of `Tensor.cpu()` (a device->host copy on a GPU) and of `torch.tensor(...)`
  without a device (host memory on a GPU),
- every result computed from host memory (out-of-place ops; in-place ops keep the target's mark),

while a copy into a tensor allocated on the device, or `.to(device)`, is device memory. Under
a declared NCCL, a collective that receives host memory is what would have raised on a GPU
("No backend type associated with device type cpu") or, with gloo on GPUs, moved the model
through host memory. Violations are recorded, not raised, so the ranks never hang on a
collective one of them skipped; the test reads them afterwards.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

HOST_BACKENDS = ("gloo", "mpi")
_CHECKED = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "broadcast", "reduce",
            "reduce_scatter_tensor", "all_gather", "all_to_all_single", "send", "recv")


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


class HostTaint(TorchFunctionMode):
    """Marks host memory as it flows through torch calls (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.ranges: list[tuple[int, int]] = []

    def add_arena(self, optimizer) -> None:
        views = [v for v in optimizer._pipeline.host.arena.views.values() if v.numel()]
        if views:
            self.ranges.append((min(v.data_ptr() for v in views),
                                max(v.data_ptr() + v.numel() * v.element_size() for v in views)))

    def is_host(self, t: torch.Tensor) -> bool:
        if getattr(t, "_zenflow_host", False):
            return True
        try:
            ptr = t.data_ptr()
        except RuntimeError:
            return False
        return any(lo <= ptr < hi for lo, hi in self.ranges) if t.numel() else False

    @staticmethod
    def _mark(out) -> None:
        for t in _tensors(out):
            try:
                t._zenflow_host = True
            except (AttributeError, RuntimeError):
                pass

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if func is torch.Tensor.cpu or (func is torch.tensor and "device" not in kwargs):
            if args and out is args[0]:   # .cpu() of a CPU tensor is the tensor itself: mark a
                out = out.view_as(out)    # new alias (the copy a GPU makes), not the source
            self._mark(out)
        elif name == "to" and (kwargs.get("device") is not None or any(
                isinstance(a, (str, torch.device)) for a in args[1:])):
            pass  # a move to a named device: device memory on a GPU (host moves use .cpu())
        elif name.endswith("_") and not name.startswith("__"):
            pass  # in place: the target keeps its own mark (copy_ into device memory)
        elif any(self.is_host(t) for t in _tensors((args, kwargs))):
            self._mark(out)
        return out


class CheckedDist:
    """torch.distributed with a declared backend and every collective's tensors checked."""

    def __init__(self, real, backend: str, device: torch.device, taint: HostTaint | None = None):
        self._real = real
        self.backend = backend
        self.device = torch.device(device)
        self.taint = taint
        self.violations: list[str] = []
        self.calls: Counter = Counter()

    def get_backend(self, group=None) -> str:
        return self.backend

    def required_device(self) -> torch.device:
        return torch.device("cpu") if self.backend in HOST_BACKENDS else self.device

    def _check(self, name: str, t: torch.Tensor) -> None:
        where = self.required_device()
        if t.device != where:
            self.violations.append(f"{name}: a tensor on {t.device} handed to a {self.backend} "
                                   f"group, which takes {where}")
        elif self.backend not in HOST_BACKENDS and self.taint is not None \
                and self.taint.is_host(t):
            self.violations.append(f"{name}: host memory {tuple(t.shape)} {t.dtype} handed to a "
                                   f"{self.backend} group (a host copy or host buffer; on a GPU "
                                   "it would be on the CPU)")

    def __getattr__(self, name):
        fn = getattr(self._real, name)
        if name not in _CHECKED:
            return fn

        def checked(*args, **kwargs):
            self.calls[name] += 1
            for t in _tensors((args, kwargs)):
                self._check(name, t)
            return fn(*args, **kwargs)
        return checked
