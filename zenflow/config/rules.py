"""The rules a setting's value must follow, the same for the constructors and the JSON config.

Each rule is a pydantic type (`Annotated[..., rule(check)]`) that checks a value once, for both
entry points. A broken rule says what is allowed in the words of the place the value came from:
a Python caller reads `True or False` and `between 0.0 and 1.0`, a JSON author `true or false`
and `between 0 and 1`. Both wordings travel in the one error (`Invalid`):
`zenflow.config.settings.argument_error` raises the Python one as a TypeError or ValueError naming the
argument, and `zenflow.config.loading.validation_problems` prints the JSON one after the key path.
Numeric limits come from `_limits`. Torch-free, so `zenflow check-config` stays light.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import PlainValidator
from pydantic_core import PydanticCustomError

from zenflow.config import limits as _limits

ERROR_TYPE = "zenflow_setting"   # the pydantic error type of a broken rule


class Invalid(ValueError):
    """A value that breaks its rule, said for Python and for JSON. `where` locates the offending
    part inside the value (`[1]` of a pair); `type_error`: the value has the wrong type."""

    def __init__(self, python: str, json: str | None = None, *, type_error: bool = False,
                 where: str = ""):
        super().__init__(python)
        self.python, self.json = python, python if json is None else json
        self.type_error, self.where = type_error, where


def pydantic_error(exc: Invalid) -> PydanticCustomError:
    """`exc` as the pydantic error that both entry points turn into their own wording."""
    return PydanticCustomError(ERROR_TYPE, "{json}", {
        "json": exc.json, "python": exc.python, "type_error": exc.type_error,
        "where": exc.where})


def rule(check: Callable[[Any], Any]) -> PlainValidator:
    """A pydantic validator running `check` (which returns the value or raises Invalid)."""
    def validate(value):
        try:
            return check(value)
        except Invalid as exc:
            raise pydantic_error(exc) from None
    return PlainValidator(validate)


def _is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _out_of_range(v, lo, hi, lo_open: bool, hi_open: bool, *, python_number: Callable,
                  between: bool) -> Invalid | None:
    """Why the number `v` is not in [lo, hi] (an open end excluded), or None.

    A `between` rule (fractions, ratios) says both ends; others name the bound that was broken.
    Python says "between" only of a closed range, which is how the word reads in Python."""
    nan, infinite = v != v, v in (math.inf, -math.inf)  # no isfinite: it overflows on big ints
    below = v < lo or (lo_open and v == lo)
    above = v > hi or (hi_open and v == hi)
    if nan:
        return Invalid("must not be NaN", "must be a number, got nan")
    if below:
        sign, bound = (">" if lo_open else ">="), lo
    elif above:
        sign, bound = ("<" if hi_open else "<="), hi
    elif infinite:
        sign = bound = None
    else:
        return None
    python = json = "must be finite"
    if sign is not None:
        python, json = f"must be {sign} {python_number(bound)}", f"must be {sign} {bound:g}"
    if between and not (lo_open or hi_open):
        python = f"must be between {python_number(lo)} and {python_number(hi)}"
    if between:
        excluded = " and ".join(f"{b:g}" for b, is_open in ((lo, lo_open), (hi, hi_open))
                                if is_open)
        json = f"must be between {lo:g} and {hi:g}" + (f" ({excluded} excluded)" if excluded
                                                       else "")
    return Invalid(f"{python}, got {python_number(v)}", f"{json}, got {v!r}")


def real(lo: float, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False,
         between: bool = False) -> Callable:
    """A finite real number in [lo, hi] (an open end excluded), as a float."""
    def check(value):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise Invalid(f"must be a number, got {value!r:.100}", type_error=True)
        try:
            number = float(value)
        except OverflowError:   # an integer beyond the float range
            number = math.inf if value > 0 else -math.inf
        problem = _out_of_range(number, lo, hi, lo_open, hi_open, between=between,
                                python_number=lambda x: str(float(x)))
        if problem is not None:
            raise problem
        return number
    return check


def count(lo: int, hi: int = _limits.MAX_STEPS, *, lo_open: bool = False,
          between: bool = False) -> Callable:
    """An integer in [lo, hi] (lo excluded when lo_open)."""
    def check(value):
        if not _is_integer(value):
            raise Invalid(f"must be an integer {'>' if lo_open else '>='} {lo}, got {value!r:.100}",
                          f"must be an integer, got {value!r:.100}", type_error=True)
        problem = _out_of_range(value, lo, hi, lo_open, False, between=between,
                                python_number=str)
        if problem is not None:
            raise problem
        return int(value)
    return check


def auto_or_bytes(value):
    """"auto" or a number of bytes >= 0."""
    if isinstance(value, str) and value == "auto":
        return value
    if not _is_integer(value) or value < 0:
        raise Invalid(f'must be a number of bytes >= 0 or "auto", got {value!r:.100}',
                      f'must be "auto" or an integer >= 0, got {value!r:.100}',
                      type_error=not _is_integer(value) and not isinstance(value, str))
    return int(value)


def auto_or_count(hi: int) -> Callable:
    """"auto" or an integer in [1, hi]."""
    def check(value):
        if isinstance(value, str) and value == "auto":
            return value
        anything = (f'must be an integer >= 1 or "auto", got {value!r:.100}',
                    f'must be "auto" or a positive integer, got {value!r:.100}')
        if not _is_integer(value):
            raise Invalid(*anything, type_error=not isinstance(value, str))
        if value < 1:
            raise Invalid(f"must be >= 1, got {value}", anything[1])
        if value > hi:
            raise Invalid(f"must be <= {hi}, got {value}",
                          f'must be "auto" or an integer <= {hi}, got {value!r}')
        return int(value)
    return check


def flag(value) -> bool:
    """True or False (not 1, not "yes")."""
    if not isinstance(value, bool):
        raise Invalid(f"must be True or False, got {value!r:.100}",
                      f"must be true or false, got {value!r:.100}", type_error=True)
    return value


def one_of(*allowed: str) -> Callable:
    def check(value):
        if not isinstance(value, str) or value not in allowed:
            listed = ", ".join(map(repr, allowed))
            spoken = ", ".join(map(repr, allowed[:-1])) + f" or {allowed[-1]!r}"
            raise Invalid(f"must be one of {listed}, got {value!r:.100}",
                          f"must be one of {spoken}, got {value!r:.100}")
        return value
    return check


def pair(element: Callable, what: str, *, ordered: bool = False) -> Callable:
    """Two values, each checked by `element`; `what` names them, e.g. "(beta1, beta2)". With
    `ordered` the first may not exceed the second."""
    def check(value):
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise Invalid(f"must be a pair {what}, got {value!r:.100}",
                          f"must be a list of two values {what}, got {value!r:.100}",
                          type_error=True)
        checked = []
        for i, item in enumerate(value):
            try:
                checked.append(element(item))
            except Invalid as exc:
                exc.where = f"[{i}]"
                raise
        if ordered and checked[0] > checked[1]:
            raise Invalid(f"must have min <= max, got {tuple(value)}",
                          f"must have min <= max, got {list(value)}")
        return tuple(checked)
    return check


# ---------------------------------------------------------------------------------------------
# The types that settings are declared with.

Fraction = Annotated[float, rule(real(0.0, 1.0, between=True))]           # [0, 1]
Positive = Annotated[float, rule(real(0.0, lo_open=True))]
NonNegFloat = Annotated[float, rule(real(0.0))]
LearningRate = Annotated[float, rule(real(0.0, _limits.MAX_LR))]
Betas = Annotated[tuple[float, float], rule(pair(real(0.0, 1.0, hi_open=True, between=True),
                                                 "(beta1, beta2)"))]
Eps = Annotated[float, rule(real(0.0, _limits.MAX_EPS))]
WeightDecay = Annotated[float, rule(real(0.0, _limits.MAX_WEIGHT_DECAY))]
LossScale = Annotated[float, rule(real(0.0, _limits.MAX_LOSS_SCALE))]
MinLossScale = Annotated[float, rule(real(0.0, _limits.MAX_LOSS_SCALE, lo_open=True))]

PosInt = Annotated[int, rule(count(0, lo_open=True))]
NonNegInt = Annotated[int, rule(count(0))]
Iteration = Annotated[int, rule(count(-1))]    # a scheduler's last_batch_iteration
Exponent = Annotated[int, rule(count(0, 64, between=True))]
UpdateInterval = Annotated[int | Literal["auto"], rule(auto_or_count(_limits.MAX_INTERVAL))]
DeviceSumBudget = Annotated[int | Literal["auto"], rule(auto_or_bytes)]
SelectInterval = Annotated[int | Literal["auto"], rule(auto_or_count(_limits.MAX_STEPS))]
IntervalBounds = Annotated[tuple[int, int], rule(pair(count(1, _limits.MAX_INTERVAL),
                                                      "(min_steps, max_steps)", ordered=True))]
Flag = Annotated[bool, rule(flag)]
SelectStrategy = Annotated[str, rule(one_of("auto", "step", "epoch", "drift"))]
Importance = Annotated[str, rule(one_of("l2", "l1"))]
DeferredCredit = Annotated[str, rule(one_of("mean", "window", "moments", "factored"))]
SumDtype = Annotated[str, rule(one_of("auto", "float32", "bfloat16"))]
MomentsDtype = Annotated[str, rule(one_of("float32", "bfloat16"))]
Lookahead = Annotated[float, rule(real(0.0, 4.0, between=True))]                # [0, 4]


def select_interval_for(strategy: str, interval: int | str) -> None:
    """Raise Invalid (said of `select_interval`) unless `interval` fits `strategy`.

    DeepSpeed's pairs (deepspeed/runtime/zenflow/engine.py, configure_zenflow): "step" and
    "epoch" count steps or epochs, so they need a number (DeepSpeed raises a ValueError for
    "auto"); "auto" reselects once per epoch and takes no number (DeepSpeed raises for one, saying
    it would be overwritten). "drift", ours, decides by itself, so it takes no number either.
    Refused when the setting is read, before any work, naming both keys."""
    if strategy in ("step", "epoch") and interval == "auto":
        unit = "steps" if strategy == "step" else "epochs"
        raise Invalid(
            f'must be an integer >= 1 ({unit} between reselections) with select_strategy='
            f'"{strategy}", got \'auto\'; select_strategy="drift" reselects when the selection '
            f'drifts',
            f'must be a positive integer ({unit} between reselections) when select_strategy is '
            f'"{strategy}", got "auto"; select_strategy "drift" reselects when the selection '
            f'drifts')
    if strategy in ("auto", "drift") and interval != "auto":
        what = ("reselects once per epoch, as DeepSpeed's" if strategy == "auto"
                else "reselects when the selection drifts")
        raise Invalid(
            f'must be \'auto\' with select_strategy="{strategy}" (it {what}), got {interval!r}; '
            f'for every {interval} steps use select_strategy="step"',
            f'must be "auto" when select_strategy is "{strategy}" (it {what}), got '
            f'{interval!r}; for every {interval} steps set select_strategy "step"')


def select_interval_fits_strategy(interval, info):
    """A pydantic field validator of `select_interval` (the constructor's settings and the JSON
    block share it): `select_interval_for` against the `select_strategy` already validated."""
    strategy = info.data.get("select_strategy")   # absent when it was refused itself
    if strategy is not None:
        try:
            select_interval_for(strategy, interval)
        except Invalid as exc:
            raise pydantic_error(exc) from None
    return interval
