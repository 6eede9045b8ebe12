"""A minimal `deepspeed.accelerator.get_accelerator()`: the calls DeepSpeed example scripts make
(device names for `.to(...)`, seeds, synchronize, memory queries), over torch.cuda or the CPU.

Kept apart from `zenflow.host.transfers`, which is the optimizer's internal CUDA seam (streams,
events, pinned buffers) and not a client API.
"""
from __future__ import annotations

import torch


class TorchAccelerator:
    """CUDA when torch sees a GPU, else the CPU (DeepSpeed's CPU accelerator names every device
    'cpu', whatever the index)."""

    def __init__(self):
        self._cuda = torch.cuda.is_available()

    # names and devices
    def device_name(self, device_index: int | None = None) -> str:
        if not self._cuda:
            return "cpu"
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self) -> bool:
        return True

    def is_synchronized_device(self) -> bool:
        return not self._cuda

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == ("cuda" if self._cuda else "cpu")

    # precision support
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list:
        return [torch.float32, torch.bfloat16, torch.float16]

    # execution
    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)
        if self._cuda:
            torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def range_push(self, msg: str) -> None:
        """Profiler range markers (NVTX on CUDA); nothing on the CPU."""
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    # memory (zeros on the CPU, where torch does not track allocations)
    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        import os
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_ACCELERATOR: TorchAccelerator | None = None


def get_accelerator() -> TorchAccelerator:
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = TorchAccelerator()
    return _ACCELERATOR
