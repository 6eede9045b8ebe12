"""deferred_credit="factored": "moments" in O(rows + cols) of device state beside the window sum
(docs/semantics.md, "Deferred credit"; benchmarks/prototypes/bf16_rules.py measured it).

Per moving matrix [R, C] the device keeps, beside its window sum S (device_sum_dtype: bf16 halves
it), fp32 vectors: the row and column sums of the window's squared clipped gradients over the
columns the host owns (Adafactor's statistics), the rate factors alpha[R] and beta[C] whose
product alpha_i * beta_j stands for the AdamW rate 1 / (sqrt(v_hat) + eps), and the host-owned
columns as a 0/1 mask. 8 R + 12 C bytes: about 0.005 bytes per parameter of a 4096 x 4096 matrix.

Each step the device moves every value by -lr * clamp(c g alpha_i beta_j, -B, B) (beta is 0 on
its own columns, which its update writes over anyway) and adds the squares' row and column sums;
at a window end the host estimates the window's mean square from S and the two sums
(zenflow/host/factored.py), takes the window as n AdamW steps as "moments" does, and fits
alpha and beta to the new rates; an install brings them and corrects the installed values by
-lr * clamp(S alpha_i beta_j, -n B, n B) for the n gradients the host has not applied yet.
Weights are rounded to nearest (the reference does the same, bit for bit).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from zenflow.host.credit_base import MovingCredit, choose_device_summed, chunks_of
from zenflow.host.device_sums import picker
from zenflow.host.factored_kernels import Kernels, factored_step_, factored_steps_

# Matrices a compiled call of factored_steps_ steps: a step's moving matrices go in runs of
# BATCH, in order, and the rest (fewer than BATCH) one call each. A run's compile serves every
# run of the same shapes and dtypes (a model's layers repeat them), so a model compiles a few
# runs of BATCH matrices, not one graph of all of them (on this CPU a run of 64 took 48 s).
BATCH = 16


def factor_bytes(rows: int, cols: int) -> int:
    """Device bytes of a matrix's factored state beside its sum: row sums and alpha (fp32 [R]),
    column sums, beta and the host-owned mask (fp32 [C])."""
    return 8 * rows + 12 * cols


class FactoredCredit(MovingCredit):
    """The window as that many AdamW steps, from factored squares; interim steps and an
    install's correction at factored rates."""

    name = "factored"
    host_factors = True
    fuses = True   # fused_step() may take the compiled kernel
    # the step kernels (factored_kernels.py): a matrix's, a run's
    step_kernels: tuple[Callable, Callable] = (factored_step_, factored_steps_)

    def __init__(self):
        self.row_sq: dict[int, torch.Tensor] = {}    # the window's sums of squares, per row
        self.col_sq: dict[int, torch.Tensor] = {}    # ... per column
        self.alpha: dict[int, torch.Tensor] = {}     # rate factors, per row
        self.moving = self.alpha
        self._alpha_column: dict[int, torch.Tensor] = {}   # the same as [R, 1] views
        self.beta: dict[int, torch.Tensor] = {}      # ... per column, 0 on the device's columns
        self.deferred: dict[int, torch.Tensor] = {}  # 1.0 on the columns the host owns
        self._owned: dict[int, torch.Tensor | None] = {}   # as told, before or after placing
        self._restored: dict[int, tuple] = {}         # loaded before placed
        self._from_sum: dict[int, tuple] = {}        # a window summed without the statistics
        self._placed = False
        self._kernels = Kernels()   # compiled for the device by allocate()
        self.fused_steps = 0        # matrix steps the compiled kernel took (stats())
        self._correct_prints: tuple[list[int], torch.Tensor] | None = None   # the last correct()'s
        self._prints: tuple[list[int], torch.Tensor] | None = None   # the last fused_step's

    def place(self, numels, budget_bytes, sum_bytes, dtypes, shapes):
        """Every sum first (in device_sum_dtype), then the factored state of as many of those
        as the rest of the budget holds, in order."""
        summed = choose_device_summed(numels, budget_bytes, sum_bytes)
        spare = budget_bytes - sum_bytes * sum(numels[i] for i in summed)
        chosen = set(summed)
        moving = choose_device_summed(
            [self.state_bytes(i, *shapes[i]) if i in chosen else 0 for i in range(len(numels))],
            spare, 1)
        return summed, moving

    def state_bytes(self, i: int, rows: int, cols: int) -> int:
        """Device bytes of matrix i's factored state beside its sum (`rows`: this rank's)."""
        return factor_bytes(rows, cols)

    def allocate(self, moving, device):
        def zeros(*shape):
            return torch.zeros(shape, dtype=torch.float32, device=device)
        for i, (rows, cols, _) in moving.items():
            self.row_sq[i], self.col_sq[i] = zeros(rows), zeros(cols)
            alpha_shape, beta_shape = self.factor_shapes(i, rows, cols)
            self.alpha[i], self.beta[i] = zeros(*alpha_shape), zeros(*beta_shape)
            self._alpha_column[i] = self.alpha[i].unsqueeze(1)   # [R, 1]: broadcast per row
            self.deferred[i] = torch.ones(cols, dtype=torch.float32, device=device)
        self._placed = True
        self._kernels = Kernels()
        if moving and self.fuses:
            self._kernels.compile(len(moving), device, *self.step_kernels, batch=BATCH)
        for i, values in self._restored.items():
            if i in self.alpha:
                for dst, src in zip(self._device(i), values):
                    dst.copy_(src)
        self._restored = {}
        for i in moving:
            self._mask(i)

    def factor_shapes(self, i: int, rows: int, cols: int) -> tuple[tuple[int, ...], ...]:
        """The shapes of matrix i's alpha and beta on the device (`rows`: this rank's)."""
        return (rows,), (cols,)

    def own_factors(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device's alpha of this rank's rows and beta of its row block: its whole alpha
        and beta but under DDP (zenflow/host/credit_replicas.py)."""
        return self.alpha[i], self.beta[i]

    def _device(self, i: int) -> tuple[torch.Tensor, ...]:
        """What this rank's state holds of matrix i's device state (saved, loaded)."""
        return self.row_sq[i], self.col_sq[i], *self.own_factors(i)

    def nbytes(self):
        return sum(t.numel() * t.element_size() for part in
                   (self.row_sq, self.col_sq, self.alpha, self.beta, self.deferred)
                   for t in part.values())

    def owned_columns(self, i, columns):
        self._owned[i] = None if columns is None else columns.detach().clone()
        self._mask(i)

    def _mask(self, i: int) -> None:
        """The host-owned mask of matrix i from the columns told, and a window restored without
        the statistics estimated from its sum (it needs the mask)."""
        if i not in self.deferred:
            return
        mask = self.deferred[i].fill_(1.0)
        owned = self._owned.get(i)
        if owned is not None and owned.numel():
            mask.index_fill_(0, owned.to(mask.device), 0.0)
        if i in self._from_sum:
            # Saved where this matrix took another rule: no statistics were summed. Take every
            # gradient of the window as its mean, as "moments" does (credit.py): the least the
            # squares can be.
            grad_sum, n = self._from_sum.pop(i)
            squares = grad_sum.to(mask.device, torch.float32).square().div_(n) * mask
            self.row_sq[i].copy_(squares.sum(1))
            self.col_sq[i].copy_(squares.sum(0))

    def add(self, rows, fresh, coef):
        """The row and column sums of (coef * g)^2 over the host's columns: the fp32 product,
        masked, squared (as the reference)."""
        summed = self.moving_among(rows)
        if not summed:
            return
        zeroed = [t for i in fresh if i in self.row_sq for t in (self.row_sq[i], self.col_sq[i])]
        if zeroed:
            torch._foreach_zero_(zeroed)
        for chunk in chunks_of(summed, rows):
            pick = picker(chunk)
            scaled = torch._foreach_mul(list(map(torch.Tensor.float, pick(rows))), coef)
            torch._foreach_mul_(scaled, list(pick(self.deferred)))
            torch._foreach_mul_(scaled, scaled)
            torch._foreach_add_(list(pick(self.row_sq)), [sq.sum(1) for sq in scaled])
            torch._foreach_add_(list(pick(self.col_sq)), [sq.sum(0) for sq in scaled])

    def fused_step(self, rows, whole, sums, weights, fresh, coef, sizes):
        """The sum's add, add() and interim() of the moving matrices of `rows` in the kernels
        allocate() compiled (runs of BATCH matrices a call, the rest a call each), with the moved
        columns' fingerprints (take_prints()); returns the indices taken (the caller leaves out
        their three steps). A failed run's matrices go to their own kernels, a failed matrix's
        kernel leaves the rest to the op-by-op path: logged once, and so from then on."""
        taken: set[int] = set()
        if "step" not in self._kernels:
            return taken
        moving = self.moving_among(rows)
        zeroed = [t for i in fresh if i in self.row_sq
                  for t in (sums[i], self.row_sq[i], self.col_sq[i])]
        if zeroed:   # (a fallback's op-by-op add zeroes the fresh sums it takes again)
            torch._foreach_zero_(zeroed)
        prints = torch.empty((len(moving), 2), dtype=torch.int32, device=coef.device)
        start = 0   # moving[:start] taken by runs of BATCH
        while "steps" in self._kernels and start + BATCH <= len(moving) and self._run_batch(
                moving[start:start + BATCH], rows, whole, sums, weights, coef, sizes,
                prints[start:start + BATCH]):
            start += BATCH
        taken.update(moving[:start])
        for j in range(start, len(moving)):
            i = moving[j]
            tensors = (c[0] for c in self.step_columns(picker([i]), rows, whole, sums, weights))
            if not self._kernels.run("step", *tensors, coef,
                                     *self._kernels.scalars_of(*sizes[i], coef.device), prints[j]):
                break
            taken.add(i)
        self.fused_steps += len(taken)
        self._prints = (moving[:len(taken)], prints[:len(taken)])
        return taken

    def step_columns(self, pick, rows, whole, sums, weights) -> tuple[Sequence, ...]:
        """The step kernels' tensors, by kind, of the matrices `pick` takes (a picker of host
        indices, which picks from `weights`, a list by host index, and each dict): the
        weights, this rank's rows of each gradient (every row the device holds: `whole`), the
        sums, statistics, factors and host-column masks."""
        return (pick(weights), pick(rows), pick(sums), pick(self.row_sq), pick(self.col_sq),
                pick(self.alpha), pick(self.beta), pick(self.deferred))

    def _run_batch(self, moving, rows, whole, sums, weights, coef, sizes, prints) -> bool:
        """The run kernel of the run `moving`; False where its compile failed (then logged once
        and the per-matrix kernels take every matrix, now and from then on)."""
        pick = picker(moving)
        return self._kernels.run_steps(moving, self.step_columns(pick, rows, whole, sums, weights),
                                       pick(sizes), coef, prints)

    @property
    def prints_moves(self) -> bool:
        return "step" in self._kernels

    def take_prints(self):
        prints, self._prints = self._prints, None
        return prints

    def correct(self, weights, sums, sizes, counts):
        """MovingCredit.correct in the compiled kernels where allocate() compiled them
        (Kernels.run_corrections), the rest op by op; the kernels fingerprint what they
        corrected (take_correct_prints())."""
        self._correct_prints = None
        indices = list(weights)
        if not indices:
            return
        done, prints = self._kernels.run_corrections([
            (weights[i], sums[i], *self.own_factors(i), *self._kernels.scalars_of(
                sizes[i][0], counts[i] * sizes[i][1], weights[i].device), self.deferred[i])
            for i in indices], BATCH)
        if done:
            self._correct_prints = (indices[:done], prints[:done])
        rest = {i: weights[i] for i in indices[done:]}
        if rest:
            super().correct(rest, sums, sizes, counts)

    def take_correct_prints(self):
        prints, self._correct_prints = self._correct_prints, None
        return prints

    def rated(self, values, chunk):
        """(values alpha_i) beta_j, new fp32 tensors."""
        pick = picker(chunk)
        moves = torch._foreach_mul(values, list(pick(self._alpha_column)))
        torch._foreach_mul_(moves, list(pick(self.beta)))
        return moves

    def clear(self):
        if self.row_sq:
            torch._foreach_zero_([*self.row_sq.values(), *self.col_sq.values()])

    def copy_out(self, matrices, host, sum_slot):
        pairs = []
        for i in matrices:
            if i in self.row_sq:
                row_sq, col_sq, deferred, _, _ = host.factors(i)
                pairs += [(row_sq, self.row_sq[i]), (col_sq, self.col_sq[i]),
                          (deferred, self.deferred[i])]
        return pairs

    def install_pairs(self, i, host):
        if i not in self.alpha:
            return []
        _, _, _, alpha, beta = host.factors(i)
        return [(self.alpha[i], alpha), (self.beta[i], beta)]

    def device_owns(self, i, columns):
        if i in self.beta:   # its last dimension is the columns (DDP: one row per rank's block)
            self.beta[i].index_fill_(-1, columns, 0.0)

    @property
    def interim_taken(self):
        return bool(self.alpha)

    # -- checkpoints ----------------------------------------------------------------------------
    def saved(self, i, like):
        """No per-value squares; the rates as the device applies them, alpha_i * beta_j (what
        "moments" loads as its rates)."""
        factors = None
        if i in self.alpha:
            factors = tuple(t.cpu() for t in self.own_factors(i))
        elif i in self._restored:
            factors = self._restored[i][2:]
        if factors is None:
            return super().saved(i, like)
        return torch.zeros_like(like), torch.outer(*factors).to(like.dtype)

    def saved_factors(self, i, host, num_grads):
        """"row_factors" [3, R]: the window's row sums of squares, the device's alpha, the
        host's (an update in flight installs it); "col_factors" [3, C] likewise."""
        if i in self.alpha:
            device = [t.to("cpu", copy=True) for t in self._device(i)]
        elif i in self._restored:
            device = [t.clone() for t in self._restored[i]]
        else:
            return {}
        if not num_grads:   # stale sums of an ended window
            device[0].zero_()
            device[1].zero_()
        _, _, _, alpha, beta = host.factors(i)
        return {"row_factors": torch.stack([device[0], device[2], alpha.clone()]),
                "col_factors": torch.stack([device[1], device[3], beta.clone()])}

    def load_factors(self, i, piece, host):
        rows, cols = piece.get("row_factors"), piece.get("col_factors")
        if rows is None or cols is None:
            # Saved where this matrix took another rule: no rates until the next install (as a
            # state older than the rates), and the window's statistics from its sum once the
            # loaded selection says which columns are the host's (owned_columns()).
            zero_rows, zero_cols = (torch.zeros_like(t) for t in host.factors(i)[:2])
            values = (zero_rows, zero_cols, zero_rows, zero_cols)
            if piece["num_grads"]:
                self._from_sum[i] = (piece["grad_sum"].clone(), piece["num_grads"])
        else:
            _, _, _, alpha, beta = host.factors(i)
            alpha.copy_(rows[2])
            beta.copy_(cols[2])
            values = (rows[0].clone(), cols[0].clone(), rows[1].clone(), cols[1].clone())
            self._from_sum.pop(i, None)
        if i in self.alpha:
            for dst, src in zip(self._device(i), values):
                dst.copy_(src)
        elif not self._placed:
            self._restored[i] = values
