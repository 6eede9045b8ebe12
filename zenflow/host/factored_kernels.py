"""deferred_credit="factored"'s device work on a moving matrix, written eagerly with the op-by-op
path's operators (so that run eagerly they give its bits): a step (the window sum's add, the
squares' row and column sums, the interim step at factored rates) and an install's correction,
each for one matrix and for a list of them. host/credit_factored.py runs them, compiled for the
device where host/compiled.py can (one fused kernel a matrix, or a call for a run of them), else
eagerly."""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from zenflow.host.compiled import compiled_for, scalar
from zenflow.host.fingerprints import masked_bit_sum

log = logging.getLogger("zenflow")


def factored_step_(weight: torch.Tensor, grad: torch.Tensor, grad_sum: torch.Tensor,
                    row_sq: torch.Tensor, col_sq: torch.Tensor, alpha: torch.Tensor,
                    beta: torch.Tensor, host_cols: torch.Tensor, coef: torch.Tensor,
                    neg_lr: torch.Tensor, bound: torch.Tensor,
                    prints: torch.Tensor | None = None) -> None:
    """One step of one moving matrix ([R, C] `weight`, `grad`, `grad_sum`), everything the op-by-op
    path does to it in a step, in its order and arithmetic: the window sum's add
    (buffers.add_scaled_), the squares' row and column sums over the host's columns (add) and the
    interim step at factored rates (MovingCredit.interim, with kept() and bounded_step()), each
    with the op-by-op path's operators, so that run eagerly it gives their bits. `neg_lr` (minus
    the learning rate) and `bound` are 0-dim tensors (compiled.scalar). Compiled (compiled.py)
    it reads the gradient three times (its row sums, its column sums, the pointwise pass) and
    the sum and the weights once, and writes those two once: 14 bytes a bf16 value where the
    op-by-op path moves about 100 (zenflow/tools/estimate_terms.py counts both).
    `prints` ([2] int32): the host's columns' fingerprints (fingerprints.masked_bit_sum) before
    and after the move, taken in the same pass, where zenflow/optim/outside_writes.py would
    read the matrix twice more."""
    _moving_step_(weight, grad, grad, grad_sum, row_sq, col_sq, alpha, beta, host_cols, coef,
                  neg_lr, bound, prints)


def replica_step_(weight: torch.Tensor, grad: torch.Tensor, own: torch.Tensor,
                  grad_sum: torch.Tensor, row_sq: torch.Tensor, col_sq: torch.Tensor,
                  alpha: torch.Tensor, beta: torch.Tensor, block_of_row: torch.Tensor,
                  host_cols: torch.Tensor, coef: torch.Tensor, neg_lr: torch.Tensor,
                  bound: torch.Tensor, prints: torch.Tensor | None = None) -> None:
    """factored_step_ on a DDP replica (host/credit_replicas.py): the window sum and the
    squares' sums take this rank's rows (`own`, a row block of `grad`, as `grad_sum` and
    `row_sq` are), the interim step moves every row of the replica, each rank's row block at
    its own factors (`alpha` [R]; `beta` [ranks, C], `block_of_row` [R] the rank whose block
    each row is in), as ReplicaFactoredCredit.rated() does op by op."""
    _moving_step_(weight, grad, own, grad_sum, row_sq, col_sq, alpha,
                  beta.index_select(0, block_of_row), host_cols, coef, neg_lr, bound, prints)


