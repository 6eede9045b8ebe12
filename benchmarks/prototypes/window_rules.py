"""Prototype host-update rules for long windows, on finetune_quality.py's fine-tune (research code).

Not the package: a plain simulation of ZenFlow's arithmetic (one param group, fixed windows of U
steps, the top-k columns chosen once at the first step, `max_grad_norm` 1) in which rules the
package does not have can be tried in a few lines. With the package's own rules it reproduces
ZenFlowAdamW (mean credit, U=4, overlap: +4.67% against AdamW on seed 0, as the package gives).
The rules it measured are in benchmarks/README.md ("Rules for long windows").

    python benchmarks/prototypes/window_rules.py '{"name": {"U": 4, "host": "moments", "fresh": 1}}' 0,1,2

Settings of a rule (keyword arguments of `Rule`):
  U         window length (steps); overlap: install a window's update at the end of the next one
  k_ratio   share of each matrix's columns updated on the device every step
  host      the host's step at a window end over the n gradients it summed:
              "mean"     one AdamW step on the mean gradient (the package's deferred_credit="mean")
              "window"   the same step at n x lr (deferred_credit="window")
              "window_v" n x lr, with the second moment fed the mean of the per-step squared
                         gradients (a second window sum) instead of the mean gradient squared
              "moments"  the moments as after n AdamW steps on the window: m <- b1^n m +
                         (1 - b1^n) mean(g), v <- b2^n v + (1 - b2^n) mean(g^2), count += n,
                         then one step of n x lr with the bias corrections at the new count
              "moments_matrix"  "moments" with mean(g^2) replaced by mean(g)^2 times one ratio
                         per matrix (per-step squared norm / squared norm of the mean): no second
                         window sum
  lookahead install x - lookahead * lr_used * (the next step's AdamW direction), as the package's
            install_lookahead
  drift     the device moves the deferred columns along that direction every step
  fresh     the device moves the deferred columns every step by -fresh * lr * g * r, where
            r = 1 / (sqrt(v_hat) + eps) from the host's last update, and keeps P, the sum of
            lr * g since the last install; an install writes x - fresh * P * r: the host's values
            plus a momentum-free step for every gradient the host has not applied yet
  motion    with fresh: whether the device moves the deferred columns every step (False: only
            the install's correction, "install only")
  pending   with fresh: P as the exact sum of lr * g ("exact") or the learning rate at the install
            times the gradients' sum ("sum": what the package keeps, the window sums it has)
  full_ends the embeddings and the output head (rows 256 or 64 at width 128) wholly on the device

Writes benchmarks/results/window_rules.json (each rule's gaps per seed; the machine named).
"""
from __future__ import annotations

import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import finetune_quality as fq  # noqa: E402

from zenflow.tools.bench.model import GPT  # noqa: E402

HOST_RULES = ("mean", "window", "window_v", "moments", "moments_matrix")


