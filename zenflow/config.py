"""The DeepSpeed-style JSON config: schema, defaults, validation.

A config is validated completely before any work starts. Every problem is reported as a
`key.path message, got value` line, e.g.
`zero_optimization.zenflow.topk_ratio must be between 0 and 1, got 1.5`.

Keys that DeepSpeed accepts but that change nothing here (logging, communication tuning,
bucket sizes, ...) are accepted and listed in `ZenFlowConfig.ignored_keys`, so the engine can
log them once. Unknown keys are errors: a typo must not silently fall back to a default.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PlainValidator,
                      ValidationError, model_validator)


class ConfigError(ValueError):
    """A config that cannot run. `problems` holds one `key.path message` string per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid config:\n  " + "\n  ".join(self.problems))


# ---------------------------------------------------------------------------------------------
# Small typed building blocks. Each raises ValueError with the text that follows the key path.

def _between(lo: float, hi: float, *, lo_open: bool = False):
    def check(v):
        if not (math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi):
            bound = f"greater than {lo} and at most {hi}" if lo_open else f"between {lo:g} and {hi:g}"
            raise ValueError(f"must be {bound}, got {v!r}")
        return v
    return AfterValidator(check)


def _at_least(lo: float):
    def check(v):
        if not (math.isfinite(v) and v >= lo):
            raise ValueError(f"must be >= {lo:g}, got {v!r}")
        return v
    return AfterValidator(check)


def _positive(v):
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"must be > 0, got {v!r}")
    return v


PosInt = Annotated[int, Field(strict=True), AfterValidator(_positive)]
NonNegInt = Annotated[int, Field(strict=True), _at_least(0)]
NonNegFloat = Annotated[float, Field(strict=True), _at_least(0.0)]
PosFloat = Annotated[float, Field(strict=True), AfterValidator(_positive)]
Fraction = Annotated[float, Field(strict=True), _between(0.0, 1.0)]
Bool = Annotated[bool, Field(strict=True)]


def _auto_or_positive_int(v):
    if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v > 0):
        return v
    raise ValueError(f'must be "auto" or a positive integer, got {v!r}')


AutoOrPosInt = Annotated[Union[str, int], PlainValidator(_auto_or_positive_int)]


class _Section(BaseModel):
    """A config block: unknown keys are errors; `_ignored` lists keys accepted but unused."""

    model_config = ConfigDict(extra="forbid", validate_default=True)
    _ignored: tuple[str, ...] = ()

    def ignored_keys(self, prefix: str = "") -> list[str]:
        """Dotted paths of keys that were given but have no effect here."""
        out = [f"{prefix}{k}" for k in self._ignored if k in self.model_fields_set]
        for name in self.model_fields_set:
            value = getattr(self, name)
            if isinstance(value, _Section):
                out += value.ignored_keys(f"{prefix}{name}.")
        return out


# ---------------------------------------------------------------------------------------------
# zero_optimization.zenflow: every key DeepSpeed 0.19 accepts, with its defaults.

class ZenFlowSection(_Section):
    # DeepSpeed's `offload` moves the selected columns' state to the host; ours is ~10% of the
    # model in fp32 on the device, so the key is accepted and has no effect.
    _ignored = ("offload",)

    topk_ratio: Fraction = 0.1
    select_strategy: Literal["auto", "step", "epoch"] = "auto"
    select_interval: AutoOrPosInt = "auto"
    update_interval: AutoOrPosInt = "auto"
    overlap_step: Bool = False
    offload: Bool = False
    # > 0 as well: ZenFlowAdamW refuses 0, and check-config must not pass what initialize refuses.
    auto_ratio: Annotated[Fraction, AfterValidator(_positive)] = 0.99
    full_warm_up_rounds: NonNegInt = 0
    pt_reserved_cores_perc: Fraction = 0.5
    steps_per_epoch: Optional[PosInt] = None


class OffloadOptimizerSection(_Section):
    device: Literal["none", "cpu"] = "none"
    pin_memory: Bool = False
    # Tuning knobs of DeepSpeed's own CPU/NVMe offload path.
    buffer_count: Any = None
    fast_init: Any = None
    pipeline_read: Any = None
    pipeline_write: Any = None
    ratio: Any = None
    nvme_path: Any = None
    _ignored = ("buffer_count", "fast_init", "pipeline_read", "pipeline_write", "ratio", "nvme_path")

    @model_validator(mode="before")
    @classmethod
    def _no_nvme(cls, data):
        if isinstance(data, dict) and data.get("device") == "nvme":
            raise ValueError("@device is 'nvme', which is not supported: "
                             "allowed are 'cpu' (offload to host memory) and 'none'")
        return data


