"""The config's zero_optimization block: the stage, offload_optimizer, and the zenflow block whose
keys are ZenFlowAdamW's settings (ZenFlowSection).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from zenflow.config.rules import (
    DeferredCredit,
    Flag,
    Fraction,
    Lookahead,
    MomentsDtype,
    NonNegInt,
    PosInt,
    SelectInterval,
    SelectStrategy,
    UpdateInterval,
    select_interval_fits_strategy,
)
from zenflow.config.section import Section
from zenflow.config.settings import DEFAULTS, ZenFlowSettings

# ---------------------------------------------------------------------------------------------
# zero_optimization.zenflow: every key DeepSpeed 0.19 accepts.

class ZenFlowSection(Section):
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
    host_moments_dtype: MomentsDtype = DEFAULTS.host_moments_dtype

    _fits_the_strategy = field_validator("select_interval")(select_interval_fits_strategy)

    def settings(self, max_grad_norm: float | None) -> ZenFlowSettings:
        """The optimizer's settings: these keys, the clipping norm, and defaults for the rest."""
        return ZenFlowSettings(**self.model_dump(exclude={"offload"}), max_grad_norm=max_grad_norm)


class OffloadOptimizerSection(Section):
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


class ZeroSection(Section):
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
