"""The slow, obviously-correct ZenFlow of docs/semantics.md, kept as the tests' oracle.

It shares no code with the fast optimizer. Every matrix keeps full-size fp32 tensors (master
value, moments, gradient sum) and a boolean mask of the columns the device owns; every update is
written out element-wise with plain tensor arithmetic. Decisions that "auto" settings make at
run time can be given to `step()` explicitly, so the reference checks the arithmetic of any
decision sequence.
"""
from __future__ import annotations

import math

import torch


def adamw_update(value, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    """One AdamW update (torch.optim.AdamW's formula), returning new (value, exp_avg, exp_avg_sq)."""
    value = value * (1 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    bias1 = 1 - beta1 ** step
    bias2 = 1 - beta2 ** step
    denom = exp_avg_sq.sqrt() / math.sqrt(bias2) + eps
    value = value - (lr / bias1) * exp_avg / denom
    return value, exp_avg, exp_avg_sq


def factored_window(s, n, lr, beta1, beta2, eps, wd):
    """deferred_credit="factored" at a window end of n gradients (docs/semantics.md): the mean
    square estimated from the window's sum and the row and column sums of its squares, the
    moments as after n AdamW steps, one step of `lr` (n times the group's), and the rate factors
    for the next install (bf16_rules.py's "residual" squares and "factored" rates). Each row
    block (s["blocks"]) is estimated and fitted as if it were the whole matrix."""
    cols = ~s["on_device"]
    mean = s["acc"][:, cols] / n
    sq = mean * mean
    vr = (s["row_sq"] / n - sq.sum(1)).clamp_min(0.0)
    mean_square = torch.empty_like(sq)
    for b, rows in enumerate(s["blocks"]):
        vc = (s["col_sq"][b, cols] / n - sq[rows].sum(0)).clamp_min(0.0)
        mean_square[rows] = sq[rows] + vr[rows, None] * vc[None, :] / vr[rows].sum().clamp_min(1e-30)
    s["host_count"] += n
    b1, b2 = beta1 ** n, beta2 ** n
    m = b1 * s["m"][:, cols] + (1 - b1) * mean
    v = b2 * s["v"][:, cols] + (1 - b2) * mean_square
    denom = v.sqrt() / math.sqrt(1 - beta2 ** s["host_count"]) + eps
    value = s["master"][:, cols] * (1 - lr * wd) - lr / (1 - beta1 ** s["host_count"]) * m / denom
    s["master"][:, cols], s["m"][:, cols], s["v"][:, cols] = value, m, v
    logs = (1 / denom).log()
    a = logs.mean(1)
    s["next_alpha"] = a.exp()
    s["next_beta"] = torch.zeros_like(s["col_sq"])
    for b, rows in enumerate(s["blocks"]):
        if rows.stop > rows.start:   # a block without rows has nothing to fit
            s["next_beta"][b, cols] = (logs[rows] - a[rows, None]).mean(0).exp()
    s["row_sq"].zero_()
    s["col_sq"].zero_()


def factored_install(p, s, lr, bound, correct):
    """An install's factors (beta 0 on the device's columns), and with `correct` the step at them
    for the acc_n gradients summed since the update was handed off, each at most `bound`."""
    s["alpha"] = s["next_alpha"]
    s["beta"] = s["next_beta"].masked_fill(s["on_device"], 0.0)
    if correct and s["acc_n"]:
        current = p.data.reshape(s["master"].shape)
        cols = ~s["on_device"]
        most = s["acc_n"] * bound
        step = (s["acc"][:, cols] * s["alpha"][:, None] * row_betas(s)[:, cols]).clamp(-most, most)
        current[:, cols] = (current[:, cols].float() - lr * step).to(p.dtype)


def row_betas(s):
    """[rows, cols]: each row's column factors (those of its row block)."""
    return s["beta"][s["block_of_row"]]


def row_blocks_of(rows, sizes):
    """(the row ranges of the blocks, the block of each row) for blocks of `sizes` rows."""
    if sum(sizes) != rows or min(sizes) < 0:
        raise ValueError(f"row blocks {sizes} do not split {rows} rows")
    starts = [sum(sizes[:b]) for b in range(len(sizes))]
    blocks = [slice(start, start + n) for start, n in zip(starts, sizes)]
    return blocks, torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))


