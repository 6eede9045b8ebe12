"""Building the optimizers the examples compare, from a name or a DeepSpeed-style config.

This is the one place the examples and benchmarks construct optimizers, so every comparison uses
exactly the same hyper-parameters for every system.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # imported where an optimizer is built: `zenflow finetune --help` needs no torch
    import torch

OPTIMIZERS = ("adamw", "offload", "zenflow", "zenflow-auto")
# Everything decided at run time: windows by update_interval "auto", reselection on drift ("auto"
# would be DeepSpeed's once per epoch, and these loops pass no epoch length).
ZENFLOW_AUTO = dict(select_strategy="drift", select_interval="auto", update_interval="auto")


def make_optimizer(kind: str, params: Iterable[torch.nn.Parameter], *, lr: float,
                   weight_decay: float = 0.01, betas=(0.9, 0.999), eps: float = 1e-8,
                   max_grad_norm: float | None = None, emulated_host_steps: int = 0,
                   **zenflow_settings: Any) -> torch.optim.Optimizer:
    """`adamw`: torch.optim.AdamW; `offload`: zenflow.OffloadAdamW (synchronous ZeRO-Offload);
    `zenflow`: ZenFlowAdamW with the given ZenFlowSettings fields (the rest at their defaults);
    `zenflow-auto`: with update_interval "auto" and reselection on drift.

    `emulated_host_steps` (benchmarks only): with `update_interval="auto"`, treat each host update
    as taking at least that many device steps, as on a GPU, whose device is several times faster
    than its host; on a CPU machine the host keeps up after one step."""
    import zenflow

    if kind not in OPTIMIZERS:
        raise ValueError(f"optimizer={kind!r} is not allowed; choose one of {list(OPTIMIZERS)}")
    if kind in ("adamw", "offload") and zenflow_settings:
        raise ValueError(f"ZenFlow settings {sorted(zenflow_settings)} given for optimizer {kind!r}")
    if emulated_host_steps and kind not in ("zenflow", "zenflow-auto"):
        raise ValueError(f"emulated_host_steps={emulated_host_steps} given for optimizer {kind!r}: "
                         "only ZenFlow's auto windows follow the host's speed")
    params = [p for p in params if p.requires_grad]
    adamw = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    if kind == "adamw":
        import torch
        # Plain AdamW clips outside the optimizer; the training loop does it (see train.py).
        return torch.optim.AdamW(params, **adamw)
    if kind == "offload":
        return zenflow.OffloadAdamW(params, **adamw, max_grad_norm=max_grad_norm)
    settings = {**(ZENFLOW_AUTO if kind == "zenflow-auto" else {}), **zenflow_settings}
    if emulated_host_steps:   # checked before the optimizer (and its worker) exists
        chosen = zenflow.ZenFlowSettings.from_arguments("make_optimizer", **settings)
        if chosen.update_interval != "auto" or not chosen.overlap_step:
            raise ValueError(f"emulated_host_steps={emulated_host_steps} needs "
                             "update_interval='auto' and overlap_step=True, got update_interval="
                             f"{chosen.update_interval!r}, overlap_step={chosen.overlap_step}")
    opt = zenflow.ZenFlowAdamW(params, **adamw, max_grad_norm=max_grad_norm, **settings)
    if emulated_host_steps:
        opt._window.emulated_host_steps = emulated_host_steps   # an AutoWindow, checked above
    return opt


def optimizer_from_config(config: str | Path | dict, params, *, lr: float | None = None,
                          weight_decay: float | None = None,
                          steps_per_epoch: int | None = None) -> torch.optim.Optimizer:
    """The optimizer a DeepSpeed-style config asks for, built as `zenflow.initialize` builds it
    (the config is validated by `zenflow.config.deepspeed_json`, whose errors name the key): ZenFlowAdamW when
    `zero_optimization.zenflow` is present, OffloadAdamW when only `offload_optimizer` is,
    torch AdamW otherwise. `lr`/`weight_decay` given here override the file; `steps_per_epoch`
    is the loop's epoch length, which select_strategy "auto" and "epoch" count in (initialize
    takes it from its training_data). The examples drive their own loop, so they take the
    optimizer only."""
    from zenflow.config.deepspeed_json import parse_config
    from zenflow.engine.build import optimizer_for_config

    cfg = parse_config(config)
    overrides = {k: v for k, v in (("lr", lr), ("weight_decay", weight_decay)) if v is not None}
    hyperparameters = cfg.hyperparameters().replace(**overrides)
    return optimizer_for_config(cfg, [p for p in params if p.requires_grad],
                                hyperparameters=hyperparameters, steps_per_epoch=steps_per_epoch)


def gradient_clipping(config: str | Path | dict) -> float | None:
    from zenflow.config.deepspeed_json import parse_config
    return parse_config(config).max_grad_norm
