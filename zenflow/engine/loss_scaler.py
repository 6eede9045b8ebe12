"""fp16 loss scaling with DeepSpeed's semantics.

Dynamic scaling: start at 2**initial_scale_power. An overflow (a non-finite gradient) skips
the step; with hysteresis h the scale is only halved on the h-th overflow (the first h-1 are
absorbed), and never below min_loss_scale. After loss_scale_window steps since the last
overflow without one, the scale doubles (and the hysteresis is refilled). With
consecutive_hysteresis, every clean step refills the hysteresis, so only h overflows in a row
lower the scale.

Static scaling (loss_scale > 0): the scale never changes and an overflow still skips the step.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch


class LossScaler:
    def __init__(self, *, dynamic: bool = True, init_scale: float = 2.0 ** 16,
                 scale_window: int = 1000, hysteresis: int = 2,
                 consecutive_hysteresis: bool = False, min_scale: float = 1.0,
                 scale_factor: float = 2.0):
        if init_scale <= 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale}")
        self.dynamic = dynamic
        self.cur_scale = float(init_scale)
        self.scale_window = scale_window
        self.hysteresis = hysteresis
        self.cur_hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = min_scale
        self.scale_factor = scale_factor
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    @staticmethod
    def has_overflow(params: Iterable[torch.Tensor]) -> bool:
        """True when any gradient holds inf or nan (one host sync for all of them)."""
        flags = [torch.logical_not(torch.isfinite(p.grad)).any()
                 for p in params if p.grad is not None]
        return bool(torch.stack(flags).any()) if flags else False

    def update(self, overflow: bool) -> None:
        """Record the outcome of one optimizer step and adjust the scale."""
        if self.dynamic:
            if overflow:
                if self.hysteresis == 1 or self.cur_hysteresis == 1:
                    self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                else:
                    self.cur_hysteresis -= 1
                self.last_overflow_iter = self.cur_iter
            else:
                if self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                    if not self.consecutive_hysteresis:
                        self.cur_hysteresis = self.hysteresis
                    self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("dynamic", "cur_scale", "scale_window", "hysteresis",
                                              "cur_hysteresis", "consecutive_hysteresis",
                                              "min_scale", "scale_factor", "cur_iter",
                                              "last_overflow_iter")}

    def load_state_dict(self, sd: dict) -> None:
        for k, v in sd.items():
            setattr(self, k, v)
