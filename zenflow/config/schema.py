"""The DeepSpeed-style JSON config's schema: every block, its defaults and its bounds.

Each problem is raised as a ValueError whose text follows the key path (or, for a check on a
whole block, starts with `@key`); `zenflow.config.deepspeed_json.parse_config` turns them into ConfigError
lines. Keys that DeepSpeed accepts but that change nothing here (logging, communication tuning,
bucket sizes, ...) are accepted and listed by `ignored_keys()`. Unknown keys are errors: a typo
must not silently fall back to a default.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from zenflow.config.loading import validation_problems
from zenflow.config.rules import (
    Betas,
    DeferredCredit,
    Eps,
    Exponent,
    Flag,
    Fraction,
    Iteration,
    LearningRate,
    Lookahead,
    LossScale,
    MinLossScale,
    NonNegFloat,
    NonNegInt,
    PosInt,
    SelectInterval,
    SelectStrategy,
    UpdateInterval,
    WeightDecay,
    select_interval_fits_strategy,
)
from zenflow.config.settings import ADAMW_DEFAULTS, DEFAULTS, AdamWHyperparameters, ZenFlowSettings


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
# zero_optimization.zenflow: every key DeepSpeed 0.19 accepts.

class ZenFlowSection(_Section):
    """The keys of DeepSpeed's zenflow block: each is the ZenFlowSettings field of that name,
    checked by the same rule. A key left out takes DeepSpeed 0.19's default, so that a DeepSpeed
    config trains here as it does under DeepSpeed: ZenFlowSettings' default, except for
    select_strategy, update_interval, overlap_step and auto_ratio (marked).

    The keys mean what DeepSpeed means (its zenflow_config.py and runtime/zenflow/engine.py);
    where they do not, the comment says so and docs/deepspeed.md lists it under "Deliberate
    differences"."""

    # DeepSpeed's `offload` moves the selected columns' state to the host; ours is ~10% of the
    # model in fp32 on the device, so the key is accepted and has no effect.
    _ignored = ("offload",)

    # [0, 1], DeepSpeed's Field(ge=0.0, le=1.0); 0 and 1 are well defined here (all columns on
    # the host; plain AdamW), where DeepSpeed's "auto" update criterion divides by zero.
    topk_ratio: Fraction = DEFAULTS.topk_ratio
    # "auto" (DeepSpeed's default): reselect once per epoch when initialize knows the epoch
    # length (training_data), else select once and warn; "step"/"epoch": every select_interval
    # steps/epochs, whatever the windows; "drift" is ours (reselect when the selection drifts).
    select_strategy: SelectStrategy = "auto"    # DeepSpeed's default
    select_interval: SelectInterval = DEFAULTS.select_interval
    update_interval: UpdateInterval = "auto"    # DeepSpeed's default
    overlap_step: Flag = False                  # DeepSpeed's default
    offload: Flag = False
    # [0, 1] as DeepSpeed's Field(ge=0.0, le=1.0); null (ours) means no importance threshold.
    auto_ratio: Fraction | None = 0.99          # DeepSpeed's default
    full_warm_up_rounds: NonNegInt = DEFAULTS.full_warm_up_rounds
    # Set, it means what DeepSpeed's means (that share of the cores for the training process);
    # left out, the worker takes every core but two (ours, not DeepSpeed's 0.5: settings.py).
    pt_reserved_cores_perc: Fraction | None = DEFAULTS.pt_reserved_cores_perc
    # DeepSpeed fills it in from the dataloader ("should not be set by users"); so does
    # initialize (from training_data), unless the config sets it.
    steps_per_epoch: PosInt | None = DEFAULTS.steps_per_epoch
    # Ours, not DeepSpeed's (docs/semantics.md, "Window end").
    deferred_credit: DeferredCredit = DEFAULTS.deferred_credit
    install_lookahead: Lookahead = DEFAULTS.install_lookahead

    _fits_the_strategy = field_validator("select_interval")(select_interval_fits_strategy)

    def settings(self, max_grad_norm: float | None) -> ZenFlowSettings:
        """The optimizer's settings: these keys, the clipping norm, and defaults for the rest."""
        return ZenFlowSettings(**self.model_dump(exclude={"offload"}), max_grad_norm=max_grad_norm)


