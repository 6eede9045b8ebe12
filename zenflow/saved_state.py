"""Checks that the parts of the optimizers share when they read back a saved state.

A state is checked whole before any of it is loaded, so that a refused load leaves the optimizer
as it was; each check raises ValueError naming the entry, the value and what is allowed."""
from __future__ import annotations

import math

import torch


def _where(what: str) -> str:
    return f"{what}: " if what else ""


def check_saved_tensors(saved, expected: dict[str, torch.Tensor], what: str = "") -> None:
    """Raise ValueError unless the dict `saved` holds a tensor of each `expected` one's shape and
    kind: finite floating-point values where a float is expected (an `exp_avg_sq`, a second
    moment, also non-negative), integers where integers are."""
    where = _where(what)
    if not isinstance(saved, dict):
        raise ValueError(f"{where}saved state is {type(saved).__name__}, expected a dict")
    for name, have in expected.items():
        got = saved.get(name)
        if not isinstance(got, torch.Tensor) or got.shape != have.shape:
            shown = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise ValueError(f"{where}saved {name} is {shown}, expected {tuple(have.shape)}")
        if have.is_floating_point():
            if not got.is_floating_point():
                raise ValueError(f"{where}saved {name} has dtype {got.dtype}, expected floating "
                                 "point")
            if not got.numel():
                continue
            # one pass and no temporaries (the state of a 7B model is tens of GB); a NaN makes
            # both NaN
            low, high = (float(x) for x in torch.aminmax(got.detach()))
            if not (math.isfinite(low) and math.isfinite(high)):
                raise ValueError(f"{where}saved {name} holds non-finite values (inf or NaN)")
            if name == "exp_avg_sq" and low < 0:
                raise ValueError(f"{where}saved {name} holds negative values; a second moment "
                                 "is never negative")
        elif got.is_floating_point() or got.is_complex() or got.dtype == torch.bool:
            raise ValueError(f"{where}saved {name} has dtype {got.dtype}, expected integers")


def check_count(value, name: str, what: str = "", minimum: int = 0) -> None:
    """Raise ValueError unless `value` is a Python integer (not a bool) >= `minimum`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{_where(what)}saved {name} must be an integer >= {minimum}, got "
                         f"{value!r}")


def check_like(saved, current: dict, what: str, nullable: frozenset = frozenset()) -> None:
    """Raise ValueError unless the plain-data dict `saved` has the keys of `current` (a part's
    own state_dict()) with values of the same kind: a bool for a bool, an integer for an
    integer, a number for a float, and no value negative or NaN (counters, gaps, fractions and
    importance sums never are). A None in `current`, or a key in `nullable` (a value that starts
    as None, as a last window's length does), accepts None or such a number."""
    if not isinstance(saved, dict):
        raise ValueError(f"{_where(what)}saved state is {type(saved).__name__}, expected a dict")
    if set(saved) != set(current):
        raise ValueError(f"{_where(what)}saved keys {sorted(saved)} differ from the expected "
                         f"{sorted(current)}")
    for key, have in current.items():
        got = saved[key]
        if isinstance(have, dict):
            check_like(got, have, f"{what} {key}".strip())
            continue
        if got is None and (have is None or key in nullable):
            continue
        ok = (isinstance(got, bool) if isinstance(have, bool) else
              isinstance(got, int) and not isinstance(got, bool) if isinstance(have, int) else
              isinstance(got, (int, float)) and not isinstance(got, bool))
        if ok and not isinstance(got, bool) and (math.isnan(got) or got < 0):
            ok = False
        if not ok:
            kind = ("True or False" if isinstance(have, bool) else
                    "a non-negative integer" if isinstance(have, int) else
                    "a non-negative number" + (" or None" if have is None else ""))
            raise ValueError(f"{_where(what)}saved {key} must be {kind}, got {got!r}")
