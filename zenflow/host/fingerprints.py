"""Fingerprints of weights: their bits summed as integers, so that any write shows (a sum of
the bits changes with any one value, and is exact modulo 2**32). zenflow/optim/outside_writes.py
takes them of whole matrices and compares them; the "factored" rule's compiled step takes them
of the columns it moves in the same pass (zenflow/host/credit_factored.py)."""
from __future__ import annotations

import torch

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values as integers of the same width: compared or summed, they tell any change."""
    return t.view(_BITS[t.element_size()])


def column_bit_sums(matrix: torch.Tensor) -> torch.Tensor:
    """The bits of each column of a [rows, cols] matrix summed as int32 (exact modulo 2**32):
    the kernel of a window end's fingerprint (zenflow selftest measures its speed)."""
    return column_sums_of_bits(bits(matrix))


def column_sums_of_bits(matrix_bits: torch.Tensor) -> torch.Tensor:
    """column_bit_sums() of a matrix already seen as integers (`bits(matrix)`, which
    zenflow.host.weight_views keeps per parameter: one operator a matrix, not three): [cols] of
    a [rows, cols] matrix, [n, cols] of a stack of n alike ones."""
    return matrix_bits.sum(dim=-2, dtype=torch.int32)


def masked_bit_sum(matrix: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The bits of a [rows, cols] matrix's columns where `columns` ([cols]) is not 0, summed as
    int32: column_bit_sums() of those columns added up (the same modulo 2**32), in one
    reduction."""
    kept = torch.where(columns != 0, bits(matrix), torch.zeros((), dtype=_BITS[
        matrix.element_size()], device=matrix.device))
    return kept.sum(dtype=torch.int32)
