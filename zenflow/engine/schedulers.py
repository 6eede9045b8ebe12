"""DeepSpeed's warm-up learning-rate schedules, with DeepSpeed's parameter names and semantics.

Each schedule writes `lr` into every param group of the optimizer. Like DeepSpeed's, they are
indexed by `last_batch_iteration`: construction sets the LR for iteration -1 (the start value)
and each `step()` advances one iteration. The engine calls `step()` after every optimizer step
that was not skipped.

- WarmupLR: warm up from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold.
- WarmupDecayLR: the same warm-up, then linear decay to 0 at total_num_steps.
- WarmupCosineLR: warm up the *ratio* of each group's initial lr from warmup_min_ratio to 1,
  then cosine-decay it to cos_min_ratio at total_num_steps.
`warmup_type` "log" follows log(t+1)/log(warmup_num_steps); "linear" follows t/warmup_num_steps.
"""
from __future__ import annotations

import math

import torch


def _set_lrs(optimizer: torch.optim.Optimizer, lrs: list[float]) -> list[float]:
    for group, lr in zip(optimizer.param_groups, lrs):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return list(lrs)


def _check_warmup(warmup_num_steps: int, warmup_type: str) -> None:
    if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in ("log", "linear"):
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")


class _Schedule:
    """Shared plumbing: iteration counter, state dict, writing the LR into the groups."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_num_steps: int, warmup_type: str,
                 last_batch_iteration: int):
        _check_warmup(warmup_num_steps, warmup_type)
        self.optimizer = optimizer
        # As in DeepSpeed: fewer than 2 warm-up steps would make log(warmup_num_steps) zero.
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None

    def _warmup_fraction(self) -> float:
        t = self.last_batch_iteration
        if self.warmup_type == "log":
            return math.log(t + 1) / math.log(self.warmup_num_steps)
        return t / self.warmup_num_steps

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = (self.last_batch_iteration + 1 if last_batch_iteration is None
                                     else last_batch_iteration)
        self._last_lr = _set_lrs(self.optimizer, self.get_lr())

    def get_last_lr(self) -> list[float]:
        if self._last_lr is None:
            raise RuntimeError("get_last_lr() called before the schedule set any learning rate")
        return self._last_lr

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]
        self._last_lr = _set_lrs(self.optimizer, self.get_lr())


def _per_group(optimizer, value, name) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"{name} has {len(value)} values but the optimizer has "
                             f"{len(optimizer.param_groups)} param groups")
        return [float(v) for v in value]
    return [float(value)] * len(optimizer.param_groups)


class WarmupLR(_Schedule):
    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                 warmup_type="log", last_batch_iteration=-1):
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = optimizer.param_groups[0]["lr"]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        if last_batch_iteration == -1:
            self._last_lr = _set_lrs(optimizer, self.get_lr())

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps=1000, warmup_type="log", last_batch_iteration=-1):
        if not isinstance(total_num_steps, int) or total_num_steps <= 0:
            raise ValueError(f"total_num_steps must be a positive integer, got {total_num_steps!r}")
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
                 cos_min_ratio=0.0001, warmup_type="log", last_batch_iteration=-1):
        if not isinstance(total_num_steps, int) or total_num_steps <= 0:
            raise ValueError(f"total_num_steps must be a positive integer, got {total_num_steps!r}")
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.org_lrs = [group["lr"] for group in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._last_lr = _set_lrs(optimizer, self.get_lr())

    def state_dict(self) -> dict:
        # The base LRs are the optimizer's LRs at construction, which the schedule overwrites.
        return {"last_batch_iteration": self.last_batch_iteration, "org_lrs": list(self.org_lrs)}

    def load_state_dict(self, sd: dict) -> None:
        self.org_lrs = list(sd.get("org_lrs", self.org_lrs))
        super().load_state_dict(sd)

    def lr_ratio(self) -> float:
        t = self.last_batch_iteration
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * self._warmup_fraction()
        # Progress is clamped so that the ratio stays at cos_min_ratio past the end.
        progress = min(1.0, (t - self.warmup_num_steps + 1)
                       / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR,
              "WarmupCosineLR": WarmupCosineLR}


def build_scheduler(name: str, optimizer: torch.optim.Optimizer, params: dict):
    if name not in SCHEDULERS:
        raise ValueError(f"scheduler.type must be one of {sorted(SCHEDULERS)}, got {name!r}")
    return SCHEDULERS[name](optimizer, **params)
