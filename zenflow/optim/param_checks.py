"""Checks of the `params` argument shared by the optimizers: each error names the argument (or the
parameter), the value and what is allowed. The other arguments are settings, checked by the
rules in zenflow.config.rules (zenflow.config.settings)."""
from __future__ import annotations

import torch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fail(owner: str, message: str, exc=ValueError):
    raise exc(f"{owner}: {message}")


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
        if p.device.type == "meta":
            _fail(owner, f"{where} is on the meta device, which holds no values; materialize "
                         "the model first (model.to_empty(device=...) and initialize its "
                         "weights, or load them) and build the optimizer over those parameters")
        if p.is_sparse or not p.is_contiguous():
            _fail(owner, f"{where} must be a dense contiguous tensor")
    return device


def replicas_agree(owner: str, params: list[torch.Tensor], partition) -> None:
    """Data parallel: every rank must start from the same weights, or the ranks train apart
    (each installs its own rows of every matrix). One checksum collective says."""
    first = partition.first_disagreement(params, "checking the replicas agree")
    if first is not None:
        raise ValueError(
            f"{owner}: params[{first}] (shape {tuple(params[first].shape)}) differs "
            f"between the {partition.world_size} ranks: every rank must start from the "
            "same weights. Seed the model identically on every rank, wrap it in "
            "DistributedDataParallel (which broadcasts rank 0's weights) or broadcast them "
            "before building the optimizer; zenflow.initialize does it for you")
