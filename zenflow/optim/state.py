"""The one state format of ZenFlowAdamW and OffloadAdamW, composed from its parts' own state.

    {"state": {param number: per-parameter state},     # numbered as torch.optim numbers them
     "param_groups": [... as torch.optim, "params" as numbers ...],
     "zenflow": {"optimizer": its class name, the StepCounters' fields,
                 "selection": the ColumnSelector's, "window": the window's,
                 "in_flight", "in_flight_jobs": the host pipeline's update in flight,
                 "topk_ratio", "overlap_step", "world_size", "rank": what it must match}}

A parameter whose state lives on the host saves {"kind": "host", "host": the HostPipeline's state
of it, "device": its DeviceColumns'}; a vector updated on the device saves {"kind": "vector",
**its DeviceVector's}. Every part writes and reads its own piece; loading checks every piece
before any part changes. torch's state-dict hooks (Optimizer.register_state_dict_pre_hook and
the three others) run around saving and loading as they do for any torch optimizer.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class StepCounters:
    """What the optimizer counts, saved with its state."""
    step: int = 0            # optimizer steps taken (skipped ones not counted)
    window_steps: int = 0    # steps accumulated in the current window
    skipped_steps: int = 0
    num_windows: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):
            setattr(self, f.name, state[f.name])


def _numbers(opt) -> dict:
    """Each parameter's number, as torch.optim numbers them in a state dict."""
    return {p: i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}


def compose(opt) -> dict:
    """The state of `opt` from its parts (the host pipeline drains first)."""
    number = _numbers(opt)
    host = opt._pipeline.state_dict()
    state = {}
    for m in opt._host_params:
        state[number[m.param]] = {"kind": "host", "host": host["params"][m.host_index],
                                  "device": m.selected.state_dict()}
    for v in opt._vector_params:
        state[number[v.param]] = {"kind": "vector", **v.state.state_dict()}
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [number[p] for p in g["params"]]} for g in opt.param_groups]
    return {"state": state, "param_groups": groups, "zenflow": {
        "optimizer": opt._NAME, **opt.counters.state_dict(),
        "selection": opt._selector.state_dict(), "window": opt._window.state_dict(),
        "in_flight": host["in_flight"], "in_flight_jobs": host["in_flight_jobs"],
        "topk_ratio": opt.settings.topk_ratio,
        "overlap_step": opt.settings.overlap_step, "world_size": opt._partition.world_size,
        "rank": opt._partition.rank}}


def check(opt, state_dict: dict) -> None:
    """Raise ValueError, naming the optimizer, unless `state_dict` fits `opt`; changes nothing."""
    try:
        _check(opt, state_dict)
    except ValueError as exc:
        raise ValueError(f"{opt._NAME}: load_state_dict: {exc}") from None


def _check(opt, state_dict: dict) -> None:
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("zenflow"), dict):
        raise ValueError("got a state dict without the 'zenflow' section; it was not saved by "
                         "ZenFlowAdamW or OffloadAdamW")
    saved = state_dict["zenflow"]
    if saved.get("optimizer", opt._NAME) != opt._NAME:
        raise ValueError(f"the state was saved by {saved['optimizer']}, not {opt._NAME}")
    sizes = [len(g["params"]) for g in state_dict.get("param_groups", [])]
    if sizes != [len(g["params"]) for g in opt.param_groups]:
        raise ValueError(f"saved param groups have sizes {sizes}, this optimizer's have "
                         f"{[len(g['params']) for g in opt.param_groups]}")
    world_size, rank = saved.get("world_size", 1), saved.get("rank", 0)
    if world_size != opt._partition.world_size:
        raise ValueError(f"the state was saved by rank {rank} of {world_size}, but this run has "
                         f"{opt._partition.world_size} rank(s); each rank holds only its share of "
                         "the host state, so resume on the same number of ranks")
    if rank != opt._partition.rank:
        raise ValueError(f"this is rank {opt._partition.rank} but the state belongs to rank {rank}")
    if saved["topk_ratio"] != opt.settings.topk_ratio:
        raise ValueError(f"saved topk_ratio {saved['topk_ratio']} differs from this optimizer's "
                         f"{opt.settings.topk_ratio}")
    number, states = _numbers(opt), state_dict["state"]
    for m in opt._host_params:
        saved = _saved_piece(states.get(number[m.param]), "host", m.param)
        m.selected.check_state_dict(saved["device"], f"the selected columns of the parameter of "
                                                     f"shape {tuple(m.param.shape)}")
    for v in opt._vector_params:
        v.state.check_state_dict(_saved_piece(states.get(number[v.param]), "vector", v.param),
                                 f"the parameter of shape {tuple(v.param.shape)}")
    opt._pipeline.check_state_dict(
        {"params": [states[number[m.param]]["host"] for m in opt._host_params],
         "in_flight": state_dict["zenflow"].get("in_flight"),
         "in_flight_jobs": state_dict["zenflow"].get("in_flight_jobs")})


def _saved_piece(saved, kind: str, param) -> dict:
    if not isinstance(saved, dict) or saved.get("kind") != kind:
        raise ValueError(f"no {kind} state saved for the parameter of shape {tuple(param.shape)}")
    return saved


def _load(opt, state_dict: dict) -> None:
    check(opt, state_dict)
    number, states, saved = _numbers(opt), state_dict["state"], state_dict["zenflow"]
    opt._pipeline.load_state_dict({"params": [states[number[m.param]]["host"]
                                              for m in opt._host_params],
                                   "in_flight": saved["in_flight"],
                                   "in_flight_jobs": saved.get("in_flight_jobs")})
    for m in opt._host_params:
        m.selected.load_state_dict(states[number[m.param]]["device"])
    for v in opt._vector_params:
        v.state.load_state_dict(states[number[v.param]])
    for group, saved_group in zip(opt.param_groups, state_dict["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    opt.counters.load_state_dict(saved)
    opt._selector.load_state_dict(saved["selection"])
    opt._window.load_state_dict(saved["window"])
    # The weights as they are now (usually just loaded from the same checkpoint) belong with
    # this state; only later outside writes are adopted.
    opt._outside_writes.forget()


def save(opt) -> dict:
    """opt.state_dict(): compose() after adopting weights written outside the optimizer, with
    torch's state_dict pre-hooks before and post-hooks after (a post-hook may return a new dict),
    as torch.optim.Optimizer.state_dict runs them."""
    for pre_hook in opt._optimizer_state_dict_pre_hooks.values():
        pre_hook(opt)
    opt._outside_writes.adopt(opt._selector.has_chosen)
    state_dict = compose(opt)
    for post_hook in opt._optimizer_state_dict_post_hooks.values():
        result = post_hook(opt, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def load(opt, state_dict: dict) -> None:
    """opt.load_state_dict(): restore what save() returned, checked first, so that a failed
    load leaves `opt` as it was; torch's load_state_dict pre-hooks run before (each may return
    a new dict) and post-hooks after, as torch.optim.Optimizer.load_state_dict runs them."""
    if isinstance(state_dict, dict):
        state_dict = state_dict.copy()   # shallow, as torch does
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(opt, state_dict)
        if result is not None:
            state_dict = result
    _load(opt, state_dict)
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)
