"""Column operations on a matrix viewed as 2-D [out, in] (column j is W[:, j]).

Reductions along dim 0 and gathers along dim 1 of a row-major matrix are slow when done in one
call on CPU (measured 221 ms vs 9.6 ms for column norms of a 4096x4096 matrix, 8.5 ms vs 4.0 ms
for a 10% column gather): working through blocks of rows that fit in cache fixes both.
"""
from __future__ import annotations

import torch

_BLOCK_BYTES = 256 * 1024


def as_matrix(t: torch.Tensor) -> torch.Tensor:
    """The [out, in] view of a parameter or gradient with ndim >= 2 (no copy for contiguous t)."""
    return t.reshape(t.shape[0], -1)


def _row_block(matrix: torch.Tensor) -> int:
    row_bytes = max(1, matrix.shape[1] * matrix.element_size())
    return max(1, _BLOCK_BYTES // row_bytes)


def _blocks(rows: int, block: int):
    for start in range(0, rows, block):
        yield slice(start, min(rows, start + block))


def column_norms(matrix: torch.Tensor, kind: str = "l2") -> torch.Tensor:
    """Per-column L2 (or L1) norm of `matrix` in fp32: one number per input channel."""
    if matrix.device.type != "cpu":
        m = matrix.float()
        return m.abs().sum(0) if kind == "l1" else torch.linalg.vector_norm(m, dim=0)
    total = torch.zeros(matrix.shape[1], dtype=torch.float32)
    for rows in _blocks(matrix.shape[0], _row_block(matrix)):
        block = matrix[rows].float()
        total.add_(block.abs().sum(0) if kind == "l1" else (block * block).sum(0))
    return total if kind == "l1" else total.sqrt_()


def gather_columns(matrix: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[:, i] = matrix[:, index[i]], converting to out's dtype."""
    if matrix.device.type != "cpu":
        return out.copy_(matrix.index_select(1, index))
    same_dtype = matrix.dtype == out.dtype
    for rows in _blocks(matrix.shape[0], _row_block(matrix)):
        if same_dtype:
            torch.index_select(matrix[rows], 1, index, out=out[rows])
        else:
            out[rows].copy_(matrix[rows].index_select(1, index))
    return out


def scatter_columns(matrix: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """matrix[:, index[i]] = values[:, i], converting to matrix's dtype."""
    if values.dtype != matrix.dtype:
        values = values.to(matrix.dtype)
    if matrix.device.type != "cpu":
        matrix.index_copy_(1, index, values)
        return
    for rows in _blocks(matrix.shape[0], _row_block(matrix)):
        matrix[rows].index_copy_(1, index, values[rows])


def add_(total: torch.Tensor, matrix: torch.Tensor, alpha: float = 1.0) -> None:
    """total += alpha * matrix in fp32; blocks keep a low-precision upcast in cache (5x faster)."""
    if matrix.dtype == total.dtype or matrix.device.type != "cpu":
        total.add_(matrix.to(total.dtype), alpha=alpha)
        return
    for rows in _blocks(matrix.shape[0], _row_block(matrix)):
        total[rows].add_(matrix[rows].to(total.dtype), alpha=alpha)


def copy_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) with dtype conversion done in cache-sized blocks."""
    if src.dtype == dst.dtype or dst.device.type != "cpu" or src.device.type != "cpu":
        dst.copy_(src)
        return
    for rows in _blocks(dst.shape[0], _row_block(dst)):
        dst[rows].copy_(src[rows])