def _moving_step_(weight, grad, own, grad_sum, row_sq, col_sq, alpha, beta, host_cols, coef,
                  neg_lr, bound, prints) -> None:
    """The arithmetic both take: the sums of `own` rows, the move of every row of `weight` at
    (grad alpha_i) beta_j, `beta` [C] or [R, C]."""
    if prints is not None:
        before = masked_bit_sum(weight, host_cols)
    c = coef.reshape(1)   # 1-element: fp32 arithmetic beside bf16 (buffers.add_scaled_)
    grad_sum.addcmul_(own, c)
    scaled = own.float() * c * host_cols
    squares = scaled * scaled
    row_sq.add_(squares.sum(1))
    col_sq.add_(squares.sum(0))
    kept = torch.where(coef != 0, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
    move = (kept.float() * alpha.unsqueeze(1)) * beta * coef
    move = move.clamp(-bound, bound)
    weight.addcmul_(move, neg_lr)
    if prints is not None:
        prints.copy_(torch.stack([before, masked_bit_sum(weight, host_cols)]))


def factored_steps_(weights: list[torch.Tensor], grads: list[torch.Tensor],
                     grad_sums: list[torch.Tensor], row_sqs: list[torch.Tensor],
                     col_sqs: list[torch.Tensor], alphas: list[torch.Tensor],
                     betas: list[torch.Tensor], host_cols: list[torch.Tensor], coef: torch.Tensor,
                     neg_lrs: list[torch.Tensor], bounds: list[torch.Tensor],
                     prints: torch.Tensor) -> None:
    """factored_step_ of every matrix of the lists (prints: [n, 2]), in one call. Compiled, a
    step's matrices cost one guard check and one call, not one each: on a GPU the per-matrix
    calls took about 0.25 ms of the Python thread each, which at 170 matrices was a third of a
    1.35B model's step (benchmarks/results/profile-step-nvidia-h100-80gb-hbm3.json)."""
    for j, weight in enumerate(weights):
        factored_step_(weight, grads[j], grad_sums[j], row_sqs[j], col_sqs[j], alphas[j],
                       betas[j], host_cols[j], coef, neg_lrs[j], bounds[j], prints[j])


def replica_steps_(weights: list[torch.Tensor], grads: list[torch.Tensor],
                   owns: list[torch.Tensor], grad_sums: list[torch.Tensor],
                   row_sqs: list[torch.Tensor], col_sqs: list[torch.Tensor],
                   alphas: list[torch.Tensor], betas: list[torch.Tensor],
                   blocks_of_rows: list[torch.Tensor], host_cols: list[torch.Tensor],
                   coef: torch.Tensor, neg_lrs: list[torch.Tensor], bounds: list[torch.Tensor],
                   prints: torch.Tensor) -> None:
    """replica_step_ of every matrix of the lists (prints: [n, 2]), in one call."""
    for j, weight in enumerate(weights):
        replica_step_(weight, grads[j], owns[j], grad_sums[j], row_sqs[j], col_sqs[j], alphas[j],
                      betas[j], blocks_of_rows[j], host_cols[j], coef, neg_lrs[j], bounds[j],
                      prints[j])


def factored_correct_(weight: torch.Tensor, grad_sum: torch.Tensor, alpha: torch.Tensor,
                      beta: torch.Tensor, neg_lr: torch.Tensor, most: torch.Tensor,
                      host_cols: torch.Tensor, prints: torch.Tensor) -> None:
    """An install's correction of one matrix (MovingCredit.correct at rated()'s rates: the
    window sum's (S alpha_i) beta_j, each at most `most`), with the op-by-op path's operators.
    Compiled: the sum read and the weights read and written once (6 bytes a bf16 value, where the
    op-by-op path moves about 46). `prints` (0-dim int32): the host's columns' fingerprint
    (fingerprints.masked_bit_sum) of the corrected values, taken in the same pass, where
    zenflow/optim/outside_writes.py would read the matrix again."""
    move = (grad_sum.float() * alpha.unsqueeze(1)) * beta
    weight.addcmul_(move.clamp(-most, most), neg_lr)
    prints.copy_(masked_bit_sum(weight, host_cols))


def factored_corrects_(weights: list[torch.Tensor], grad_sums: list[torch.Tensor],
                        alphas: list[torch.Tensor], betas: list[torch.Tensor],
                        neg_lrs: list[torch.Tensor], mosts: list[torch.Tensor],
                        host_cols: list[torch.Tensor], prints: torch.Tensor) -> None:
    """factored_correct_ of every matrix of the lists (prints: [n]), in one call (an install's
    corrections in runs of BATCH, as factored_steps_ takes a step's)."""
    for j, weight in enumerate(weights):
        factored_correct_(weight, grad_sums[j], alphas[j], betas[j], neg_lrs[j], mosts[j],
                          host_cols[j], prints[j])


class Kernels:
    """The functions above compiled for the device (zenflow/host/compiled.py): "step" and
    "correct" a matrix, "steps" and "corrects" a run of credit_factored.BATCH; and the scalars
    their calls take. A failed kernel is logged once and dropped: a run's alone (its matrices' own kernels
    take them), a matrix's with every other (the op-by-op path runs from then on)."""

    def __init__(self):
        self._compiled: dict[str, Callable] = {}
        self._scalars: dict[tuple[float, float], tuple[torch.Tensor, torch.Tensor]] = {}
        self._signatures: dict[tuple, tuple] = {}   # run_steps', by run and strides

    def compile(self, moving: int, device: torch.device, step: Callable = factored_step_,
                steps: Callable = factored_steps_, batch: int = 16) -> None:
        """The kernels for `moving` matrices on `device` (none outside compiled.COMPILE_ON);
        `step`, `steps`: a matrix's step and a run's (DDP's replicas take their own), the
        run's where `moving` holds a run of `batch`."""
        self._compiled = {}
        for name, fn in (("step", step), ("correct", factored_correct_)):
            kernel = compiled_for(fn, device)
            if kernel is not None:
                self._compiled[name] = kernel
        if moving >= batch and "step" in self._compiled:
            self._compiled["steps"] = compiled_for(steps, device, batch=True)
            self._compiled["corrects"] = compiled_for(factored_corrects_, device, batch=True)

    def __contains__(self, name: str) -> bool:
        return name in self._compiled

    def run(self, name: str, *args, **kwargs) -> bool:
        """Kernel `name` on `args` if it is compiled; False where it is not, or it failed."""
        kernel = self._compiled.get(name)
        if kernel is None:
            return False
        try:
            kernel(*args, **kwargs)
        except Exception as exc:   # noqa: BLE001 - any compiler failure: fall back, loudly
            batch = isinstance(args[0], list)   # a run's kernel: its first argument a list
            first = args[0][0] if batch else args[0]
            log.warning("deferred_credit='factored': the compiled %s failed on %s (%s: %s); %s "
                        "runs instead from now on", name, first.device, type(exc).__name__, exc,
                        "a kernel a matrix" if batch else "the op-by-op path")
            if batch:
                del self._compiled[name]
            else:
                self._compiled = {}
            return False
        return True

    def run_steps(self, moving: list[int], columns: tuple[Sequence, ...],
                  steps: Sequence[tuple[float, float]], coef: torch.Tensor,
                  prints: torch.Tensor) -> bool:
        """The run kernel ("steps") on the run `moving`: its tensors by kind (`columns`, the
        gradients second), each matrix's (lr, bound) (`steps`). Its shapes are compiled in
        (`signature`, where the weight's give the others'), kept while the gradients' strides
        stay; the scalars are one pair for the run where its matrices share them."""
        key = (tuple(moving), tuple(map(torch.Tensor.stride, columns[1])))
        signature = self._signatures.get(key)
        if signature is None:
            if len(self._signatures) > 4096:
                self._signatures.clear()
            signature = self._signatures[key] = tuple(
                (tuple(t[0].shape), *(u.dtype for u in t[:4]), tuple(t[1].stride()))
                for t in zip(*columns))
        device = coef.device
        if len(set(steps)) == 1:
            lrs, bounds = ([s] * len(moving) for s in self.scalars_of(*steps[0], device))
        else:
            scalars = [self.scalars_of(*s, device) for s in steps]
            lrs, bounds = [lr for lr, _ in scalars], [bound for _, bound in scalars]
        return self.run("steps", *map(list, columns), coef, lrs, bounds, prints,
                        signature=signature)

    def run_corrections(self, items: list[tuple], batch: int) -> tuple[int, torch.Tensor]:
        """The corrections of `items` (factored_correct_'s arguments but its print, a matrix
        each) in the compiled kernels: runs of `batch` matrices a call and the rest as one run
        (an install of one layer's matrices: the same run at every layer of a model that repeats
        them), a matrix alone a call of its own (a failed run's fallback). Returns how many were
        corrected, the first of `items` (once a kernel fails none is left for the rest), and the
        prints (int32 [len(items)], set for those)."""
        prints = torch.empty(len(items), dtype=torch.int32, device=items[0][0].device)
        start = 0
        while "corrects" in self and len(items) - start >= 2:
            run = items[start:start + batch]
            if not self.run("corrects", *map(list, zip(*run)), prints[start:start + len(run)],
                            signature=tuple((tuple(w.shape), w.dtype, s.dtype)
                                            for w, s, *_ in run)):
                break
            start += len(run)
        while start < len(items) and self.run("correct", *items[start], prints[start]):
            start += 1
        return start, prints

    def scalars_of(self, lr: float, bound: float, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(-lr, bound) as device scalars, made again only when they change (a scheduler's lr,
        a correction's bound for its count)."""
        found = self._scalars.get((lr, bound))
        if found is None:
            if len(self._scalars) > 32:
                self._scalars.clear()
            found = self._scalars[lr, bound] = (scalar(-lr, device), scalar(bound, device))
        return found
