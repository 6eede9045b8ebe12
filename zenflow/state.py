"""The one state format of ZenFlowAdamW and OffloadAdamW, composed from the parts' own state.

    {"state": {param index: per-parameter state},      # as torch.optim numbers parameters
     "param_groups": [... as torch.optim ...],
     "zenflow": {counters, selection schedule, window, host pipeline bookkeeping}}

A parameter whose state lives on the host has {"kind": "host", "host": {master, exp_avg,
exp_avg_sq, grad_sum, host_step, num_grads}, "device": {index, master, exp_avg, exp_avg_sq,
step}} (the device part holds its selected columns); a vector updated on the device has {"kind":
"vector", master, exp_avg, exp_avg_sq, step}. Loading checks everything against this optimizer
before changing anything.
"""
from __future__ import annotations

import torch

_DEVICE_KINDS = ("index", "master", "exp_avg", "exp_avg_sq")
_VECTOR_KINDS = ("master", "exp_avg", "exp_avg_sq")


def _index_of(opt) -> dict:
    return {p: i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}


def device_bytes(opt) -> int:
    """Bytes of optimizer state the optimizer keeps on the device (columns and vectors)."""
    total = 0
    for m in opt._host_params:
        total += sum(getattr(m.columns, k).numel() * getattr(m.columns, k).element_size()
                     for k in (*_DEVICE_KINDS, "grad"))
    for v in opt._device_params:
        owned = [v.state.exp_avg, v.state.exp_avg_sq]
        if v.state.master.data_ptr() != v.param.data_ptr():
            owned.append(v.state.master)
        total += sum(t.numel() * t.element_size() for t in owned)
    return total


def optimizer_state_dict(opt) -> dict:
    index_of = _index_of(opt)
    host = opt._pipeline.state_dict()           # drains the host first
    state = {}
    for m in opt._host_params:
        cols = m.columns
        state[index_of[m.param]] = {
            "kind": "host", "host": host["params"][m.index],
            "device": {"step": cols.step, **{k: getattr(cols, k).clone() for k in _DEVICE_KINDS}}}
    for v in opt._device_params:
        state[index_of[v.param]] = {"kind": "vector", "step": v.state.step,
                                    **{k: getattr(v.state, k).clone() for k in _VECTOR_KINDS}}
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [index_of[p] for p in g["params"]]} for g in opt.param_groups]
    return {"state": state, "param_groups": groups, "zenflow": {
        "optimizer": opt._NAME, "step": opt._step, "window_steps": opt._window_steps,
        "selected": opt._selected, "in_flight": host["in_flight"],
        "skipped_steps": opt.skipped_steps, "num_reselections": opt.num_reselections,
        "num_windows": opt.num_windows, "schedule": opt._schedule.state_dict(),
        "window": opt._window.state_dict(), "topk_ratio": opt.settings.topk_ratio,
        "overlap_step": opt.settings.overlap_step, "world_size": opt._partition.world_size,
        "rank": opt._partition.rank}}


def _fail(opt, message: str):
    raise ValueError(f"{opt._NAME}: load_state_dict: {message}")


def _check_shape(opt, param, saved: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if not isinstance(saved, torch.Tensor) or tuple(saved.shape) != tuple(expected.shape):
        got = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
        _fail(opt, f"saved {what} of the parameter of shape {tuple(param.shape)} is {got}, "
                   f"expected {tuple(expected.shape)}")


def validate(opt, state_dict: dict) -> dict:
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("zenflow"), dict):
        _fail(opt, "got a state dict without the 'zenflow' section; it was not saved by "
                   "ZenFlowAdamW or OffloadAdamW")
    saved = state_dict["zenflow"]
    if saved.get("optimizer", opt._NAME) != opt._NAME:
        _fail(opt, f"the state was saved by {saved['optimizer']}, not {opt._NAME}")
    groups = state_dict.get("param_groups", [])
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in opt.param_groups]:
        _fail(opt, f"saved param groups have sizes {[len(g['params']) for g in groups]}, this "
                   f"optimizer's have {[len(g['params']) for g in opt.param_groups]}")
    if saved.get("world_size", 1) != opt._partition.world_size:
        _fail(opt, f"the state was saved by rank {saved.get('rank', 0)} of "
                   f"{saved.get('world_size', 1)}, but this run has {opt._partition.world_size} "
                   "rank(s); each rank holds only its share of the host state, so resume on the "
                   "same number of ranks")
    if saved.get("rank", 0) != opt._partition.rank:
        _fail(opt, f"this is rank {opt._partition.rank} but the state belongs to rank "
                   f"{saved.get('rank', 0)}")
    if saved["topk_ratio"] != opt.settings.topk_ratio:
        _fail(opt, f"saved topk_ratio {saved['topk_ratio']} differs from this optimizer's "
                   f"{opt.settings.topk_ratio}")
    index_of = _index_of(opt)
    states = state_dict["state"]
    for m in opt._host_params:
        s = states.get(index_of[m.param])
        if not isinstance(s, dict) or s.get("kind") != "host":
            _fail(opt, f"no host state saved for the parameter of shape {tuple(m.param.shape)}")
        for k in ("index", "master"):
            _check_shape(opt, m.param, s["device"][k], getattr(m.columns, k), f"device {k}")
    for v in opt._device_params:
        s = states.get(index_of[v.param])
        if not isinstance(s, dict) or s.get("kind") != "vector":
            _fail(opt, f"no vector state saved for the parameter of shape {tuple(v.param.shape)}")
        for k in _VECTOR_KINDS:
            _check_shape(opt, v.param, s[k], getattr(v.state, k), k)
    opt._pipeline.validate({"params": [states[index_of[m.param]]["host"]
                                       for m in opt._host_params]}, opt._NAME)
    return saved


def load_optimizer_state_dict(opt, state_dict: dict) -> None:
    saved = validate(opt, state_dict)
    index_of = _index_of(opt)
    states = state_dict["state"]
    opt._pipeline.load_state_dict({"params": [states[index_of[m.param]]["host"]
                                              for m in opt._host_params],
                                   "in_flight": saved["in_flight"]})
    for m in opt._host_params:
        s = states[index_of[m.param]]["device"]
        m.columns.step = s["step"]
        for k in _DEVICE_KINDS:
            setattr(m.columns, k, s[k].to(device=opt.device, dtype=getattr(m.columns, k).dtype,
                                          copy=True))
    for v in opt._device_params:
        s = states[index_of[v.param]]
        v.state.step = s["step"]
        for k in _VECTOR_KINDS:
            getattr(v.state, k).copy_(s[k])
    for group, saved_group in zip(opt.param_groups, state_dict["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    opt._step, opt._window_steps = saved["step"], saved["window_steps"]
    opt._selected = saved["selected"]
    opt.skipped_steps = saved["skipped_steps"]
    opt.num_reselections, opt.num_windows = saved["num_reselections"], saved["num_windows"]
    opt._schedule.load_state_dict(saved["schedule"])
    opt._window.load_state_dict(saved["window"])