class ZeroSection(_Section):
    stage: Annotated[int, Field(strict=True)] = 0
    offload_optimizer: Optional[OffloadOptimizerSection] = None
    offload_param: Optional[dict] = None
    zenflow: Optional[ZenFlowSection] = None
    # Communication and memory-layout tuning of DeepSpeed's ZeRO implementation.
    contiguous_gradients: Any = None
    overlap_comm: Any = None
    reduce_scatter: Any = None
    reduce_bucket_size: Any = None
    allgather_partitions: Any = None
    allgather_bucket_size: Any = None
    round_robin_gradients: Any = None
    elastic_checkpoint: Any = None
    load_from_fp32_weights: Any = None
    sub_group_size: Any = None
    ignore_unused_parameters: Any = None
    cpu_offload: Any = None
    _ignored = ("contiguous_gradients", "overlap_comm", "reduce_scatter", "reduce_bucket_size",
                "allgather_partitions", "allgather_bucket_size", "round_robin_gradients",
                "elastic_checkpoint", "load_from_fp32_weights", "sub_group_size",
                "ignore_unused_parameters", "cpu_offload")

    @model_validator(mode="after")
    def _supported_stage(self):
        if self.stage == 3:
            raise ValueError("@stage is 3, which is not supported: ZenFlow runs with ZeRO stage "
                             "1 or 2 (0 = no ZeRO is accepted too)")
        if self.stage not in (0, 1, 2):
            raise ValueError(f"@stage must be 0, 1 or 2, got {self.stage!r}")
        if self.offload_param is not None:
            raise ValueError("@offload_param offloads parameters, which only ZeRO stage 3 does "
                             "and stage 3 is not supported; use offload_optimizer")
        if self.cpu_offload:
            raise ValueError("@cpu_offload is DeepSpeed's deprecated spelling; use "
                             "offload_optimizer: {\"device\": \"cpu\"}")
        return self

    @property
    def offload_device(self) -> str:
        return self.offload_optimizer.device if self.offload_optimizer else "none"


class AdamParams(_Section):
    lr: NonNegFloat = 1e-3
    betas: tuple[Fraction, Fraction] = (0.9, 0.999)
    eps: PosFloat = 1e-8
    weight_decay: NonNegFloat = 0.0
    adam_w_mode: Bool = True
    torch_adam: Any = None
    _ignored = ("torch_adam",)

    @model_validator(mode="after")
    def _adamw_only(self):
        if not self.adam_w_mode:
            raise ValueError("@adam_w_mode is false (L2-regularised Adam), which is not supported: "
                             "ZenFlow implements AdamW (decoupled weight decay)")
        if self.betas[0] >= 1 or self.betas[1] >= 1:
            raise ValueError(f"@betas must each be in [0, 1), got {list(self.betas)}")
        return self


class OptimizerSection(_Section):
    type: Literal["Adam", "AdamW", "adam", "adamw"]
    params: AdamParams = AdamParams()


WarmupType = Literal["log", "linear"]


class WarmupLRParams(_Section):
    warmup_min_lr: NonNegFloat = 0.0
    warmup_max_lr: Optional[NonNegFloat] = None  # None: the optimizer's lr
    warmup_num_steps: PosInt = 1000
    warmup_type: WarmupType = "log"
    last_batch_iteration: Annotated[int, Field(strict=True)] = -1


class WarmupDecayLRParams(WarmupLRParams):
    warmup_max_lr: NonNegFloat = 0.001  # DeepSpeed's default for this schedule
    total_num_steps: PosInt


class WarmupCosineLRParams(_Section):
    total_num_steps: PosInt
    warmup_min_ratio: Fraction = 0.0
    warmup_num_steps: PosInt = 1000
    cos_min_ratio: Fraction = 0.0001
    warmup_type: WarmupType = "log"
    last_batch_iteration: Annotated[int, Field(strict=True)] = -1


_SCHEDULER_PARAMS = {"WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams,
                     "WarmupCosineLR": WarmupCosineLRParams}


class SchedulerSection(_Section):
    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    params: Union[WarmupLRParams, WarmupDecayLRParams, WarmupCosineLRParams, None] = None

    @model_validator(mode="before")
    @classmethod
    def _params_for_type(cls, data):
        # Validate params against the schema of the named schedule only, so that errors name
        # that schedule's keys and not a union of all three.
        if isinstance(data, dict) and data.get("type") in _SCHEDULER_PARAMS:
            params = data.get("params", {})
            if params is not None and not isinstance(params, dict):
                raise ValueError(f"@params must be an object, got {params!r}")
            if isinstance(params, dict):
                try:
                    parsed = _SCHEDULER_PARAMS[data["type"]].model_validate(params)
                except ValidationError as exc:
                    raise ValueError("@params." + "; params.".join(_problems(exc))) from None
                data = dict(data, params=parsed)
        return data