class OffloadOptimizerSection(_Section):
    device: Literal["none", "cpu"] = "none"
    pin_memory: Flag = False
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
    offload_optimizer: OffloadOptimizerSection | None = None
    offload_param: dict | None = None
    zenflow: ZenFlowSection | None = None
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
    # Stage 3's tuning of DeepSpeed's own parameter partitioning; here FSDP2 shards (and
    # prefetches) the parameters, tuned by fully_shard's own arguments.
    stage3_max_live_parameters: Any = None
    stage3_max_reuse_distance: Any = None
    stage3_prefetch_bucket_size: Any = None
    stage3_param_persistence_threshold: Any = None
    stage3_gather_16bit_weights_on_model_save: Any = None
    stage3_gather_fp16_weights_on_model_save: Any = None
    _ignored = ("contiguous_gradients", "overlap_comm", "reduce_scatter", "reduce_bucket_size",
                "allgather_partitions", "allgather_bucket_size", "round_robin_gradients",
                "elastic_checkpoint", "load_from_fp32_weights", "sub_group_size",
                "ignore_unused_parameters", "cpu_offload", "stage3_max_live_parameters",
                "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
                "stage3_param_persistence_threshold", "stage3_gather_16bit_weights_on_model_save",
                "stage3_gather_fp16_weights_on_model_save")

    @model_validator(mode="after")
    def _supported_stage(self):
        # Stage 3 (sharded parameters) is FSDP2 here: initialize checks that the model is
        # sharded with fully_shard (docs/fsdp2.md).
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"@stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.offload_param is not None:
            raise ValueError("@offload_param offloads the parameters themselves, which is not "
                             "supported: zenflow offloads the optimizer (offload_optimizer); "
                             "shard the parameters with FSDP2 (stage 3) instead")
        if self.cpu_offload:
            raise ValueError("@cpu_offload is DeepSpeed's deprecated spelling; use "
                             "offload_optimizer: {\"device\": \"cpu\"}")
        return self

    @property
    def offload_device(self) -> str:
        return self.offload_optimizer.device if self.offload_optimizer else "none"


class AdamParams(_Section):
    """optimizer.params: the AdamWHyperparameters fields, with DeepSpeed's defaults (its
    weight_decay is 0; torch's, the constructors' default, is 0.01)."""

    lr: LearningRate = ADAMW_DEFAULTS.lr
    betas: Betas = ADAMW_DEFAULTS.betas
    eps: Eps = ADAMW_DEFAULTS.eps
    weight_decay: WeightDecay = 0.0    # DeepSpeed's default
    adam_w_mode: Flag = True
    torch_adam: Any = None
    _ignored = ("torch_adam",)

    @model_validator(mode="after")
    def _adamw_only(self):
        if not self.adam_w_mode:
            raise ValueError("@adam_w_mode is false (L2-regularised Adam), which is not supported: "
                             "ZenFlow implements AdamW (decoupled weight decay)")
        return self

    def hyperparameters(self) -> AdamWHyperparameters:
        return AdamWHyperparameters(lr=self.lr, betas=self.betas, eps=self.eps,
                                    weight_decay=self.weight_decay)


class OptimizerSection(_Section):
    type: Literal["Adam", "AdamW", "adam", "adamw"]
    params: AdamParams = AdamParams()


WarmupType = Literal["log", "linear"]


def _schedule_fits(params) -> None:
    """total_num_steps covers the warm-up (DeepSpeed only warns and then divides by a negative
    length)."""
    if params.total_num_steps < params.warmup_num_steps:
        default = "" if "warmup_num_steps" in params.model_fields_set else ", its default"
        raise ValueError(f"@total_num_steps must be >= warmup_num_steps "
                         f"({params.warmup_num_steps}{default}), got {params.total_num_steps}")


class WarmupLRParams(_Section):
    warmup_min_lr: LearningRate = 0.0
    warmup_max_lr: LearningRate | None = None  # None: the optimizer's lr
    warmup_num_steps: PosInt = 1000
    warmup_type: WarmupType = "log"
    last_batch_iteration: Iteration = -1

    @model_validator(mode="after")
    def _min_below_max(self):
        if self.warmup_max_lr is not None and self.warmup_min_lr > self.warmup_max_lr:
            raise ValueError(f"@warmup_min_lr must be <= warmup_max_lr ({self.warmup_max_lr!r}), "
                             f"got {self.warmup_min_lr!r}")
        return self


class WarmupDecayLRParams(WarmupLRParams):
    warmup_max_lr: LearningRate = 0.001  # DeepSpeed's default for this schedule
    total_num_steps: PosInt

    @model_validator(mode="after")
    def _decay_after_warmup(self):
        _schedule_fits(self)
        return self


class WarmupCosineLRParams(_Section):
    total_num_steps: PosInt
    warmup_min_ratio: Fraction = 0.0
    warmup_num_steps: PosInt = 1000
    cos_min_ratio: Fraction = 0.0001
    warmup_type: WarmupType = "log"
    last_batch_iteration: Iteration = -1

    @model_validator(mode="after")
    def _decay_after_warmup(self):
        _schedule_fits(self)
        return self