class Rule:
    def __init__(self, params, lr, weight_decay, betas=(0.9, 0.999), eps=1e-8, k_ratio=0.1,
                 U=4, overlap=True, host="mean", lookahead=0.0, drift=False, fresh=0.0,
                 full_ends=False, motion=True, pending="exact"):
        if host not in HOST_RULES:
            raise ValueError(f"host={host!r}: choose one of {HOST_RULES}")
        self.params = list(params)
        self.lr, self.wd, (self.b1, self.b2), self.eps = lr, weight_decay, betas, eps
        self.U, self.overlap, self.host, self.lookahead = U, overlap, host, lookahead
        self.drift, self.fresh = drift, fresh
        self.motion, self.pending_rule, self.lr_now = motion, pending, lr
        self.window_steps, self.pending, self.selected = 0, False, False
        self.state = []
        for p in self.params:
            x = p.detach().float().clone()
            s = {"x": x.reshape(p.shape[0], -1) if p.ndim >= 2 else x}
            s["m"], s["v"] = torch.zeros_like(s["x"]), torch.zeros_like(s["x"])
            if p.ndim >= 2:
                rows, cols = s["x"].shape
                whole = full_ends and cols == 128 and rows in (256, 64)
                s.update(sum=torch.zeros_like(s["x"]), sum_sq=torch.zeros_like(s["x"]),
                         energy=0.0, n=0, host_count=0, device_count=0, on_device=None,
                         k=cols if whole else math.ceil(k_ratio * cols),
                         D=torch.zeros_like(s["x"]), r=torch.zeros_like(s["x"]),
                         P=torch.zeros_like(s["x"]), S=torch.zeros_like(s["x"]))
            else:
                s["count"] = 0
            self.state.append(s)

    # -- arithmetic -------------------------------------------------------------------------
    def adam(self, x, g, m, v, count, lr, g_sq=None, b1=None, b2=None):
        """One AdamW step; with b1/b2 given, the moments decay by them and the bias corrections
        still use the package's betas at `count`."""
        b1u, b2u = (self.b1 if b1 is None else b1), (self.b2 if b2 is None else b2)
        x = x * (1 - lr * self.wd)
        m = b1u * m + (1 - b1u) * g
        v = b2u * v + (1 - b2u) * (g * g if g_sq is None else g_sq)
        denom = v.sqrt() / math.sqrt(1 - self.b2 ** count) + self.eps
        return x - lr / (1 - self.b1 ** count) * m / denom, m, v

    def inverse_denominator(self, s):
        c = s["host_count"]
        return 1.0 / (s["v"].sqrt() / math.sqrt(1 - self.b2 ** c) + self.eps)

    def write(self, p, s, values, columns):
        p.data.view(s["x"].shape)[:, columns] = values[:, columns].to(p.dtype)

    def install(self):
        for p, s in zip(self.params, self.state):
            if p.ndim < 2 or "last_lr" not in s:
                continue
            deferred = ~s["on_device"]
            r = self.inverse_denominator(s)
            direction = s["m"] / (1 - self.b1 ** s["host_count"]) * r + self.wd * s["x"]
            shown = s["x"] - self.lookahead * s["last_lr"] * direction
            if self.fresh:
                r[:, s["on_device"]] = 0
                P = s["P"] if self.pending_rule == "exact" else self.lr_now * s["S"]
                shown = shown - self.fresh * P * r
                s["r"], s["P"], s["S"] = r, torch.zeros_like(s["P"]), torch.zeros_like(s["P"])
            self.write(p, s, shown, deferred)
            if self.drift:
                s["D"] = direction.masked_fill(s["on_device"], 0.0)

    def select(self, grads2d):
        for p, s, g in zip(self.params, self.state, grads2d):
            if p.ndim >= 2:
                chosen = torch.zeros(g.shape[1], dtype=torch.bool)
                chosen[torch.topk(g.pow(2).sum(0), s["k"]).indices] = True
                s["on_device"], s["device_count"] = chosen, s["host_count"]
        self.selected = True

    # -- a step -----------------------------------------------------------------------------
    def step(self, lr):
        self.lr_now = lr
        grads = [p.grad for p in self.params]
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        grads = [g.float() * min(1.0, 1.0 / (norm + 1e-6)) for g in grads]
        grads2d = [g.reshape(p.shape[0], -1) if p.ndim >= 2 else g
                   for p, g in zip(self.params, grads)]
        if not self.selected:
            self.select(grads2d)
        for p, s, g in zip(self.params, self.state, grads2d):
            if p.ndim < 2:
                s["count"] += 1
                s["x"], s["m"], s["v"] = self.adam(s["x"], g, s["m"], s["v"], s["count"], lr)
                p.data.copy_(s["x"].to(p.dtype))
                continue
            sel, deferred = s["on_device"], ~s["on_device"]
            s["device_count"] += 1
            new = self.adam(s["x"][:, sel], g[:, sel], s["m"][:, sel], s["v"][:, sel],
                            s["device_count"], lr)
            s["x"][:, sel], s["m"][:, sel], s["v"][:, sel] = new
            self.write(p, s, s["x"], sel)
            weights = p.data.view(s["x"].shape)
            if self.drift:
                weights.sub_((lr * s["D"]).to(p.dtype))
            if self.fresh:
                motion = lr * g * deferred
                s["P"] += motion
                s["S"] += g * deferred
                if self.motion:
                    weights.sub_((self.fresh * motion * s["r"]).to(p.dtype))
            s["sum"][:, deferred] += g[:, deferred]
            s["sum_sq"][:, deferred] += g[:, deferred] ** 2
            s["energy"] += float(g[:, deferred].pow(2).sum())
            s["n"] += 1
        self.window_steps += 1
        if self.window_steps < self.U:
            return
        if self.pending:
            self.install()
        for p, s in zip(self.params, self.state):
            if p.ndim >= 2 and s["n"]:
                self.host_step(s, lr)
        self.pending = True
        if not self.overlap:
            self.install()
            self.pending = False
        self.window_steps = 0

    def host_step(self, s, lr):
        deferred, n = ~s["on_device"], s["n"]
        mean = s["sum"][:, deferred] / n
        mean_sq = s["sum_sq"][:, deferred] / n
        x, m, v = s["x"][:, deferred], s["m"][:, deferred], s["v"][:, deferred]
        step_lr = lr if self.host == "mean" else n * lr
        if self.host in ("moments", "moments_matrix"):
            if self.host == "moments_matrix":
                ratio = (s["energy"] / n) / max(float(mean.pow(2).sum()), 1e-30)
                mean_sq = mean * mean * ratio
            s["host_count"] += n
            x, m, v = self.adam(x, mean, m, v, s["host_count"], step_lr, g_sq=mean_sq,
                                b1=self.b1 ** n, b2=self.b2 ** n)
        else:
            s["host_count"] += 1
            x, m, v = self.adam(x, mean, m, v, s["host_count"], step_lr,
                                g_sq=mean_sq if self.host == "window_v" else None)
        s["x"][:, deferred], s["m"][:, deferred], s["v"][:, deferred] = x, m, v
        s["last_lr"] = step_lr
        for key in ("sum", "sum_sq"):
            s[key].zero_()
        s["energy"], s["n"] = 0.0, 0

    def synchronize(self):
        for p, s in zip(self.params, self.state):
            if p.ndim >= 2:
                self.write(p, s, s["x"], ~s["on_device"])


