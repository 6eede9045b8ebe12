"""Deferred-credit rules for bf16 weights in a small device budget (issue 36, item 2; research code).

Not the package: a plain, single-process simulation of ZenFlow's arithmetic on one parameter group
(k = ceil(0.1 cols) columns per matrix chosen once, at the first step, by the L2 norm of their
clipped gradient; fixed windows of U steps; each window's host update installed at the end of the
next; `max_grad_norm` clipping; vectors by AdamW on fp32 masters every step), in which the
deferred-credit rule is a set of settings. It runs as a system of benchmarks/finetune_quality.py
(kind "prototype"), so its numbers sit beside the package's on the same baseline:

    python benchmarks/finetune_quality.py --dtype bf16 --systems OffloadAdamW "proto moments"

With `CANDIDATES["moments"]` it computes what the package's deferred_credit="moments" computes
(docs/semantics.md; the reference's arithmetic, step by step), except that the package may
choose the columns again when they drift.

What the device keeps for a deferred matrix is in `Matrix.device` (a dict of tensors) and nothing
else on the device side reads host state: `device_bytes()` counts it, per deferred parameter.
What crosses the bus per window is counted by the rule as it crosses (`bus_bytes`).

Settings (keyword arguments of `make_rule`; `CANDIDATES` names the measured ones):
  U           window length in steps
  host        "moments": the host's m and v as after n AdamW steps on the window (from the
              window's mean and an estimate of its mean square), one step of n * lr (the
              package's "moments"); "mean": one AdamW step on the mean gradient (with
              `lookahead`, the package's "mean")
  sum_dtype   the device's window sum: "fp32", "bf16" (rounded to nearest after each add, as
              the package's device_sum_dtype="bfloat16") or "bf16_sr" (rounded stochastically)
  squares     what the host's second moment takes as the window's mean square:
              "full"      the per-element sum of squares, fp32 on the device (4 bytes)
              "adafactor" row and column sums of the squares on the device (O(rows + cols),
                          Adafactor's statistics), estimate R_i C_j / sum(R)
              "residual"  the same sums; estimate (S_ij / n)^2 + (the part of the squares the mean
                          does not explain, factored): Vr_i Vc_j / sum(Vr), Vr_i = R_i / n -
                          sum_j (S_ij / n)^2 and Vc_j likewise; exact where the window's gradients
                          are equal, and where n = 1
              "mean"      (S / n)^2: nothing but the sum
  rates       the per-value AdamW rates r = 1 / (sqrt(v_hat) + eps) the device steps with:
              "full"      per element, bf16 (2 bytes; the package's)
              "factored"  exp(a_i + b_j): the least-squares fit of log r over the deferred
                          columns, rows + cols fp32 numbers sent by the host
              "scalar"    one number per matrix, exp(mean log r)
              "none"      no rates: no interim steps, no install correction
  motion      whether the device moves the deferred values every step by -lr * clamp(c g r)
  correct     whether an install lowers the installed values by lr * clamp(S_now r) for the
              gradients summed since its update was handed off
  rounding    how those device steps land in bf16 weights: "nearest" (the package's), or
              "stochastic" (unbiased: each value rounds up with probability equal to the
              fraction of an ulp it is past the lower neighbour)
  lookahead   ("mean") install x - f * lr * (next AdamW direction), as install_lookahead
"""
from __future__ import annotations

import math

import torch

BF16 = torch.bfloat16


def round_to(x: torch.Tensor, dtype: torch.dtype, mode: str, gen: torch.Generator | None):
    """fp32 `x` in `dtype`: to nearest, or stochastically for bf16 (add 16 random low bits to the
    fp32 pattern and truncate: unbiased in magnitude, so in value)."""
    if dtype != BF16 or mode == "nearest":
        return x.to(dtype)
    bits = x.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=gen, dtype=torch.int32)
    return ((bits + noise) & -65536).view(torch.float32).to(dtype)   # exact: low bits are 0