_SCHEDULER_PARAMS = {"WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams,
                     "WarmupCosineLR": WarmupCosineLRParams}


class SchedulerSection(_Section):
    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    params: WarmupLRParams | WarmupDecayLRParams | WarmupCosineLRParams | None = None

    @model_validator(mode="before")
    @classmethod
    def _params_for_type(cls, data):
        # Validate params against the schema of the named schedule only, so that errors name
        # that schedule's keys and not a union of all three.
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind in _SCHEDULER_PARAMS:
            params = data.get("params")
            if params is None:  # absent or null: the schedule's defaults, which may not suffice
                params = {}
            if not isinstance(params, dict):
                raise ValueError(f"@params must be an object, got {params!r:.100}")
            try:
                parsed = _SCHEDULER_PARAMS[kind].model_validate(params)
            except ValidationError as exc:
                raise ValueError("@params." + "; params.".join(validation_problems(exc))) from None
            data = dict(data, params=parsed)
        return data


class FP16Section(_Section):
    enabled: Flag = False
    loss_scale: LossScale = 0.0  # 0 means dynamic loss scaling
    initial_scale_power: Exponent = 16
    loss_scale_window: PosInt = 1000
    hysteresis: PosInt = 2
    consecutive_hysteresis: Flag = False
    min_loss_scale: MinLossScale = 1.0
    auto_cast: Any = None
    fp16_master_weights_and_grads: Any = None
    _ignored = ("auto_cast", "fp16_master_weights_and_grads")


class BF16Section(_Section):
    enabled: Flag = False
    immediate_grad_update: Any = None
    check_grad_overflow: Any = None
    _ignored = ("immediate_grad_update", "check_grad_overflow")


# Top-level keys DeepSpeed accepts that have no effect in this engine.
_IGNORED_TOP = ("steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
                "zero_force_ds_cpu_optimizer", "dump_state", "prescale_gradients",
                "gradient_predivide_factor", "sparse_gradients", "communication_data_type",
                "tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler", "comms_logger",
                "memory_breakdown", "activation_checkpointing", "data_types", "seed")


class CheckpointSection(_Section):
    """DeepSpeed's checkpoint block: what to do when the ranks pass different tags to
    save_checkpoint (rank 0's is used, as in DeepSpeed); any case, as DeepSpeed reads it."""

    tag_validation: Literal["IGNORE", "WARN", "FAIL"] = "WARN"
    use_node_local_storage: Any = None
    load_universal: Any = None
    parallel_write: Any = None
    _ignored = ("use_node_local_storage", "load_universal", "parallel_write")

    @model_validator(mode="before")
    @classmethod
    def _any_case(cls, data):
        if isinstance(data, dict) and isinstance(data.get("tag_validation"), str):
            data = dict(data, tag_validation=data["tag_validation"].upper())
        return data


class ZenFlowConfig(_Section):
    """The whole config, after DeepSpeed's batch-size rule has filled in the missing sizes."""

    train_batch_size: PosInt | None = None
    train_micro_batch_size_per_gpu: PosInt | None = None
    gradient_accumulation_steps: PosInt | None = None
    optimizer: OptimizerSection | None = None
    scheduler: SchedulerSection | None = None
    gradient_clipping: NonNegFloat = 0.0
    fp16: FP16Section = FP16Section()
    bf16: BF16Section = BF16Section()
    zero_optimization: ZeroSection = ZeroSection()
    checkpoint: CheckpointSection = CheckpointSection()
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
        sched = self.scheduler.params if self.scheduler else None
        if isinstance(sched, WarmupLRParams) and sched.warmup_max_lr is None and self.optimizer \
                and sched.warmup_min_lr > self.optimizer.params.lr:
            raise ValueError(f"@scheduler.params.warmup_min_lr must be <= warmup_max_lr, which "
                             f"defaults to optimizer.params.lr ({self.optimizer.params.lr!r}), "
                             f"got {sched.warmup_min_lr!r}")
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
    def zenflow(self) -> ZenFlowSection | None:
        return self.zero_optimization.zenflow

    @property
    def max_grad_norm(self) -> float | None:
        """gradient_clipping as our optimizers take it (0, DeepSpeed's "off", is None)."""
        return self.gradient_clipping or None

    def hyperparameters(self) -> AdamWHyperparameters:
        """The optimizer block's AdamW numbers (DeepSpeed's defaults when there is none)."""
        return (self.optimizer.params if self.optimizer else AdamParams()).hyperparameters()

    def zenflow_settings(self) -> ZenFlowSettings:
        """ZenFlowAdamW's settings: the zenflow block's keys and gradient_clipping."""
        assert self.zenflow is not None, "the config has no zero_optimization.zenflow block"
        return self.zenflow.settings(self.max_grad_norm)

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