class FP16Section(_Section):
    enabled: Bool = False
    loss_scale: NonNegFloat = 0.0  # 0 means dynamic loss scaling
    initial_scale_power: Annotated[int, Field(strict=True), _between(0, 64)] = 16
    loss_scale_window: PosInt = 1000
    hysteresis: PosInt = 2
    consecutive_hysteresis: Bool = False
    min_loss_scale: PosFloat = 1.0
    auto_cast: Any = None
    fp16_master_weights_and_grads: Any = None
    _ignored = ("auto_cast", "fp16_master_weights_and_grads")


class BF16Section(_Section):
    enabled: Bool = False
    immediate_grad_update: Any = None
    check_grad_overflow: Any = None
    _ignored = ("immediate_grad_update", "check_grad_overflow")


# Top-level keys DeepSpeed accepts that have no effect in this engine.
_IGNORED_TOP = ("steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
                "zero_force_ds_cpu_optimizer", "dump_state", "prescale_gradients",
                "gradient_predivide_factor", "sparse_gradients", "communication_data_type",
                "tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler", "comms_logger",
                "memory_breakdown", "activation_checkpointing", "data_types", "seed")


class ZenFlowConfig(_Section):
    """The whole config, after DeepSpeed's batch-size rule has filled in the missing sizes."""

    train_batch_size: Optional[PosInt] = None
    train_micro_batch_size_per_gpu: Optional[PosInt] = None
    gradient_accumulation_steps: Optional[PosInt] = None
    optimizer: Optional[OptimizerSection] = None
    scheduler: Optional[SchedulerSection] = None
    gradient_clipping: NonNegFloat = 0.0
    fp16: FP16Section = FP16Section()
    bf16: BF16Section = BF16Section()
    zero_optimization: ZeroSection = ZeroSection()
    world_size: PosInt = 1  # not a config key: set by `parse_config`

    steps_per_print: Any = None
    wall_clock_breakdown: Any = None
    zero_allow_untested_optimizer: Any = None
    zero_force_ds_cpu_optimizer: Any = None
    dump_state: Any = None
    prescale_gradients: Any = None
    gradient_predivide_factor: Any = None
    sparse_gradients: Any = None
    communication_data_type: Any = None
    tensorboard: Any = None
    wandb: Any = None
    csv_monitor: Any = None
    comet: Any = None
    flops_profiler: Any = None
    comms_logger: Any = None
    memory_breakdown: Any = None
    activation_checkpointing: Any = None
    data_types: Any = None
    seed: Any = None
    _ignored = _IGNORED_TOP

    @model_validator(mode="after")
    def _consistent(self):
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("@bf16.enabled and fp16.enabled are both true; enable at most one")
        self._resolve_batch_sizes()
        return self

    def _resolve_batch_sizes(self):
        # DeepSpeed's rule: train = micro * accumulation * world; any two determine the third,
        # one alone is completed with accumulation = 1.
        train, micro, gas = (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                             self.gradient_accumulation_steps)
        world = self.world_size
        if train is None and micro is None:
            raise ValueError("@train_batch_size is missing: give train_batch_size or "
                             "train_micro_batch_size_per_gpu (or both)")
        if train is not None and micro is not None and gas is not None:
            pass
        elif train is not None and micro is not None:
            gas = max(1, train // (micro * world))
        elif train is not None and gas is not None:
            micro = max(1, train // (gas * world))
        elif micro is not None and gas is not None:
            train = micro * gas * world
        elif train is not None:
            gas, micro = 1, max(1, train // world)
        else:
            gas, train = 1, micro * world
        if train != micro * gas * world:
            raise ValueError(
                f"@train_batch_size must equal train_micro_batch_size_per_gpu * "
                f"gradient_accumulation_steps * world_size = {micro} * {gas} * {world} = "
                f"{micro * gas * world}, got {train}")
        self.train_batch_size, self.train_micro_batch_size_per_gpu = train, micro
        self.gradient_accumulation_steps = gas

    # What the engine will actually run -----------------------------------------------------

    @property
    def zenflow(self) -> Optional[ZenFlowSection]:
        return self.zero_optimization.zenflow

    @property
    def optimizer_kind(self) -> str:
        """'zenflow', 'offload' (ZeRO-Offload baseline) or 'adamw' (plain AdamW on the device)."""
        if self.zenflow is not None:
            return "zenflow"
        if self.zero_optimization.offload_device == "cpu":
            return "offload"
        return "adamw"

    @property
    def dtype_name(self) -> str:
        return "bf16" if self.bf16.enabled else "fp16" if self.fp16.enabled else "fp32"

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.fp16.enabled and self.fp16.loss_scale == 0

    def ignored_keys(self, prefix: str = "") -> list[str]:
        return sorted(super().ignored_keys(prefix))


# ---------------------------------------------------------------------------------------------
# Turning pydantic's errors into `key.path message, got value` lines.

_TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false",
               "string": "a string", "dict": "an object", "model": "an object",
               "tuple": "a list", "list": "a list"}


def _path(loc: tuple) -> str:
    parts = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif isinstance(p, str) and (p.startswith("function-") or p.startswith("literal[")):
            continue  # labels of a validator or union branch, not keys
        else:
            parts.append(("." if parts else "") + str(p))
    return "".join(parts)


def _describe(err: dict) -> tuple[str, str]:
    kind, msg, value = err["type"], err["msg"], err.get("input")
    path = _path(err["loc"])
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
        if msg.startswith("@"):  # a model-level check naming its own key, relative to the model
            key, _, rest = msg[1:].partition(" ")
            return (f"{path}.{key}" if path else key), rest
        return path, msg
    if kind == "extra_forbidden":
        return path, "is not a known key"
    if kind == "missing":
        return path, "is required but missing"
    if kind.endswith("_type") or kind.endswith("_parsing"):
        word = _TYPE_WORDS.get(kind.split("_")[0], kind.split("_")[0])
        return path, f"must be {word}, got {value!r}"
    if kind == "literal_error":
        return path, f"must be one of {err['ctx']['expected']}, got {value!r}"
    return path, f"{msg[0].lower()}{msg[1:]}, got {value!r}"


def _problems(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors():
        path, msg = _describe(err)
        line = f"{path} {msg}" if path else msg
        if line not in out:
            out.append(line)
    return out


def world_size_from_env() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def load_config_dict(config: Union[str, os.PathLike, dict]) -> dict:
    """Read a config given as a path to a JSON file or as a dict (copied)."""
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    path = Path(config)
    if not path.is_file():
        raise ConfigError([f"config file {str(path)!r} does not exist"])
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError([f"config file {str(path)!r} is not valid JSON: {exc}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"config file {str(path)!r} must hold a JSON object, got "
                           f"{type(data).__name__}"])
    return data


def parse_config(config: Union[str, os.PathLike, dict], world_size: Optional[int] = None
                 ) -> ZenFlowConfig:
    """Validate a DeepSpeed-style config (path or dict). Raises ConfigError naming each key."""
    from zenflow.ds.config_compat import resolve_deepspeed_conventions
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
        raise ConfigError(_problems(exc)) from None


# ---------------------------------------------------------------------------------------------
# What the config asks the engine to build (no torch needed, so `check-config` stays light).

OPTIMIZER_CLASS = {"zenflow": "zenflow.ZenFlowAdamW", "offload": "zenflow.OffloadAdamW",
                   "adamw": "torch.optim.AdamW"}


def optimizer_kwargs(cfg: ZenFlowConfig) -> dict:
    """Keyword arguments for the optimizer the config selects; the zenflow block maps one to one.

    `max_grad_norm` is only set for our optimizers, which clip inside step(); for plain AdamW
    the engine clips with torch.nn.utils.clip_grad_norm_.
    """
    params = cfg.optimizer.params if cfg.optimizer else AdamParams()
    kwargs = {"lr": params.lr, "betas": tuple(params.betas), "eps": params.eps,
              "weight_decay": params.weight_decay}
    clip = cfg.gradient_clipping or None
    if cfg.optimizer_kind == "zenflow":
        zf = cfg.zenflow
        kwargs.update(topk_ratio=zf.topk_ratio, select_strategy=zf.select_strategy,
                      select_interval=zf.select_interval, update_interval=zf.update_interval,
                      full_warm_up_rounds=zf.full_warm_up_rounds, overlap_step=zf.overlap_step,
                      max_grad_norm=clip, steps_per_epoch=zf.steps_per_epoch,
                      pt_reserved_cores_perc=zf.pt_reserved_cores_perc,
                      auto_ratio=zf.auto_ratio)
    elif cfg.optimizer_kind == "offload":
        kwargs.update(max_grad_norm=clip)
    return kwargs


def scheduler_kwargs(cfg: ZenFlowConfig) -> Optional[tuple[str, dict]]:
    if cfg.scheduler is None:
        return None
    params = cfg.scheduler.params or _SCHEDULER_PARAMS[cfg.scheduler.type]()
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
