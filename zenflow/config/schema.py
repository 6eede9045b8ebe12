"""The DeepSpeed-style JSON config's schema: every block, its defaults and its bounds. The whole
config (ZenFlowConfig) and its small blocks (optimizer, fp16, bf16, checkpoint) are here; the
zero_optimization block is in zero_sections.py, the scheduler block in scheduler_sections.py,
and what every block is in section.py.

Each problem is raised as a ValueError whose text follows the key path (or, for a check on a
whole block, starts with `@key`); `zenflow.config.deepspeed_json.parse_config` turns them into ConfigError
lines. Keys that DeepSpeed accepts but that change nothing here (logging, communication tuning,
bucket sizes, ...) are accepted and listed by `ignored_keys()`. Unknown keys are errors: a typo
must not silently fall back to a default.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import model_validator

from zenflow.config.rules import (
    Betas,
    Eps,
    Exponent,
    Flag,
    LearningRate,
    LossScale,
    MinLossScale,
    NonNegFloat,
    PosInt,
    WeightDecay,
)
from zenflow.config.scheduler_sections import SchedulerSection, WarmupLRParams
from zenflow.config.section import Section
from zenflow.config.settings import ADAMW_DEFAULTS, AdamWHyperparameters, ZenFlowSettings
from zenflow.config.zero_sections import ZenFlowSection, ZeroSection


class AdamParams(Section):
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


class OptimizerSection(Section):
    type: Literal["Adam", "AdamW", "adam", "adamw"]
    params: AdamParams = AdamParams()


class FP16Section(Section):
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


class BF16Section(Section):
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


class CheckpointSection(Section):
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


class ZenFlowConfig(Section):
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
