"""The config's scheduler block: the type of schedule (WarmupLR, WarmupDecayLR, WarmupCosineLR)
and its params, checked against that schedule's keys alone.
"""
from __future__ import annotations

from typing import Literal

from pydantic import ValidationError, model_validator

from zenflow.config.loading import validation_problems
from zenflow.config.rules import Fraction, Iteration, LearningRate, PosInt
from zenflow.config.section import Section

WarmupType = Literal["log", "linear"]


def _schedule_fits(params) -> None:
    """total_num_steps covers the warm-up (DeepSpeed only warns and then divides by a negative
    length)."""
    if params.total_num_steps < params.warmup_num_steps:
        default = "" if "warmup_num_steps" in params.model_fields_set else ", its default"
        raise ValueError(f"@total_num_steps must be >= warmup_num_steps "
                         f"({params.warmup_num_steps}{default}), got {params.total_num_steps}")


class WarmupLRParams(Section):
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


class WarmupCosineLRParams(Section):
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


SCHEDULER_PARAMS = {"WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams,
                     "WarmupCosineLR": WarmupCosineLRParams}


class SchedulerSection(Section):
    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    params: WarmupLRParams | WarmupDecayLRParams | WarmupCosineLRParams | None = None

    @model_validator(mode="before")
    @classmethod
    def _params_for_type(cls, data):
        # Validate params against the schema of the named schedule only, so that errors name
        # that schedule's keys and not a union of all three.
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind in SCHEDULER_PARAMS:
            params = data.get("params")
            if params is None:  # absent or null: the schedule's defaults, which may not suffice
                params = {}
            if not isinstance(params, dict):
                raise ValueError(f"@params must be an object, got {params!r:.100}")
            try:
                parsed = SCHEDULER_PARAMS[kind].model_validate(params)
            except ValidationError as exc:
                raise ValueError("@params." + "; params.".join(validation_problems(exc))) from None
            data = dict(data, params=parsed)
        return data
