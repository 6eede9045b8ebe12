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
        number per column, summed across ranks; of a stack [n, rows, in] of alike matrices'
        slices, each one's ([n, in])."""

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
    """Indices of the k most important columns, sorted ascending (so gathers walk memory forward),
    along the last dimension (a stack of alike matrices' importances: each row its own).

    Ties are broken towards the lower index, so every implementation picks the same set.
    """
    if k == 0:
        return torch.zeros(*importance.shape[:-1], 0, dtype=torch.long, device=importance.device)
    # A stable descending sort gives a deterministic tie order, unlike torch.topk.
    order = torch.sort(importance, dim=-1, descending=True, stable=True).indices[..., :k]
    return order.sort(dim=-1).values


def retained_masses(importances: list[torch.Tensor], selected: list[torch.Tensor],
                    ks: list[int]) -> torch.Tensor:
    """[held, best] in float64 on the device: the importance held by each matrix's `selected`
    columns, and by its best `k` columns, summed over the matrices (each matrix's sums in fp32).
    Matrices alike in columns and k go as one batch (stacked, then a gather, a topk and two sums):
    a handful of launches for a model's repeated layers, where one a matrix were four."""
    groups: dict[tuple[int, int], list[int]] = {}
    for j, (importance, k) in enumerate(zip(importances, ks)):
        if k:
            groups.setdefault((importance.numel(), k), []).append(j)
    sums = []
    for (_, k), members in groups.items():
        batch = torch.stack([importances[j] for j in members])
        chosen = torch.stack([selected[j] for j in members])
        sums.append(torch.stack([batch.gather(1, chosen).sum(1),
                                 batch.topk(k, dim=1).values.sum(1)], dim=1))
    if not sums:
        return torch.zeros(2, dtype=torch.float64)
    return torch.cat(sums).double().sum(0)
