"""How important each column of a matrix is, and which columns the device therefore updates.

Importance is one number per column (input channel), computed from the step's gradient, so ranks
agree on a selection by exchanging those numbers, never gradients. Under data parallel each rank
holds some rows of a matrix: a measure says what one rank computes from its rows (`partial`),
the ranks add their partials up, and `finish` turns the sum into the importance.

Adding a measure: a class here with `partial` and `finish`, its name in `MEASURES`, the name in
the settings rule (zenflow/config/rules.py, `Importance`) and the reference's `_choose`
(zenflow/optim/reference.py), and a test against the reference.
"""
from __future__ import annotations

import math
from typing import Protocol

import torch

from zenflow.optim import columns


class ImportanceMeasure(Protocol):
    def partial(self, rows: torch.Tensor) -> torch.Tensor:
        """What one rank contributes from its [rows, in] slice of a matrix's gradient: one fp32
        number per column, summed across ranks."""

    def finish(self, summed: torch.Tensor) -> torch.Tensor:
        """Each column's importance from the sum of every rank's partial."""


class L2Norm:
    """The L2 norm of the column's gradient (ZenFlow's measure)."""

    def partial(self, rows: torch.Tensor) -> torch.Tensor:
        return columns.column_sums(rows, torch.square)

    def finish(self, summed: torch.Tensor) -> torch.Tensor:
        return summed.sqrt()


class L1Norm:
    """The L1 norm of the column's gradient."""

    def partial(self, rows: torch.Tensor) -> torch.Tensor:
        return columns.column_sums(rows, torch.abs)

    def finish(self, summed: torch.Tensor) -> torch.Tensor:
        return summed


MEASURES: dict[str, ImportanceMeasure] = {"l2": L2Norm(), "l1": L1Norm()}


def column_importance(grad: torch.Tensor, measure: str = "l2") -> torch.Tensor:
    """Per-column importance of a whole matrix gradient (any dtype), fp32, on grad's device."""
    m = MEASURES[measure]
    return m.finish(m.partial(columns.as_matrix(grad)))


def num_selected(topk_ratio: float, num_columns: int) -> int:
    """k = ceil(topk_ratio * in): 0 when the ratio is 0, every column when it is 1."""
    return min(num_columns, math.ceil(topk_ratio * num_columns))


def top_columns(importance: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k most important columns, sorted ascending (so gathers walk memory forward).

    Ties are broken towards the lower index, so every implementation picks the same set.
    """
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=importance.device)
    # A stable descending sort gives a deterministic tie order, unlike torch.topk.
    order = torch.sort(importance, descending=True, stable=True).indices[:k]
    return order.sort().values


def retained_mass(importance: torch.Tensor, selected: torch.Tensor,
                  k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(importance held by `selected`, importance held by the best k columns) for one matrix, as
    tensors on its device (the caller reads them all at once)."""
    if k == 0:
        zero = importance.new_zeros(())
        return zero, zero
    return importance[selected].sum(), torch.topk(importance, k).values.sum()
