"""Checks that the parts of the optimizers share when they read back a saved state."""
from __future__ import annotations

import torch


def check_saved_tensors(saved, expected: dict[str, torch.Tensor], what: str = "") -> None:
    """Raise ValueError unless the dict `saved` holds a tensor of each `expected` one's shape."""
    for name, have in expected.items():
        got = saved.get(name) if isinstance(saved, dict) else None
        if not isinstance(got, torch.Tensor) or got.shape != have.shape:
            shown = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            where = f"{what}: " if what else ""
            raise ValueError(f"{where}saved {name} is {shown}, expected {tuple(have.shape)}")
