"""The versions of the saved state's format (zenflow/optim/state.py), and the steps that bring an
older state up to this one.

A change to what any part saves bumps FORMAT_VERSION and adds a step to `_MIGRATIONS` that turns a
state of the version before into the new one, so every older state still loads; a state newer
than this code is refused, naming both versions. Version 1 is the format before versions were
written down (no "format_version" key).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

FORMAT_VERSION = 6


def _from_v1(saved: dict) -> dict:
    return saved   # version 2 only started writing the version down


def _from_v2(saved: dict) -> dict:
    # Version 3 saves FSDP2 shards as DTensors; version 2 saved every rank's rows as plain
    # tensors, which only a single process's whole tensors make reshardable.
    return {**saved, "reshardable": saved.get("world_size", 1) == 1}


def _from_v3(saved: dict) -> dict:
    # Version 4 saves each matrix's sum of squares and device rates (deferred_credit="moments");
    # the host pieces of older states get them when checked (`with_squares`).
    return {**saved, "squares_saved": False}


def _from_v4(saved: dict) -> dict:
    # Version 5 counts a window with a skipped step inside, which it drops at its end; older
    # versions skipped such steps on the spot, so no saved window holds one.
    return {**saved, "window_spoiled": False}


def _from_v5(saved: dict) -> dict:
    # Version 6 saves a "factored" matrix's row and column statistics and rate factors
    # ("row_factors", "col_factors" in its host piece, absent under the other rules) and a flag
    # per in-flight job; no older state had either.
    return saved


# version v -> the step that turns a "zenflow" section of version v into version v + 1
_MIGRATIONS: dict[int, Callable[[dict], dict]] = {1: _from_v1, 2: _from_v2, 3: _from_v3,
                                                  4: _from_v4, 5: _from_v5}


def with_squares(host_piece: dict) -> dict:
    """A host piece of a state older than version 4 with the squares as if every gradient of its
    window were the window's mean, and no rates (the device takes no interim steps until the
    next install)."""
    grad_sum, n = host_piece.get("grad_sum"), host_piece.get("num_grads")
    if not isinstance(grad_sum, torch.Tensor) or not isinstance(n, int) or n <= 0:
        squares = torch.zeros_like(grad_sum) if isinstance(grad_sum, torch.Tensor) else None
    else:
        squares = grad_sum.float().square() / n
    return {**host_piece, "grad_sq_sum": squares,
            "rate": None if squares is None else torch.zeros_like(squares)}


def migrated(saved: dict) -> dict:
    """The "zenflow" section `saved` in this version's format, migrated step by step."""
    version = saved.get("format_version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"'format_version' must be a positive integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise ValueError(f"the state has format version {version}, newer than this zenflow reads "
                         f"(1 to {FORMAT_VERSION}); load it with the zenflow that saved it, or a "
                         "newer one")
    while version < FORMAT_VERSION:
        saved = _MIGRATIONS[version](dict(saved))
        version += 1
    return {**saved, "format_version": FORMAT_VERSION}
