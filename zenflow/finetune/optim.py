"""Building the optimizers the examples compare, from a name or a DeepSpeed-style config.

This is the one place the examples and benchmarks construct optimizers, so every comparison uses
exactly the same hyper-parameters for every system.
"""
from __future__ import annotations

import json
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


# Keys of a config's "zero_optimization.zenflow" block that map one-to-one onto ZenFlowAdamW.
ZENFLOW_KEYS = ("topk_ratio", "select_strategy", "select_interval", "update_interval",
                "full_warm_up_rounds", "overlap_step", "pt_reserved_cores_perc", "steps_per_epoch")


def optimizer_from_config(config: str | Path | dict, params, *, lr: float | None = None,
                          weight_decay: float | None = None) -> torch.optim.Optimizer:
    """The optimizer a DeepSpeed-style config asks for: ZenFlowAdamW when
    `zero_optimization.zenflow` is present, OffloadAdamW when only `offload_optimizer` is,
    torch AdamW otherwise. `optimizer.params` (lr, betas, eps, weight_decay) and
    `gradient_clipping` are honoured; `lr`/`weight_decay` given here override the file.

    (When `zenflow.initialize` is available this is what it builds too; the examples keep this
    small mapping because they drive their own training loop.)"""
    if not isinstance(config, dict):
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"--config {str(path)!r} does not exist")
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"--config {str(path)!r} is not valid JSON: {e}") from e
    opt_cfg = config.get("optimizer", {"type": "AdamW"})
    opt_type = str(opt_cfg.get("type", "AdamW"))
    if opt_type.lower() not in ("adamw", "adam"):
        raise ValueError(f"optimizer.type={opt_type!r} is not supported; allowed: 'AdamW'")
    oparams = dict(opt_cfg.get("params", {}))
    unknown = set(oparams) - {"lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode"}
    if unknown:
        raise ValueError(f"optimizer.params has unknown keys {sorted(unknown)}; "
                         "allowed: lr, betas, eps, weight_decay")
    kw = dict(lr=float(lr if lr is not None else oparams.get("lr", 2e-5)),
              weight_decay=float(weight_decay if weight_decay is not None
                                 else oparams.get("weight_decay", 0.01)),
              betas=tuple(oparams.get("betas", (0.9, 0.999))),
              eps=float(oparams.get("eps", 1e-8)),
              max_grad_norm=config.get("gradient_clipping") or None)
    zero = config.get("zero_optimization", {})
    zf = zero.get("zenflow")
    if zf is not None:
        unknown = set(zf) - set(ZENFLOW_KEYS)
        if unknown:
            raise ValueError(f"zero_optimization.zenflow has unknown keys {sorted(unknown)}; "
                             f"allowed: {list(ZENFLOW_KEYS)}")
        return make_optimizer("zenflow", params, **kw, **zf)
    if zero.get("offload_optimizer", {}).get("device", "none") == "cpu":
        return make_optimizer("offload", params, **kw)
    kw.pop("max_grad_norm")
    return make_optimizer("adamw", params, **kw)
