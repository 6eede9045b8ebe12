"""Typed building blocks of the config schema: numbers with their bounds, strict booleans.

Each check raises ValueError with the text that follows the key path, naming the bound that
was broken and the value, e.g. `must be <= 10, got 1e+30`.
"""
from __future__ import annotations

import math
from typing import Annotated, Union

from pydantic import AfterValidator, Field, PlainValidator

from zenflow import _limits


def _finite(v) -> bool:
    # No math.isfinite: it overflows on integers beyond the float range.
    return v == v and v not in (math.inf, -math.inf)


def between(lo: float, hi: float, *, lo_open: bool = False):
    def check(v):
        if not (_finite(v) and lo <= v <= hi) or (lo_open and v == lo):
            excluded = f" ({lo:g} excluded)" if lo_open else ""
            raise ValueError(f"must be between {lo:g} and {hi:g}{excluded}, got {v!r}")
        return v
    return AfterValidator(check)


def bounded(lo: float, hi: float = math.inf, *, lo_open: bool = False):
    """lo <= v <= hi (lo < v when lo_open), finite; each message names the bound it broke."""
    def check(v):
        if v != v:
            raise ValueError(f"must be a number, got {v!r}")
        if v < lo or (lo_open and v == lo):
            raise ValueError(f"must be {'>' if lo_open else '>='} {lo:g}, got {v!r}")
        if v > hi:
            raise ValueError(f"must be <= {hi:g}, got {v!r}")
        if not _finite(v):
            raise ValueError(f"must be finite, got {v!r}")
        return v
    return AfterValidator(check)


STRICT = Field(strict=True)
PosInt = Annotated[int, STRICT, bounded(0, _limits.MAX_STEPS, lo_open=True)]
NonNegInt = Annotated[int, STRICT, bounded(0, _limits.MAX_STEPS)]
Iteration = Annotated[int, STRICT, bounded(-1, _limits.MAX_STEPS)]  # last_batch_iteration
NonNegFloat = Annotated[float, STRICT, bounded(0.0)]
Fraction = Annotated[float, STRICT, between(0.0, 1.0)]
Bool = Annotated[bool, STRICT]
LearningRate = Annotated[float, STRICT, bounded(0.0, _limits.MAX_LR)]
Eps = Annotated[float, STRICT, bounded(0.0, _limits.MAX_EPS, lo_open=True)]
WeightDecay = Annotated[float, STRICT, bounded(0.0, _limits.MAX_WEIGHT_DECAY)]
LossScale = Annotated[float, STRICT, bounded(0.0, _limits.MAX_LOSS_SCALE)]


def _auto_or_interval(high: int):
    def check(v):
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and 0 < v <= high):
            return v
        if isinstance(v, int) and not isinstance(v, bool) and v > high:
            raise ValueError(f'must be "auto" or an integer <= {high}, got {v!r}')
        raise ValueError(f'must be "auto" or a positive integer, got {v!r:.100}')
    return PlainValidator(check)


AutoOrInterval = Annotated[Union[str, int], _auto_or_interval(_limits.INT_MAX["update_interval"])]
AutoOrSelectInterval = Annotated[Union[str, int],
                                 _auto_or_interval(_limits.INT_MAX["select_interval"])]
