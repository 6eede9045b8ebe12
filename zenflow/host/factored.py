"""The host's update of a "factored" matrix (deferred_credit="factored", docs/semantics.md): the
window's mean square estimated from its sum and the row and column sums of its squares, the
window as n AdamW steps ("moments"), and the rate factors fitted for the device.

A window of n gradients with sum S, row sums Rs and column sums Cs of the squared gradients over
the host-owned columns (mask d), as benchmarks/prototypes/bf16_rules.py's "residual" squares and
"factored" rates:

    mean = S / n,  sq = mean^2
    vr_i = max(0, Rs_i / n - sum_j d_j sq_ij),  vc_j = max(0, Cs_j / n - sum_i sq_ij)
    msq  = sq + vr_i vc_j / max(sum_i vr_i, 1e-30)       (exact where n = 1, or where the
                                                         window's gradients are equal)
    m <- b1^n m + (1 - b1^n) mean,  v <- b2^n v + (1 - b2^n) msq,  count += n
    x <- x (1 - n lr wd) - n lr m_hat / (sqrt(v_hat) + eps)
    r = 1 / (sqrt(v_hat) + eps),  a_i = mean over the host's columns of log r_ij,
    b_j = mean_i (log r_ij - a_i),  alpha = exp(a),  beta = exp(b) d

A matrix goes in blocks of whole rows (ROW_BLOCK elements), twice: the first pass sums the squares
of the window's mean per row and per column (vr and vc need all of them), the second does the
rest of each block while it is in cache (the mean square, the n AdamW steps, the rates, their
logarithms' row and column sums, the install values). Each pass is a list of tasks, one a block,
that the worker's NUMA teams share as they share the other rules' chunks; a block's column sums
go to its own row of a partial sum, added in block order afterwards, so the result does not
depend on which thread ran which block. Per value: the sum read twice, the master and both
moments read and written once, the install value written once.
"""
from __future__ import annotations

import math
from functools import partial

import torch

from zenflow.host.compact_moments import SCRATCH, fp32_moments, store_moments_
from zenflow.host.scratch import thread_scratch

ROW_BLOCK = 1 << 18   # elements of a block of rows (at least one row): its fp32 temporaries,
# two of them, stay in a server core's L2 and its share of L3, as buffers.PIECE's chunks do
TASKS_PER_LANE = 8    # blocks a worker core has to take in a group: cores free up unevenly
_SMALL = 1 << 14      # blocks below this many elements take fresh temporaries, not the scratch


def window_mean_square(grad_sum: torch.Tensor, row_sq: torch.Tensor, col_sq: torch.Tensor,
                       deferred: torch.Tensor, num_grads: int) -> torch.Tensor:
    """msq above, [rows, cols] fp32 (the host's columns; the device's hold the mean squared), of
    a whole matrix at once (the row-block pass computes the same)."""
    mean = torch.div(grad_sum, num_grads)
    sq = torch.mul(mean, mean)
    vr, vc, total = _residuals(row_sq, col_sq, *_square_sums(sq, deferred), num_grads)
    return _mean_square_(sq, vr, vc, total)


def update_whole_(x, m, v, grad_sum, row_sq, col_sq, deferred, alpha, beta, step: int,
                  num_grads: int, **hyper) -> None:
    """A "factored" matrix's whole update at once (lr: n times the group's): the moments, the
    value, and alpha and beta. The definition the row-block pass follows (tests compare them)."""
    msq = window_mean_square(grad_sum, row_sq, col_sq, deferred, num_grads)
    denom = moments_step_(x, torch.div(grad_sum, num_grads), msq, m, v, step, num_grads, **hyper)
    count = float(deferred.sum())
    if count:
        a_neg, column_sums = torch.empty_like(alpha), torch.empty_like(beta)
        _log_sums(denom.log_(), deferred, count, a_neg, column_sums)
        _fit_(alpha, beta, a_neg, column_sums, x.shape[0], deferred)
    else:
        alpha.zero_()
        beta.zero_()