def run(rule: dict | None, seed: int, setting, direction, data, weights) -> tuple[float, float]:
    """(new-domain, old-domain) held-out loss of one fine-tune; rule None is torch AdamW."""
    model = GPT(direction.model)
    model.load_state_dict(weights)
    params = list(model.parameters())
    if rule is None:
        opt = torch.optim.AdamW(params, lr=setting.lr, weight_decay=setting.weight_decay)
    else:
        opt = Rule(params, setting.lr, setting.weight_decay, **rule)
    gen = torch.Generator().manual_seed(seed)
    for step in range(setting.steps):
        lr = setting.lr * fq.schedule(step, setting.warmup, setting.steps)
        loss = model(*fq.batch(data["new"][0], setting.batch_size, gen))
        for p in params:
            p.grad = None
        loss.backward()
        if rule is None:
            for group in opt.param_groups:
                group["lr"] = lr
            torch.nn.utils.clip_grad_norm_(params, setting.max_grad_norm)
            opt.step()
        else:
            opt.step(lr)
    if rule is not None:
        opt.synchronize()
    return tuple(fq.held_out_loss(model, data[d][1], setting.eval_windows) for d in ("new", "old"))


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    rules = json.loads(argv[0])
    seeds = [int(s) for s in argv[1].split(",")] if len(argv) > 1 else [0]
    direction = fq.DIRECTIONS[argv[2] if len(argv) > 2 else "shakespeare-to-bbc"]
    setting = fq.Setting()
    data = fq.corpora(direction)
    weights = fq.pretrained(setting, direction, data, progress=True)
    base, results = {}, {}
    for seed in seeds:
        start = time.time()
        base[seed] = run(None, seed, setting, direction, data, weights)
        print(f"seed {seed} AdamW new {base[seed][0]:.4f} old {base[seed][1]:.4f} "
              f"({time.time() - start:.0f} s)", flush=True)
    for name, rule in rules.items():
        gaps = []
        for seed in seeds:
            new, old = run(rule, seed, setting, direction, data, weights)
            gaps.append((100 * (new / base[seed][0] - 1), 100 * (old / base[seed][1] - 1)))
        print(f"{name:40s} new {statistics.fmean(g[0] for g in gaps):+.2f}%  "
              f"old {statistics.fmean(g[1] for g in gaps):+.2f}%  "
              f"(per seed: {', '.join(f'{g[0]:+.2f}%' for g in gaps)})", flush=True)
        results[name] = {"rule": rule, "new_gap_pct": [g[0] for g in gaps],
                         "old_gap_pct": [g[1] for g in gaps],
                         "new_gap_pct_mean": statistics.fmean(g[0] for g in gaps),
                         "old_gap_pct_mean": statistics.fmean(g[1] for g in gaps)}
    out = Path(__file__).resolve().parents[1] / "results" / "window_rules.json"
    saved = json.loads(out.read_text()) if out.exists() else {"runs": []}
    saved["runs"].append({"machine": f"{platform.processor() or platform.machine()}, "
                                     f"{torch.get_num_threads()} thread(s), torch "
                                     f"{torch.__version__}",
                          "direction": argv[2] if len(argv) > 2 else "shakespeare-to-bbc",
                          "seeds": seeds, "rules": results})
    out.write_text(json.dumps(saved, indent=1))
    print(f"added to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
