"""Argument checks shared by the optimizers: each error names the argument, value and what is allowed."""
from __future__ import annotations

import numbers

import torch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fail(owner: str, message: str, exc=ValueError):
    raise exc(f"{owner}: {message}")


def number(owner: str, name: str, value, *, low=None, high=None, low_open=False, high_open=False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(owner, f"{name} must be a number, got {value!r}", TypeError)
    value = float(value)
    if value != value:
        _fail(owner, f"{name} must not be NaN")
    if low is not None and (value < low or (low_open and value == low)):
        _fail(owner, f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and (value > high or (high_open and value == high)):
        _fail(owner, f"{name} must be {'<' if high_open else '<='} {high}, got {value}")
    return value


def between(owner: str, name: str, value, low, high):
    value = number(owner, name, value)
    if not low <= value <= high:
        _fail(owner, f"{name} must be between {low} and {high}, got {value}")
    return value


def integer(owner: str, name: str, value, *, low: int, allow_auto: bool = False):
    if allow_auto and isinstance(value, str):
        if value != "auto":
            _fail(owner, f"{name} must be an integer >= {low} or \"auto\", got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        allowed = f"an integer >= {low}" + (' or "auto"' if allow_auto else "")
        _fail(owner, f"{name} must be {allowed}, got {value!r}", TypeError)
    if value < low:
        _fail(owner, f"{name} must be >= {low}, got {value}")
    return int(value)


def interval_bounds(owner: str, name: str, value) -> tuple[int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        _fail(owner, f"{name} must be a pair (min_steps, max_steps), got {value!r}", TypeError)
    low = integer(owner, f"{name}[0]", value[0], low=1)
    high = integer(owner, f"{name}[1]", value[1], low=1)
    if high < low:
        _fail(owner, f"{name} must have min <= max, got {tuple(value)}")
    return low, high


def choice(owner: str, name: str, value, allowed: tuple[str, ...]):
    if value not in allowed:
        _fail(owner, f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def group_hyperparameters(owner: str, group: dict) -> None:
    """The AdamW hyperparameters of one param group."""
    number(owner, "lr", group["lr"], low=0.0)
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        _fail(owner, f"betas must be a pair (beta1, beta2), got {betas!r}", TypeError)
    for i, beta in enumerate(betas):
        number(owner, f"betas[{i}]", beta, low=0.0, high=1.0, high_open=True)
    number(owner, "eps", group["eps"], low=0.0)
    number(owner, "weight_decay", group["weight_decay"], low=0.0)


def param_list(owner: str, params) -> list:
    """The params argument as a list (it may be a generator), refusing an empty one."""
    if isinstance(params, torch.Tensor):
        _fail(owner, "params must be an iterable of tensors or param groups, got a single tensor",
              TypeError)
    params = list(params)
    if not params:
        _fail(owner, "params is empty: pass the model's trainable parameters")
    return params


def parameters(owner: str, params: list[torch.Tensor]) -> torch.device:
    """All trainable, dense, contiguous floating tensors on one device; returns that device."""
    if not params:
        _fail(owner, "params is empty: pass the model's trainable parameters")
    device = params[0].device
    for i, p in enumerate(params):
        where = f"params[{i}] (shape {tuple(p.shape)})"
        if not isinstance(p, torch.Tensor):
            _fail(owner, f"params[{i}] must be a torch.Tensor, got {type(p).__name__}", TypeError)
        if p.dtype not in _FLOAT_DTYPES:
            _fail(owner, f"{where} has dtype {p.dtype}; allowed: float32, bfloat16, float16",
                  TypeError)
        if not p.requires_grad:
            _fail(owner, f"{where} does not require grad; pass only trainable parameters, "
                         "e.g. [p for p in model.parameters() if p.requires_grad]")
        if p.device != device:
            _fail(owner, f"all params must be on one device: params[0] is on {device}, "
                         f"{where} is on {p.device}")
        if p.is_sparse or not p.is_contiguous():
            _fail(owner, f"{where} must be a dense contiguous tensor")
    return device
