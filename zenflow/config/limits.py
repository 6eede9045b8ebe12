"""Sane bounds of the settings' values, the one source of numeric limits for `rules`.

Values outside them are not meaningful AdamW settings (an lr of 1e30 turns every weight into
inf in one step, an update_interval of 1e30 never updates the host columns), so both entry
points (the optimizer constructors and the JSON config) refuse them with the same limits.
Torch-free, so `zenflow check-config` stays light.
"""
from __future__ import annotations

MAX_LR = 10.0            # lr, warmup_min_lr, warmup_max_lr
MAX_EPS = 1.0
MAX_WEIGHT_DECAY = 10.0  # decoupled: each step multiplies a weight by 1 - lr * weight_decay
MAX_INTERVAL = 100_000   # update_interval, auto_update_bounds: steps per host update
MAX_STEPS = 10**9        # step counts and sizes: warm-up rounds, schedule lengths, batch sizes,
                         # select_interval (a huge one is the idiom for "never reselect")
MAX_LOSS_SCALE = 2.0**64