def _square_sums(sq: torch.Tensor, deferred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Of a block of rows of sq: sum_j d_j sq_ij per row and sum_i sq_ij per column."""
    return torch.mv(sq, deferred), sq.sum(0)


def _residuals(row_sq, col_sq, mean_rows, mean_cols, num_grads):
    """(vr, vc, max(sum vr, 1e-30)): what the squares' sums hold beyond the mean's squares."""
    vr = (row_sq / num_grads - mean_rows).clamp_min(0.0)
    vc = (col_sq / num_grads - mean_cols).clamp_min(0.0)
    return vr, vc, vr.sum().clamp_min(1e-30)


def _mean_square_(sq: torch.Tensor, vr: torch.Tensor, vc: torch.Tensor,
                  total: torch.Tensor) -> torch.Tensor:
    """msq of a block of rows (`vr`: its rows'), in place of its mean's squares `sq`."""
    return sq.addr_(vr / total, vc)


def moments_step_(x: torch.Tensor, mean: torch.Tensor, mean_square: torch.Tensor,
                  m: torch.Tensor, v: torch.Tensor, step: int, num_grads: int, *, lr: float,
                  beta1: float, beta2: float, eps: float, weight_decay: float) -> torch.Tensor:
    """The window's n AdamW steps at once (`lr`: n times the group's), in place, from its mean
    gradient and mean square; returns the new denominators sqrt(v_hat) + eps (1 / the rates),
    in `mean_square`, which it overwrites."""
    m.lerp_(mean, 1.0 - beta1 ** num_grads)
    v.lerp_(mean_square, 1.0 - beta2 ** num_grads)
    denom = torch.sqrt(v, out=mean_square).div_(math.sqrt(1.0 - beta2 ** step)).add_(eps)
    x.mul_(1.0 - lr * weight_decay).addcdiv_(m, denom, value=-lr / (1.0 - beta1 ** step))
    return denom


def fit_rates_(rate: torch.Tensor, deferred: torch.Tensor, alpha: torch.Tensor,
               beta: torch.Tensor) -> None:
    """alpha, beta := the row and column factors of log `rate` over the host's columns (beta 0
    elsewhere; both 0 where the host owns no column), of a whole matrix at once."""
    count = float(deferred.sum())
    if count == 0:
        alpha.zero_()
        beta.zero_()
        return
    a_neg, column_sums = torch.empty_like(alpha), torch.empty_like(beta)
    _log_sums(rate.log().neg_(), deferred, count, a_neg, column_sums)
    _fit_(alpha, beta, a_neg, column_sums, rate.shape[0], deferred)


def _log_sums(logs: torch.Tensor, deferred: torch.Tensor, count: float, a_neg: torch.Tensor,
              column_sums: torch.Tensor) -> None:
    """Of a block of rows of the denominators' logarithms L = -log r, into `a_neg` and
    `column_sums`: -a_i (the mean of L_ij over the host's columns) and, per column, the sum over
    the block's rows of L_ij + a_i."""
    torch.mv(logs, deferred, out=a_neg).div_(count)
    torch.sum(logs, 0, out=column_sums).sub_(a_neg.sum())


def _fit_(alpha, beta, a_neg, column_sums, rows: int, deferred) -> None:
    """alpha = exp(a), beta = exp(b) d, b_j = -(the column's sums of L + a over every row) / rows."""
    torch.exp(a_neg.neg(), out=alpha)
    beta.copy_(column_sums.div(-rows).exp_().mul_(deferred))


class _Matrix:
    """One "factored" job's update, block by block: sums() is the first pass's task for a block,
    update() the second's; residuals() and finish() what needs every block."""

    def __init__(self, host, job, sum_slot: int):
        i = job.matrix
        self.job = job
        self.x = host.state("master", i)
        self.m, self.v = host.state("exp_avg", i), host.state("exp_avg_sq", i)
        self.install = host.install(i)
        self.grad_sum = host.fp32(f"grad_sum{sum_slot}", i)
        if job.widen:   # a bf16 sum landed in the first half of its fp32 slot
            narrow = self.grad_sum.view(-1).view(torch.bfloat16)[:self.grad_sum.numel()]
            self.grad_sum = narrow.view(self.grad_sum.shape)
        self.row_sq, self.col_sq, self.deferred, self.alpha, self.beta = host.factors(i)
        rows, cols = self.x.shape
        per_block = max(1, ROW_BLOCK // max(1, cols))
        self.blocks = [slice(a, min(rows, a + per_block)) for a in range(0, rows, per_block)]
        self.row_part = torch.empty(rows)
        self.partial = torch.empty(len(self.blocks), cols)   # a row of column sums per block
        self.count = float(self.deferred.sum())

    def _rows(self, t: torch.Tensor, k: int) -> torch.Tensor:
        """Block k's rows of `t` (itself where the matrix is one block: no slice to dispatch)."""
        return t if len(self.blocks) == 1 else t[self.blocks[k]]

    def _mean_and_square(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's mean gradient of block k's rows and its square, in this thread's
        scratch (a bf16 landing is read widened: exact)."""
        s = self._rows(self.grad_sum, k)
        if s.numel() < _SMALL:   # fresh temporaries: fewer operators to dispatch than views
            mean = torch.div(s.float(), self.job.num_grads)
            return mean, mean * mean
        mean, sq = (t[:s.numel()].view(s.shape) for t in thread_scratch(s.numel()))
        if s.dtype == torch.float32:
            torch.div(s, self.job.num_grads, out=mean)
        else:   # widened first: a bf16 division would round the mean to bf16
            mean.copy_(s).div_(self.job.num_grads)
        return mean, torch.mul(mean, mean, out=sq)

    def sums(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first pass on block k; returns its mean and square (this thread's scratch)."""
        mean, sq = self._mean_and_square(k)
        torch.mv(sq, self.deferred, out=self._rows(self.row_part, k))
        torch.sum(sq, 0, out=self.partial[k])
        return mean, sq

    def whole(self) -> None:
        """Both passes of a matrix of one block, its mean and square computed once (finish()
        still to come)."""
        mean, sq = self.sums(0)
        self.residuals()
        self._rest(0, mean, sq)

    def residuals(self) -> None:
        self.vr, self.vc, self.total = _residuals(self.row_sq, self.col_sq, self.row_part,
                                                  self.partial.sum(0), self.job.num_grads)

    def update(self, k: int) -> None:
        self._rest(k, *self._mean_and_square(k))

    def _rest(self, k: int, mean: torch.Tensor, sq: torch.Tensor) -> None:
        """The second pass on block k, from its mean and square."""
        u, x = self.job.update, self._rows(self.x, k)
        msq = _mean_square_(sq, self._rows(self.vr, k), self.vc, self.total)
        m, v = self._rows(self.m, k), self._rows(self.v, k)
        scratch = thread_scratch(m.numel(), SCRATCH) if m.dtype != torch.float32 else ()
        m32, v32 = fp32_moments(m, v, scratch)   # (bf16 ones widened, stored after the step)
        denom = moments_step_(x, mean, msq, m32, v32, self.job.step, self.job.num_grads,
                              lr=u.lr, beta1=u.beta1, beta2=u.beta2, eps=u.eps,
                              weight_decay=u.weight_decay)
        store_moments_(m, v, m32, v32, x, scratch)
        if self.count:
            _log_sums(denom.log_(), self.deferred, self.count, self._rows(self.row_part, k),
                      self.partial[k])
        self._rows(self.install, k).copy_(x)

    def finish(self) -> None:
        if not self.count:   # the host owns no column: no rates
            self.alpha.zero_()
            self.beta.zero_()
            return
        _fit_(self.alpha, self.beta, self.row_part, self.partial.sum(0), self.x.shape[0],
              self.deferred)


def factored_pass(host, jobs: list, sum_slot: int | None) -> None:
    """HostState.update() (`sum_slot` given) or publish() (None) of "factored" jobs: the install
    buffer gets the new values; the factors buffer the new alpha and beta (publish keeps the
    ones there: a load restores them). Matrices go in groups of at least TASKS_PER_LANE blocks
    a worker core, each group in two passes of tasks, a block each (a matrix of one block is
    one task): the cores share out several matrices' blocks at once, while the per-block column
    sums held stay a few matrices' worth."""
    if sum_slot is None:
        host.copy_masters([job.matrix for job in jobs])
        return
    teams = host.lanes if host.lanes is not None else host.teams
    wanted = TASKS_PER_LANE * (sum(teams.threads) if teams is not None else 1)
    group: list[_Matrix] = []
    for n, job in enumerate(jobs):
        group.append(_Matrix(host, job, sum_slot))
        if n == len(jobs) - 1 or sum(len(m.blocks) for m in group) >= wanted:
            _update_group(host, group)
            group = []


def _update_group(host, matrices: list[_Matrix]) -> None:
    blocked = [m for m in matrices if len(m.blocks) > 1]
    _run(host, [partial(m.sums, k) for m in blocked for k in range(len(m.blocks))]
         + [m.whole for m in matrices if len(m.blocks) == 1])
    for m in blocked:
        m.residuals()
    _run(host, [partial(m.update, k) for m in blocked for k in range(len(m.blocks))])
    for m in matrices:
        m.finish()


def _run(host, tasks: list) -> None:
    """`tasks` on the worker's per-core lanes, else its NUMA teams (shared out in turn), else in
    this thread."""
    teams = host.lanes if host.lanes is not None else host.teams
    if teams is None:
        for task in tasks:
            task()
        return
    nodes = len(teams.threads)
    teams.run([tasks[t::nodes] for t in range(nodes)])