class Matrix:
    """One matrix: the host's fp32 state (all columns) and what the device keeps for it."""

    def __init__(self, p: torch.Tensor, rule: Rule):
        self.p, self.rule = p, rule
        rows = p.shape[0]
        self.x = p.detach().float().reshape(rows, -1).clone()     # master values (host/device)
        self.m, self.v = torch.zeros_like(self.x), torch.zeros_like(self.x)
        cols = self.x.shape[1]
        self.k = math.ceil(rule.k_ratio * cols)
        self.on_device = None                     # bool[cols], chosen at the first step
        self.host_count = self.device_count = 0
        self.n = 0                                # gradients in the window's sum
        self.pending = None                       # an update handed off: (values, rates, lr)
        self.device: dict[str, torch.Tensor] = {}  # the deferred rule's device state
        rs = rule.settings
        self.device["sum"] = torch.zeros_like(self.x, dtype=torch.float32
                                              if rs["sum_dtype"] == "fp32" else BF16)
        if rs["squares"] == "full":
            self.device["squares"] = torch.zeros_like(self.x)
        elif rs["squares"] in ("adafactor", "residual"):
            self.device["row_squares"] = torch.zeros(rows)
            self.device["col_squares"] = torch.zeros(cols)
        if rs["rates"] == "full":
            self.device["rates"] = torch.zeros_like(self.x, dtype=BF16)
        elif rs["rates"] == "factored":
            self.device["row_rates"] = torch.zeros(rows)   # exp(a_i)
            self.device["col_rates"] = torch.zeros(cols)   # exp(b_j), 0 on the device's columns
        elif rs["rates"] == "scalar":
            self.device["rate"] = torch.zeros(())

    @property
    def view(self) -> torch.Tensor:
        return self.p.data.view(self.x.shape)

    def deferred_numel(self) -> int:
        return self.x.shape[0] * (self.x.shape[1] - self.k)

    def rates(self) -> torch.Tensor | None:
        """The device's rates as a full fp32 matrix (0 on the device's columns), or None."""
        d = self.device
        if "rates" in d:
            return d["rates"].float()
        if "row_rates" in d:
            return d["row_rates"][:, None] * d["col_rates"][None, :]
        if "rate" in d:
            return d["rate"] * (~self.on_device).float().expand_as(self.x)
        return None


