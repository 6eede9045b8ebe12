"""Building the optimizers the examples compare, from a name or a DeepSpeed-style config.

This is the one place the examples and benchmarks construct optimizers, so every comparison uses
exactly the same hyper-parameters for every system.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch

OPTIMIZERS = ("adamw", "offload", "zenflow", "zenflow-auto")


def make_optimizer(kind: str, params: Iterable[torch.nn.Parameter], *, lr: float,
                   weight_decay: float = 0.01, betas=(0.9, 0.999), eps: float = 1e-8,
                   max_grad_norm: float | None = None, **zenflow_kwargs: Any) -> torch.optim.Optimizer:
    """`adamw`: torch.optim.AdamW; `offload`: zenflow.OffloadAdamW (synchronous ZeRO-Offload);
    `zenflow`: ZenFlowAdamW with the given (or default) ZenFlow settings; `zenflow-auto`: with
    select_strategy, select_interval and update_interval all "auto"."""
    import zenflow

    params = [p for p in params if p.requires_grad]
    common = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    if kind == "adamw":
        if zenflow_kwargs:
            raise ValueError(f"ZenFlow settings {sorted(zenflow_kwargs)} given for optimizer 'adamw'")
        # Plain AdamW clips outside the optimizer; the training loop does it (see train.py).
        return torch.optim.AdamW(params, **common)
    if kind == "offload":
        if zenflow_kwargs:
            raise ValueError(f"ZenFlow settings {sorted(zenflow_kwargs)} given for optimizer 'offload'")
        return zenflow.OffloadAdamW(params, max_grad_norm=max_grad_norm, **common)
    if kind == "zenflow":
        return zenflow.ZenFlowAdamW(params, max_grad_norm=max_grad_norm, **common, **zenflow_kwargs)
    if kind == "zenflow-auto":
        auto = dict(select_strategy="auto", select_interval="auto", update_interval="auto")
        return zenflow.ZenFlowAdamW(params, max_grad_norm=max_grad_norm, **common,
                                    **{**auto, **zenflow_kwargs})
    raise ValueError(f"optimizer={kind!r} is not allowed; choose one of {list(OPTIMIZERS)}")


def optimizer_from_config(config: str | Path | dict, params, *, lr: float | None = None,
                          weight_decay: float | None = None) -> torch.optim.Optimizer:
    """The optimizer a DeepSpeed-style config asks for, exactly as `zenflow.initialize` builds
    it: the config is validated by `zenflow.config` (errors name the key) and mapped by its
    `optimizer_kwargs`: ZenFlowAdamW when `zero_optimization.zenflow` is present, OffloadAdamW
    when only `offload_optimizer` is, torch AdamW otherwise. `lr`/`weight_decay` given here
    override the file. The examples drive their own loop, so they take the optimizer only."""
    import zenflow
    from zenflow.config import optimizer_kwargs, parse_config

    cfg = parse_config(config)
    kw = optimizer_kwargs(cfg)
    if lr is not None:
        kw["lr"] = float(lr)
    if weight_decay is not None:
        kw["weight_decay"] = float(weight_decay)
    params = [p for p in params if p.requires_grad]
    cls = {"zenflow": zenflow.ZenFlowAdamW, "offload": zenflow.OffloadAdamW,
           "adamw": torch.optim.AdamW}[cfg.optimizer_kind]
    return cls(params, **kw)


def gradient_clipping(config: str | Path | dict) -> float | None:
    from zenflow.config import parse_config
    return parse_config(config).gradient_clipping or None