def rescale(beta, from_step, to_step):
    """Keeps m / (1 - beta^count) unchanged when a moment's count goes from_step -> to_step."""
    if from_step == 0 or to_step == 0:
        return 0.0
    return (1 - beta ** to_step) / (1 - beta ** from_step)


class ReferenceZenFlow:
    """Single param group. `params` are the model's tensors; the reference updates them in place.

    select_interval: reselect at every step that is a multiple of it (after the first
    selection), whatever the windows: the window in progress ends the step before, when some
    matrix has columns that can move (None: never reselect on its own; pass reselect=True to
    step()).
    mean_credit: with deferred_credit="moments" or "factored", the positions in `params` of the matrices that
    take "mean" (their window sums on the host, or no room on the device for the squares and
    rates: `device_sum_budget`).
    row_blocks: with "factored", {position in `params`: the rows of each block} for matrices
    whose factors are fitted per block of rows, each block as if it were the whole matrix (what
    FSDP2's ranks do with their row shards); the others are one block.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 topk_ratio=0.1, update_interval=4, full_warm_up_rounds=0, overlap_step=False,
                 max_grad_norm=None, importance="l2", select_interval=None,
                 deferred_credit="mean", install_lookahead=1.0, mean_credit=(),
                 row_blocks=None):
        self.params = list(params)
        self.lr, (self.beta1, self.beta2), self.eps, self.wd = lr, betas, eps, weight_decay
        self.topk_ratio, self.update_interval = topk_ratio, update_interval
        self.warm_up, self.overlap = full_warm_up_rounds, overlap_step
        self.max_grad_norm, self.importance = max_grad_norm, importance
        self.select_interval = select_interval
        self.deferred_credit = deferred_credit
        self.lookahead = install_lookahead
        self.t = 0
        self.window_steps = 0
        self.selected = False
        self.last_selection = 0
        self.pending = False
        self.skipped = 0
        self.spoiled = False   # a skipped step inside the current window: it is dropped
        self.state = []
        for index, p in enumerate(self.params):
            s = {"master": p.detach().float().clone(), "m": torch.zeros(p.shape),
                 "v": torch.zeros(p.shape)}
            if p.ndim >= 2:
                cols = p.numel() // p.shape[0]
                s.update(master=s["master"].reshape(p.shape[0], cols),
                         m=torch.zeros(p.shape[0], cols), v=torch.zeros(p.shape[0], cols),
                         acc=torch.zeros(p.shape[0], cols), acc_n=0, host_count=0,
                         device_count=0, on_device=torch.zeros(cols, dtype=torch.bool),
                         k=min(cols, math.ceil(topk_ratio * cols)),
                         moments=deferred_credit == "moments" and index not in mean_credit,
                         factored=deferred_credit == "factored" and index not in mean_credit)
                if s["moments"]:   # the squares; the rates, bf16 for 16-bit weights
                    rate_dtype = torch.bfloat16 if p.element_size() == 2 else torch.float32
                    s.update(acc_sq=torch.zeros(p.shape[0], cols),
                             rate=torch.zeros(p.shape[0], cols, dtype=rate_dtype))
                if s["factored"]:  # the squares' row and column sums; the rate factors
                    blocks, block_of_row = row_blocks_of(
                        p.shape[0], (row_blocks or {}).get(index, [p.shape[0]]))
                    s.update(row_sq=torch.zeros(p.shape[0]), alpha=torch.zeros(p.shape[0]),
                             blocks=blocks, block_of_row=block_of_row,   # column sums per block
                             col_sq=torch.zeros(len(blocks), cols),
                             beta=torch.zeros(len(blocks), cols))
            else:
                s["count"] = 0
            self.state.append(s)

    # -- helpers -----------------------------------------------------------------------
    def _write(self, p, s, column_mask=None):
        """Copy the master value into the model parameter (only the masked columns)."""
        if p.ndim < 2:
            p.data.copy_(s["master"].to(p.dtype))
            return
        current = p.data.reshape(s["master"].shape)
        for j in range(current.shape[1]):
            if column_mask is None or column_mask[j]:
                current[:, j] = s["master"][:, j].to(p.dtype)

    def _step_bound(self):
        """AdamW's largest step in units of lr: (1 - beta1) / sqrt(1 - beta2), at least 1."""
        return max(1.0, (1 - self.beta1) / math.sqrt(1 - self.beta2))

    def _install_host_columns(self, correct=False):
        """Write the host's values into the deferred columns. "moments" matrices also take the
        host's rates, and with `correct` (a window end) a momentum-free step at those rates for
        the gradients summed since the update was handed off (the current window's). Only the
        matrices the update covered (that had gradients in its window) are written."""
        for p, s in zip(self.params, self.state):
            if p.ndim < 2 or not s.pop("job", False):
                continue
            if s.get("lookahead"):
                # The weights lead the master by `lookahead` of the step the moments point to.
                bias1 = 1 - self.beta1 ** s["host_count"]
                bias2 = 1 - self.beta2 ** s["host_count"]
                direction = s["v"].sqrt() / math.sqrt(bias2) + self.eps
                direction = s["m"] / direction / bias1 + self.wd * s["master"]
                shown = direction * (-s["lookahead"] * s["last_lr"]) + s["master"]
                self._write(p, dict(master=shown), ~s["on_device"])
            else:
                self._write(p, s, ~s["on_device"])
            if s["factored"]:
                factored_install(p, s, self.lr, self._step_bound(), correct)
            if s["moments"]:
                bias2 = 1 - self.beta2 ** s["host_count"]
                rate = 1 / (s["v"].sqrt() / math.sqrt(bias2) + self.eps)
                if correct and s["acc_n"]:
                    current = p.data.reshape(s["master"].shape)
                    deferred = ~s["on_device"]
                    stored = rate[:, deferred].to(s["rate"].dtype).float()   # as the device holds it
                    # each of the acc_n gradients' steps at most AdamW's largest
                    most = s["acc_n"] * self._step_bound()
                    step = (s["acc"][:, deferred] * stored).clamp(-most, most)
                    moved = current[:, deferred].float() - self.lr * step
                    current[:, deferred] = moved.to(p.dtype)
                s["rate"] = rate.masked_fill(s["on_device"], 0.0).to(s["rate"].dtype)
        self.pending = False

    def synchronize(self):
        """Install a pending update, then the master values themselves (no lookahead)."""
        if self.pending:
            self._install_host_columns()
        for p, s in zip(self.params, self.state):
            if p.ndim >= 2 and not s["on_device"].all():
                self._write(p, s, ~s["on_device"])

    def _choose(self, grad2d, k):
        if grad2d is None:
            return list(range(k))
        if self.importance == "l2":
            scores = [float(grad2d[:, j].double().pow(2).sum().sqrt()) for j in range(grad2d.shape[1])]
        else:
            scores = [float(grad2d[:, j].double().abs().sum()) for j in range(grad2d.shape[1])]
        order = sorted(range(len(scores)), key=lambda j: (-scores[j], j))
        return sorted(order[:k])

    def _select(self, grads, first):
        for p, s, g in zip(self.params, self.state, grads):
            if p.ndim < 2 or s["k"] == 0:
                continue
            chosen = torch.zeros_like(s["on_device"])
            chosen[self._choose(g, s["k"])] = True
            if first:
                s["device_count"] = s["host_count"]
            for j in range(chosen.numel()):
                if chosen[j] and not s["on_device"][j]:      # host -> device
                    s["m"][:, j] *= rescale(self.beta1, s["host_count"], s["device_count"])
                    s["v"][:, j] *= rescale(self.beta2, s["host_count"], s["device_count"])
                elif s["on_device"][j] and not chosen[j]:    # device -> host
                    s["m"][:, j] *= rescale(self.beta1, s["device_count"], s["host_count"])
                    s["v"][:, j] *= rescale(self.beta2, s["device_count"], s["host_count"])
            # The columns the device takes hold the host's values from now on, in the weights too
            # (an installed value may lead them by the lookahead).
            self._write(p, s, chosen & ~s["on_device"])
            s["on_device"] = chosen
        self.selected = True
        self.last_selection = self.t

    def _reselects_at(self, t):
        """Whether select_interval reselects at step t (only once selected, and only if some
        matrix has a column that can move)."""
        movable = any(p.ndim >= 2 and 0 < s["k"] < s["on_device"].numel()
                      for p, s in zip(self.params, self.state))
        return (self.selected and movable and self.select_interval is not None
                and t % self.select_interval == 0 and t > self.last_selection)

    # -- the step ------------------------------------------------------------------------
    def step(self, grads, lr=None, flush=None, reselect=None):
        """grads: one tensor (or None) per param. flush/reselect override the fixed schedule."""
        if lr is not None:
            self.lr = lr
        present = [g.double() for g in grads if g is not None]
        norm = math.sqrt(sum(float((g * g).sum()) for g in present))
        coef = 1.0
        if not math.isfinite(norm):
            self.skipped += 1
            if self.t < self.warm_up or self.window_steps == 0:
                return   # a warm-up step or a window's first step: undone entirely
            # inside a window: a step of it that changes nothing, and the window is dropped
            grads = [None] * len(grads)
            self.spoiled = True
        elif self.max_grad_norm is not None:
            coef = min(1.0, self.max_grad_norm / (norm + 1e-6))
        raw = grads
        grads = [None if g is None else (g.float() * coef) for g in grads]
        grads2d = [None if g is None or p.ndim < 2 else g.reshape(p.shape[0], -1)
                   for p, g in zip(self.params, grads)]

        warming_up = self.t < self.warm_up
        if not warming_up and self.window_steps == 0:
            if not self.selected:
                self._select(grads2d, first=True)
            else:
                due = reselect if reselect is not None else self._reselects_at(self.t)
                if due:
                    if self.pending:
                        self._install_host_columns()
                    self._select(grads2d, first=False)

        # "moments": every value takes a momentum-free step at the host's last rates (the
        # device's columns are written over next).
        for p, s, g in zip(self.params, self.state, raw):
            if g is not None and (s.get("moments") or s.get("factored")):
                current = p.data.reshape(s["master"].shape)
                g = g.reshape(current.shape)
                bound = self._step_bound()   # AdamW's largest step, in units of lr
                if s["factored"]:   # ((g alpha_i) beta_j) c, as the device multiplies
                    step = g.float() * s["alpha"][:, None] * row_betas(s) * coef
                else:
                    step = g.float() * s["rate"].float() * coef
                step = step.clamp(-bound, bound)
                current.copy_((current.float() - self.lr * step).to(p.dtype))

        # Device: vectors, and the device-owned columns of each matrix.
        for p, s, g, g2 in zip(self.params, self.state, grads, grads2d):
            if g is None:
                continue
            if p.ndim < 2:
                s["count"] += 1
                s["master"], s["m"], s["v"] = adamw_update(
                    s["master"], g, s["m"], s["v"], s["count"], self.lr, self.beta1, self.beta2,
                    self.eps, self.wd)
                self._write(p, s)
            elif s["on_device"].any():
                s["device_count"] += 1
                cols = s["on_device"]
                new = adamw_update(s["master"][:, cols], g2[:, cols], s["m"][:, cols],
                                   s["v"][:, cols], s["device_count"], self.lr, self.beta1,
                                   self.beta2, self.eps, self.wd)
                s["master"][:, cols], s["m"][:, cols], s["v"][:, cols] = new
                self._write(p, s, cols)

        # Host: sum the gradients of the columns the host owns (and their squares).
        for p, s, g2 in zip(self.params, self.state, grads2d):
            if g2 is not None and not s["on_device"].all():
                s["acc"][:, ~s["on_device"]] += g2[:, ~s["on_device"]]
                if s.get("moments"):
                    s["acc_sq"][:, ~s["on_device"]] += g2[:, ~s["on_device"]] ** 2
                if s.get("factored"):
                    squares = (g2 * (~s["on_device"]).float()) ** 2
                    s["row_sq"] += squares.sum(1)
                    for b, rows in enumerate(s["blocks"]):
                        s["col_sq"][b] += squares[rows].sum(0)
                s["acc_n"] += 1

        self.window_steps += 1
        ends = flush if (flush is not None and not warming_up) else (
            warming_up or self.window_steps >= self.update_interval
            or self._reselects_at(self.t + 1))
        if ends:
            if self.pending:   # a dropped window's gradients correct nothing either
                self._install_host_columns(correct=not self.spoiled)
            if self.spoiled:
                for s in self.state:
                    if "acc" in s:
                        s["acc"].zero_()
                        s["acc_n"] = 0
                        for key in ("acc_sq", "row_sq", "col_sq"):
                            if key in s:
                                s[key].zero_()
                self.spoiled = False
            for p, s in zip(self.params, self.state):
                if p.ndim < 2 or s["acc_n"] == 0:
                    continue
                n, cols = s["acc_n"], ~s["on_device"]
                # "window" and "moments": the deferred columns move as far as n steps would.
                lr = self.lr * (n if self.deferred_credit == "window" or s["moments"]
                                or s["factored"] else 1)
                s["last_lr"] = lr
                # Only an update installed one window later leads: nothing else is stale.
                # "moments" answers the delay with interim steps instead.
                s["lookahead"] = (self.lookahead if self.overlap and not warming_up
                                  and not (s["moments"] or s["factored"]) else 0.0)
                if s["factored"]:
                    factored_window(s, n, lr, self.beta1, self.beta2, self.eps, self.wd)
                elif s["moments"]:
                    # The moments as after n AdamW steps on the window's mean and mean square;
                    # the count is of gradients.
                    s["host_count"] += n
                    b1, b2 = self.beta1 ** n, self.beta2 ** n
                    m = b1 * s["m"][:, cols] + (1 - b1) * s["acc"][:, cols] / n
                    v = b2 * s["v"][:, cols] + (1 - b2) * s["acc_sq"][:, cols] / n
                    denom = v.sqrt() / math.sqrt(1 - self.beta2 ** s["host_count"]) + self.eps
                    value = s["master"][:, cols] * (1 - lr * self.wd)
                    value = value - lr / (1 - self.beta1 ** s["host_count"]) * m / denom
                    s["master"][:, cols], s["m"][:, cols], s["v"][:, cols] = value, m, v
                    s["acc_sq"].zero_()
                else:
                    s["host_count"] += 1
                    new = adamw_update(s["master"][:, cols], s["acc"][:, cols] / n,
                                       s["m"][:, cols], s["v"][:, cols], s["host_count"], lr,
                                       self.beta1, self.beta2, self.eps, self.wd)
                    s["master"][:, cols], s["m"][:, cols], s["v"][:, cols] = new
                s["acc"].zero_()
                s["acc_n"] = 0
                s["job"] = True
            self.pending = True
            if warming_up or not self.overlap:
                self._install_host_columns()
            self.window_steps = 0
        self.t += 1