class Rule(torch.optim.Optimizer):
    def __init__(self, params, lr, weight_decay, betas=(0.9, 0.999), eps=1e-8,
                 max_grad_norm=1.0, k_ratio=0.1, seed=0, **settings):
        super().__init__(list(params), dict(lr=lr, betas=betas, eps=eps,
                                            weight_decay=weight_decay))
        defaults = dict(U=4, host="moments", sum_dtype="fp32", squares="full", rates="full",
                        motion=True, correct=True, rounding="nearest", lookahead=0.0)
        unknown = set(settings) - set(defaults)
        if unknown:
            raise TypeError(f"unknown settings {sorted(unknown)}")
        self.settings = {**defaults, **settings}
        self.k_ratio, self.max_grad_norm = k_ratio, max_grad_norm
        self.b1, self.b2 = betas
        self.eps, self.wd = eps, weight_decay
        self.bound = max(1.0, (1 - self.b1) / math.sqrt(1 - self.b2))   # AdamW's largest step
        self.gen = torch.Generator().manual_seed(1000 + seed)
        self.matrices, self.vectors = [], []
        for p in self.param_groups[0]["params"]:
            if p.ndim >= 2:
                self.matrices.append(Matrix(p, self))
            else:
                x = p.detach().float().clone()
                self.vectors.append(dict(p=p, x=x, m=torch.zeros_like(x),
                                         v=torch.zeros_like(x), count=0))
        self.window_steps = 0
        self.windows = 0
        self.bus_bytes = 0          # deferred matrices' bytes over the bus, both ways
        self.device_passes = 0      # passes over the deferred matrices the rule adds per step

    # -- arithmetic --------------------------------------------------------------------------
    def adamw(self, x, g, m, v, count, lr, g_sq=None, b1=None, b2=None):
        b1u, b2u = (self.b1 if b1 is None else b1), (self.b2 if b2 is None else b2)
        x = x * (1 - lr * self.wd)
        m = b1u * m + (1 - b1u) * g
        v = b2u * v + (1 - b2u) * (g * g if g_sq is None else g_sq)
        denom = v.sqrt() / math.sqrt(1 - self.b2 ** count) + self.eps
        return x - lr / (1 - self.b1 ** count) * m / denom, m, v

    def round(self, x):
        return round_to(x, BF16, self.settings["rounding"], self.gen)

    def write(self, mat: Matrix, values: torch.Tensor, columns: torch.Tensor) -> None:
        """Values (fp32) into the weights' columns, rounded to nearest (the host's values)."""
        mat.view[:, columns] = values[:, columns].to(mat.p.dtype)

    def step_weights(self, mat: Matrix, step: torch.Tensor, lr: float) -> None:
        """weights -= lr * step on the deferred columns, computed in fp32 and rounded once."""
        deferred = ~mat.on_device
        moved = mat.view[:, deferred].float() - lr * step[:, deferred]
        mat.view[:, deferred] = (self.round(moved) if mat.p.dtype == BF16
                                 else moved.to(mat.p.dtype))

    # -- the host's side ------------------------------------------------------------------------
    def mean_square(self, mat: Matrix, mean: torch.Tensor, n: int) -> torch.Tensor:
        """The window's mean square of the deferred columns' gradients, as the host estimates
        it from what the device sent."""
        how, d = self.settings["squares"], mat.device
        deferred = ~mat.on_device
        if how == "full":
            return d["squares"][:, deferred] / n
        if how == "mean":
            return mean * mean
        rows, cols = d["row_squares"] / n, d["col_squares"][deferred] / n
        if how == "adafactor":
            return rows[:, None] * cols[None, :] / rows.sum().clamp_min(1e-30)
        sq = mean * mean                                  # "residual"
        vr = (rows - sq.sum(1)).clamp_min(0.0)
        vc = (cols - sq.sum(0)).clamp_min(0.0)
        return sq + vr[:, None] * vc[None, :] / vr.sum().clamp_min(1e-30)

    def host_update(self, mat: Matrix, lr: float) -> None:
        """The window's update of the deferred columns, handed off (installed at the next end)."""
        rs, d, n = self.settings, mat.device, mat.n
        deferred = ~mat.on_device
        rows, cols = mat.x.shape
        s = d["sum"].float()
        self.bus_bytes += d["sum"].element_size() * s.numel()   # the sum down
        self.bus_bytes += 4 * (rows + cols) * ("row_squares" in d) + 4 * s.numel() * (
            "squares" in d)
        mean = s[:, deferred] / n
        x, m, v = mat.x[:, deferred], mat.m[:, deferred], mat.v[:, deferred]
        if rs["host"] == "moments":
            mat.host_count += n
            step_lr = n * lr
            x, m, v = self.adamw(x, mean, m, v, mat.host_count, step_lr,
                                 g_sq=self.mean_square(mat, mean, n), b1=self.b1 ** n,
                                 b2=self.b2 ** n)
        else:
            mat.host_count += 1
            step_lr = lr
            x, m, v = self.adamw(x, mean, m, v, mat.host_count, lr)
        mat.x[:, deferred], mat.m[:, deferred], mat.v[:, deferred] = x, m, v
        shown = mat.x.clone()
        if rs["lookahead"]:
            bias1, bias2 = 1 - self.b1 ** mat.host_count, 1 - self.b2 ** mat.host_count
            direction = mat.m / bias1 / (mat.v.sqrt() / math.sqrt(bias2) + self.eps)
            shown = shown - rs["lookahead"] * step_lr * (direction + self.wd * mat.x)
        rates = None
        if rs["rates"] != "none":
            bias2 = 1 - self.b2 ** mat.host_count
            full = 1.0 / (mat.v.sqrt() / math.sqrt(bias2) + self.eps)
            full[:, mat.on_device] = 0.0
            if rs["rates"] == "full":
                rates = {"rates": full.to(BF16)}
                self.bus_bytes += 2 * full.numel()
            else:
                logs = full[:, deferred].log()
                if rs["rates"] == "factored":
                    a = logs.mean(1)
                    b = torch.zeros(cols)
                    b[deferred] = (logs - a[:, None]).mean(0)
                    col = b.exp() * deferred.float()
                    rates = {"row_rates": a.exp(), "col_rates": col}
                    self.bus_bytes += 4 * (rows + cols)
                else:
                    rates = {"rate": logs.mean().exp()}
                    self.bus_bytes += 4
        self.bus_bytes += 2 * mat.deferred_numel()                # the values up
        mat.pending = (shown, rates)
        d["sum"].zero_()
        for key in ("squares", "row_squares", "col_squares"):
            if key in d:
                d[key].zero_()
        mat.n = 0

    def install(self, mat: Matrix, lr: float, correct: bool) -> None:
        """Write the pending update's values into the deferred columns; with `correct`, then a
        momentum-free step at the new rates for the window now ending (its sum, n_now)."""
        shown, rates = mat.pending
        mat.pending = None
        deferred = ~mat.on_device
        self.write(mat, shown, deferred)
        if rates is not None:
            for key, value in rates.items():
                mat.device[key] = value
        r = mat.rates()
        if correct and r is not None and self.settings["correct"] and mat.n:
            most = mat.n * self.bound
            step = (mat.device["sum"].float() * r).clamp(-most, most)
            self.step_weights(mat, step, lr)

    # -- a step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        lr = group["lr"]
        rs = self.settings
        grads = [p.grad for p in group["params"]]
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))
        coef = 1.0 if self.max_grad_norm is None else min(1.0, self.max_grad_norm / (norm + 1e-6))
        for vec in self.vectors:
            g = vec["p"].grad.float() * coef
            vec["count"] += 1
            vec["x"], vec["m"], vec["v"] = self.adamw(vec["x"], g, vec["m"], vec["v"],
                                                      vec["count"], lr)
            vec["p"].data.copy_(vec["x"].to(vec["p"].dtype))
        for mat in self.matrices:
            raw = mat.p.grad.reshape(mat.x.shape)
            g = raw.float() * coef
            if mat.on_device is None:   # the first step: choose the columns
                mat.on_device = torch.zeros(mat.x.shape[1], dtype=torch.bool)
                norms = g.double().pow(2).sum(0)
                order = sorted(range(len(norms)), key=lambda j: (-float(norms[j]), j))
                mat.on_device[order[:mat.k]] = True
                mat.device_count = mat.host_count
                if "col_rates" in mat.device:
                    mat.device["col_rates"].zero_()
            sel = mat.on_device
            # the interim step (before the device update, which writes its columns over)
            r = mat.rates()
            if rs["motion"] and r is not None:
                step = (raw.float() * r * coef).clamp(-self.bound, self.bound)
                self.step_weights(mat, step, lr)
            # the device's columns
            mat.device_count += 1
            new = self.adamw(mat.x[:, sel], g[:, sel], mat.m[:, sel], mat.v[:, sel],
                             mat.device_count, lr)
            mat.x[:, sel], mat.m[:, sel], mat.v[:, sel] = new
            self.write(mat, mat.x, sel)
            # the window's statistics
            d = mat.device
            gd = g.masked_fill(sel, 0.0)
            total = d["sum"].float() + gd
            if rs["sum_dtype"] == "bf16_sr":
                d["sum"].copy_(round_to(total, BF16, "stochastic", self.gen))
            else:
                d["sum"].copy_(total)
            if "squares" in d:
                d["squares"] += gd * gd
            if "row_squares" in d:
                d["row_squares"] += (gd * gd).sum(1)
                d["col_squares"] += (gd * gd).sum(0)
            mat.n += 1
        self.window_steps += 1
        if self.window_steps < rs["U"]:
            return None
        for mat in self.matrices:
            if mat.pending is not None:
                self.install(mat, lr, correct=True)
        for mat in self.matrices:
            self.host_update(mat, lr)
        self.window_steps = 0
        self.windows += 1
        return None

    def synchronize(self) -> None:
        for mat in self.matrices:
            if mat.pending is not None:
                self.install(mat, 0.0, correct=False)
            self.write(mat, mat.x, ~mat.on_device)

    def device_bytes(self) -> dict:
        """The deferred rule's device state: bytes in all, and per deferred parameter."""
        total = sum(t.numel() * t.element_size() for mat in self.matrices
                    for t in mat.device.values())
        deferred = sum(mat.deferred_numel() for mat in self.matrices)
        return {"bytes": total, "deferred_params": deferred, "per_deferred_param": total / deferred}

    def stats(self) -> dict:
        deferred = sum(mat.deferred_numel() for mat in self.matrices)
        return {"windows": self.windows, "reselections": 0, **self.device_bytes(),
                "bus_bytes_per_window_per_deferred_param":
                    self.bus_bytes / max(1, self.windows) / deferred}


