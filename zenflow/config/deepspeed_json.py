"""The DeepSpeed-style JSON config: parse, validate, and say what it will run.

A config is validated completely before any work starts. Every problem is reported as a
`key.path message, got value` line, e.g.
`zero_optimization.zenflow.topk_ratio must be between 0 and 1, got 1.5`.
Reading (`loading`: files, dicts, encodings, duplicate keys) and the schema (`schema` and the
blocks beside it: blocks and defaults, its values checked by the rules in `rules` that the
optimizer constructors use too) live in their own modules; the names are re-exported here.

Keys that DeepSpeed accepts but that change nothing here (logging, communication tuning,
bucket sizes, ...) are accepted and listed in `ZenFlowConfig.ignored_keys`, so the engine can
log them once. Unknown keys are errors: a typo must not silently fall back to a default.
"""
from __future__ import annotations

import os

from pydantic import ValidationError

from zenflow.config.loading import ConfigError, load_config_dict, validation_problems
from zenflow.config.scheduler_sections import (
    SCHEDULER_PARAMS,
    SchedulerSection,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)
from zenflow.config.schema import AdamParams, BF16Section, FP16Section, OptimizerSection, ZenFlowConfig
from zenflow.config.zero_sections import OffloadOptimizerSection, ZenFlowSection, ZeroSection

__all__ = ["ConfigError", "load_config_dict", "parse_config", "optimizer_kwargs",
           "scheduler_kwargs", "resolved_settings", "world_size_from_env", "AdamParams",
           "BF16Section", "FP16Section", "OffloadOptimizerSection", "OptimizerSection",
           "SchedulerSection", "WarmupCosineLRParams", "WarmupDecayLRParams", "WarmupLRParams",
           "ZenFlowConfig", "ZenFlowSection", "ZeroSection", "OPTIMIZER_CLASS"]


def world_size_from_env() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError([f"$WORLD_SIZE must be a positive integer, got {raw!r:.60}"]) from None


def parse_config(config: str | os.PathLike | dict, world_size: int | None = None
                 ) -> ZenFlowConfig:
    """Validate a DeepSpeed-style config (path or dict). Raises ConfigError naming each key."""
    from zenflow.config.conventions import resolve_deepspeed_conventions
    data, problems = resolve_deepspeed_conventions(load_config_dict(config))
    if problems:
        raise ConfigError(problems)
    if "world_size" in data:
        raise ConfigError(["world_size is not a known key (the world size comes from "
                           "torch.distributed or $WORLD_SIZE)"])
    data["world_size"] = world_size if world_size is not None else world_size_from_env()
    try:
        return ZenFlowConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(validation_problems(exc)) from None


# ---------------------------------------------------------------------------------------------
# What the config asks the engine to build (no torch needed, so `check-config` stays light).

OPTIMIZER_CLASS = {"zenflow": "zenflow.ZenFlowAdamW", "offload": "zenflow.OffloadAdamW",
                   "adamw": "torch.optim.AdamW"}


def optimizer_kwargs(cfg: ZenFlowConfig) -> dict:
    """Keyword arguments for the optimizer the config selects: the optimizer block's AdamW
    numbers; for ZenFlowAdamW the zenflow block's keys, mapped one to one onto its settings; for
    both of ours gradient_clipping as `max_grad_norm`. (Plain AdamW is clipped by the engine with
    torch.nn.utils.clip_grad_norm_.)"""
    kwargs = cfg.hyperparameters().model_dump()
    if cfg.optimizer_kind == "zenflow":
        mapped = set(ZenFlowSection.model_fields) - {"offload"} | {"max_grad_norm"}
        kwargs.update(cfg.zenflow_settings().model_dump(include=mapped))
    elif cfg.optimizer_kind == "offload":
        kwargs.update(max_grad_norm=cfg.max_grad_norm)
    return kwargs


def scheduler_kwargs(cfg: ZenFlowConfig) -> tuple[str, dict] | None:
    if cfg.scheduler is None:
        return None
    params = cfg.scheduler.params or SCHEDULER_PARAMS[cfg.scheduler.type]()
    return cfg.scheduler.type, params.model_dump()


def resolved_settings(cfg: ZenFlowConfig) -> dict:
    """A plain dict of what will actually run, for `zenflow check-config` and the engine's log."""
    fp16 = cfg.fp16
    out = {
        "world_size": cfg.world_size,
        "train_batch_size": cfg.train_batch_size,
        "train_micro_batch_size_per_gpu": cfg.train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "optimizer": OPTIMIZER_CLASS[cfg.optimizer_kind] if cfg.optimizer else
        f"(none in the config: pass optimizer= to initialize; expected "
        f"{OPTIMIZER_CLASS[cfg.optimizer_kind]})",
        "optimizer_kwargs": optimizer_kwargs(cfg) if cfg.optimizer else None,
        "gradient_clipping": (cfg.gradient_clipping or None) and (
            f"{cfg.gradient_clipping} (inside the optimizer's step)" if cfg.optimizer_kind != "adamw"
            else f"{cfg.gradient_clipping} (torch.nn.utils.clip_grad_norm_)"),
        "scheduler": scheduler_kwargs(cfg),
        "precision": cfg.dtype_name + (" weights, fp32 master weights and moments"
                                       if cfg.dtype_name != "fp32" else ""),
        "zero_stage": cfg.zero_optimization.stage,
        "offload_optimizer": cfg.zero_optimization.offload_device,
        "ignored_keys": cfg.ignored_keys(),
    }
    if fp16.enabled:
        out["loss_scaling"] = (
            {"dynamic": True, "initial_scale": 2.0 ** fp16.initial_scale_power,
             "loss_scale_window": fp16.loss_scale_window, "hysteresis": fp16.hysteresis,
             "consecutive_hysteresis": fp16.consecutive_hysteresis,
             "min_loss_scale": fp16.min_loss_scale}
            if cfg.dynamic_loss_scale else {"dynamic": False, "loss_scale": fp16.loss_scale})
    return out
