"""Argument checks shared by the optimizers: each error names the argument, value and what is allowed."""
from __future__ import annotations

import math
import numbers

import torch

from zenflow import _limits

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fail(owner: str, message: str, exc=ValueError):
    raise exc(f"{owner}: {message}")


def number(owner: str, name: str, value, *, low=None, high=None, low_open=False, high_open=False):
    """A finite real number in [low, high] (open ends as asked); `high` defaults to the sane
    bound for `name` in `_limits.FLOAT_MAX`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(owner, f"{name} must be a number, got {value!r:.100}", TypeError)
    value = float(value)
    if value != value:
        _fail(owner, f"{name} must not be NaN")
    if high is None:
        high = _limits.FLOAT_MAX.get(name)
    if low is not None and (value < low or (low_open and value == low)):
        _fail(owner, f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and (value > high or (high_open and value == high)):
        _fail(owner, f"{name} must be {'<' if high_open else '<='} {high}, got {value}")
    if not math.isfinite(value):
        _fail(owner, f"{name} must be finite, got {value}")
    return value


def between(owner: str, name: str, value, low, high):
    value = number(owner, name, value)
    if not low <= value <= high:
        _fail(owner, f"{name} must be between {low} and {high}, got {value}")
    return value


def integer(owner: str, name: str, value, *, low: int, high: int | None = None,
            allow_auto: bool = False):
    """An integer in [low, high]; `high` defaults to `_limits.INT_MAX` for `name`, else
    `_limits.MAX_STEPS`."""
    if high is None:
        high = _limits.INT_MAX.get(name, _limits.MAX_STEPS)
    if allow_auto and isinstance(value, str):
        if value != "auto":
            _fail(owner, f"{name} must be an integer >= {low} or \"auto\", got {value!r:.100}")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        allowed = f"an integer >= {low}" + (' or "auto"' if allow_auto else "")
        _fail(owner, f"{name} must be {allowed}, got {value!r:.100}", TypeError)
    if value < low:
        _fail(owner, f"{name} must be >= {low}, got {value}")
    if value > high:
        _fail(owner, f"{name} must be <= {high}, got {value}")
    return int(value)


def interval_bounds(owner: str, name: str, value) -> tuple[int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        _fail(owner, f"{name} must be a pair (min_steps, max_steps), got {value!r:.100}",
              TypeError)
    low = integer(owner, f"{name}[0]", value[0], low=1, high=_limits.MAX_INTERVAL)
    high = integer(owner, f"{name}[1]", value[1], low=1, high=_limits.MAX_INTERVAL)
    if high < low:
        _fail(owner, f"{name} must have min <= max, got {tuple(value)}")
    return low, high


def choice(owner: str, name: str, value, allowed: tuple[str, ...]):
    if not isinstance(value, str) or value not in allowed:
        _fail(owner, f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r:.100}")
    return value


def group_hyperparameters(owner: str, group: dict) -> None:
    """The AdamW hyperparameters of one param group."""
    number(owner, "lr", group["lr"], low=0.0)
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        _fail(owner, f"betas must be a pair (beta1, beta2), got {betas!r:.100}", TypeError)
    for i, beta in enumerate(betas):
        number(owner, f"betas[{i}]", beta, low=0.0, high=1.0, high_open=True)
    number(owner, "eps", group["eps"], low=0.0)
    number(owner, "weight_decay", group["weight_decay"], low=0.0)


def _tensors(owner: str, where: str, values) -> list:
    """`values` (a tensor or an iterable of tensors) as a list, each a leaf tensor."""
    if isinstance(values, torch.Tensor):
        values = [values]
    elif isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        _fail(owner, f"{where} must be an iterable of tensors, got {type(values).__name__}",
              TypeError)
    values = list(values)
    for j, p in enumerate(values):
        if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
            p = p[1]  # named parameters, as from model.named_parameters()
        if not isinstance(p, torch.Tensor):
            _fail(owner, f"{where}[{j}] must be a torch.Tensor, got {type(p).__name__}", TypeError)
        if not (p.is_leaf or p.retains_grad):
            _fail(owner, f"{where}[{j}] (shape {tuple(p.shape)}) is not a leaf tensor (it was "
                         "computed from others); pass the parameters themselves")
    return values


def param_list(owner: str, params) -> list:
    """The params argument as a list of tensors or of param groups (dicts whose 'params' are
    lists), refusing what torch.optim would refuse later with a less helpful message."""
    if isinstance(params, torch.Tensor):
        _fail(owner, "params must be an iterable of tensors or param groups, got a single tensor",
              TypeError)
    if isinstance(params, dict):
        _fail(owner, "params must be an iterable of tensors or param groups, got a dict; pass one "
                     "group as [group]", TypeError)
    if isinstance(params, (str, bytes)) or not hasattr(params, "__iter__"):
        _fail(owner, "params must be an iterable of tensors or param groups, got "
                     f"{type(params).__name__}", TypeError)
    params = list(params)
    if not params:
        _fail(owner, "params is empty: pass the model's parameters")
    if not any(isinstance(p, dict) for p in params):
        flat = _tensors(owner, "params", params)
    else:
        for i, group in enumerate(params):
            if not isinstance(group, dict):
                _fail(owner, f"params mixes param groups (dicts) and {type(group).__name__} "
                             f"(params[{i}]): pass either tensors or groups", TypeError)
            if "params" not in group:
                _fail(owner, f"param group {i} has no 'params' key; a group is a dict like "
                             f"{{'params': [...], 'lr': 1e-4}}, got keys {sorted(map(str, group))}")
        params = [dict(g, params=_tensors(owner, f"param group {i} 'params'", g["params"]))
                  for i, g in enumerate(params)]
        flat = [p for g in params for p in g["params"]]
        if not flat:
            _fail(owner, "params is empty: every param group has an empty 'params' list")
    flat = [p[1] if isinstance(p, tuple) else p for p in flat]
    seen: dict[int, int] = {}
    for i, p in enumerate(flat):
        if id(p) in seen:
            _fail(owner, f"params[{i}] (shape {tuple(p.shape)}) is the same tensor as "
                         f"params[{seen[id(p)]}]; pass each parameter once")
        seen[id(p)] = i
    return params


def parameters(owner: str, params: list[torch.Tensor]) -> torch.device:
    """Dense, contiguous, non-empty floating tensors on one device; returns that device.

    Parameters that do not require grad are accepted, as torch.optim does: they never get a
    gradient, so the optimizers leave them alone.
    """
    if not params:
        _fail(owner, "params is empty: pass the model's parameters")
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            _fail(owner, f"params[{i}] must be a torch.Tensor, got {type(p).__name__}", TypeError)
    device = params[0].device
    for i, p in enumerate(params):
        where = f"params[{i}] (shape {tuple(p.shape)})"
        if p.dtype not in _FLOAT_DTYPES:
            _fail(owner, f"{where} has dtype {p.dtype}; allowed: float32, bfloat16, float16",
                  TypeError)
        if p.numel() == 0:
            _fail(owner, f"{where} has no elements; leave empty tensors out of params")
        if p.device != device:
            _fail(owner, f"all params must be on one device: params[0] is on {device}, "
                         f"{where} is on {p.device}")
        if p.is_sparse or not p.is_contiguous():
            _fail(owner, f"{where} must be a dense contiguous tensor")
    return device