def make_rule(params, *, lr, weight_decay, max_grad_norm, **settings) -> Rule:
    return Rule(params, lr, weight_decay, max_grad_norm=max_grad_norm, **settings)


# The measured candidates (U=4 and U=8 each): name -> settings.
_BASE = dict(host="moments", sum_dtype="bf16")
_FACTORED = dict(_BASE, squares="residual", rates="factored")
CANDIDATES_U = {
    # today's "moments": fp32 sum, fp32 squares, bf16 rates (10 bytes)
    "moments": dict(host="moments", sum_dtype="fp32", squares="full", rates="full"),
    # today's "mean" with bf16 sums (install_lookahead 1)
    "mean bf16": dict(host="mean", sum_dtype="bf16", squares="mean", rates="none", lookahead=1.0),
    # one part at a time
    "moments bf16-sum": dict(_BASE, squares="full", rates="full"),
    "moments factored-squares": dict(_BASE, squares="residual", rates="full"),
    "moments adafactor-squares": dict(_BASE, squares="adafactor", rates="full"),
    "moments factored-rates": dict(_BASE, squares="full", rates="factored"),
    # within 2.5 bytes: bf16 sum + O(rows + cols)
    "factored": dict(_FACTORED),
    "factored SR": dict(_FACTORED, rounding="stochastic"),
    "factored SR sum-SR": dict(_FACTORED, rounding="stochastic", sum_dtype="bf16_sr"),
    "factored install-only": dict(_FACTORED, motion=False),
    "factored mean2": dict(_BASE, squares="mean", rates="factored", rounding="stochastic"),
    "scalar-rate SR": dict(_BASE, squares="residual", rates="scalar", rounding="stochastic"),
    # the install leads by the next step the moments point to (n lr of it), as install_lookahead
    "factored SR la1": dict(_FACTORED, rounding="stochastic", lookahead=1.0),
    # no rates on the device at all: the bf16 sum and the row and column sums of the squares;
    # the host's moments update installed one window ahead along its own direction (lookahead
    # 1), standing in for the interim steps and the install correction
    "factored no-rates la1": dict(_BASE, squares="residual", rates="none", lookahead=1.0),
    # the factored rates on the device for the install's correction only: no interim steps (one
    # device pass a step, the sum's add with the squares' row and column sums folded in)
    "factored SR install-only": dict(_FACTORED, rounding="stochastic", motion=False),
}
CANDIDATES = {f"{name}, U={u}": dict(settings, U=u)
              for name, settings in CANDIDATES_U.items() for u in (4, 8)}
