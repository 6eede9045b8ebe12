"""The one state format of ZenFlowAdamW and OffloadAdamW, composed from its parts' own state.

    {"state": {param number: per-parameter state},     # numbered as torch.optim numbers them
     "param_groups": [... as torch.optim, "params" as numbers ...],
     "zenflow": {"format_version": FORMAT_VERSION,
                 "optimizer": its class name, the StepCounters' fields,
                 "selection": the ColumnSelector's, "window": the window's,
                 "in_flight", "in_flight_jobs": the host pipeline's update in flight,
                 "topk_ratio", "overlap_step", "world_size", "rank": what it must match}}

A parameter whose state lives on the host saves {"kind": "host", "host": the HostPipeline's state
of it, "device": its DeviceColumns'}; a vector updated on the device saves {"kind": "vector",
**its DeviceVector's}. Every part writes and reads its own piece; loading checks every piece
before any part changes. torch's state-dict hooks (Optimizer.register_state_dict_pre_hook and
the three others) run around saving and loading as they do for any torch optimizer.

Versions. A change to what any part saves bumps FORMAT_VERSION and adds a step to `_MIGRATIONS`
that turns a state of the version before into the new one, so every older state still loads; a
state newer than this code is refused, naming both versions. Version 1 is the format before
versions were written down (no "format_version" key).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

from zenflow.config.settings import AdamWHyperparameters
from zenflow.saved_state import check_like


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


FORMAT_VERSION = 2


def _from_v1(saved: dict) -> dict:
    return saved   # version 2 only started writing the version down


# version v -> the step that turns a "zenflow" section of version v into version v + 1
_MIGRATIONS: dict[int, Callable[[dict], dict]] = {1: _from_v1}


@dataclass
class StateParts:
    """The parts of an optimizer that hold state, as the optimizer hands them to this module."""
    owner: str                 # the optimizer's class name, for errors and the saved "optimizer"
    param_groups: list[dict]
    counters: StepCounters
    host_params: list          # zenflow.optim.params.HostParam
    vector_params: list        # zenflow.optim.params.VectorParam
    pipeline: Any              # zenflow.host.pipeline.HostPipeline
    selector: Any              # zenflow.optim.selector.ColumnSelector
    window: Any                # zenflow.optim.windows.WindowRule
    outside_writes: Any        # zenflow.optim.params.OutsideWrites
    topk_ratio: float
    overlap_step: bool
    world_size: int
    rank: int


def _numbers(parts: StateParts) -> dict:
    """Each parameter's number, as torch.optim numbers them in a state dict."""
    return {p: i for i, p in enumerate(p for g in parts.param_groups for p in g["params"])}


def compose(parts: StateParts) -> dict:
    """The state of the optimizer from its parts (the host pipeline drains first)."""
    number = _numbers(parts)
    host = parts.pipeline.state_dict()
    state = {}
    for m in parts.host_params:
        state[number[m.param]] = {"kind": "host", "host": host["params"][m.host_index],
                                  "device": m.selected.state_dict()}
    for v in parts.vector_params:
        state[number[v.param]] = {"kind": "vector", **v.state.state_dict()}
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [number[p] for p in g["params"]]} for g in parts.param_groups]
    return {"state": state, "param_groups": groups, "zenflow": {
        "format_version": FORMAT_VERSION, "optimizer": parts.owner, **parts.counters.state_dict(),
        "selection": parts.selector.state_dict(), "window": parts.window.state_dict(),
        "in_flight": host["in_flight"], "in_flight_jobs": host["in_flight_jobs"],
        "topk_ratio": parts.topk_ratio, "overlap_step": parts.overlap_step,
        "world_size": parts.world_size, "rank": parts.rank}}


def _current(saved: dict) -> dict:
    """The "zenflow" section `saved` in this version's format, migrated step by step."""
    version = saved.get("format_version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"'format_version' must be a positive integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise ValueError(f"the state has format version {version}, newer than this zenflow reads "
                         f"(1 to {FORMAT_VERSION}); load it with the zenflow that saved it, or a "
                         "newer one")
    while version < FORMAT_VERSION:
        saved = _MIGRATIONS[version](dict(saved))
        version += 1
    return {**saved, "format_version": FORMAT_VERSION}


def check(parts: StateParts, state_dict: dict) -> dict:
    """Raise ValueError, naming the optimizer, unless `state_dict` fits; changes nothing. Returns
    the state dict with its "zenflow" section in this version's format."""
    try:
        return _check(parts, state_dict)
    except ValueError as exc:
        raise ValueError(f"{parts.owner}: load_state_dict: {exc}") from None
    except (KeyError, TypeError, IndexError, AttributeError) as exc:
        # A shape no check above foresaw: still a refusal before anything changed.
        raise ValueError(f"{parts.owner}: load_state_dict: the state is malformed "
                         f"({type(exc).__name__}: {exc})") from None


def _check(parts: StateParts, state_dict: dict) -> dict:
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("zenflow"), dict):
        raise ValueError("got a state dict without the 'zenflow' section; it was not saved by "
                         "ZenFlowAdamW or OffloadAdamW")
    saved = _current(state_dict["zenflow"])
    state_dict = {**state_dict, "zenflow": saved}
    if saved.get("optimizer", parts.owner) != parts.owner:
        raise ValueError(f"the state was saved by {saved['optimizer']}, not {parts.owner}")
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise ValueError("'param_groups' must be a list of dicts, each with a 'params' list")
    sizes = [len(g["params"]) for g in groups]
    if sizes != [len(g["params"]) for g in parts.param_groups]:
        raise ValueError(f"saved param groups have sizes {sizes}, this optimizer's have "
                         f"{[len(g['params']) for g in parts.param_groups]}")
    for i, (group, saved_group) in enumerate(zip(parts.param_groups, groups)):
        _check_hyperparameters(parts.owner, i, {**group, **saved_group})
    if not isinstance(state_dict.get("state"), dict):
        raise ValueError("'state' must be a dict of per-parameter states")
    check_like({k: saved.get(k) for k in parts.counters.state_dict()},
               parts.counters.state_dict(), "counters")
    check_like(saved.get("selection"), parts.selector.state_dict(), "selection")
    # A window's length is None until its first window ends (a state saved before then).
    check_like(saved.get("window"), parts.window.state_dict(), "window",
               nullable=frozenset({"last_interval"}))
    world_size, rank = saved.get("world_size", 1), saved.get("rank", 0)
    if world_size != parts.world_size:
        raise ValueError(f"the state was saved by rank {rank} of {world_size}, but this run has "
                         f"{parts.world_size} rank(s); each rank holds only its share of "
                         "the host state, so resume on the same number of ranks")
    if rank != parts.rank:
        raise ValueError(f"this is rank {parts.rank} but the state belongs to rank {rank}")
    if saved["topk_ratio"] != parts.topk_ratio:
        raise ValueError(f"saved topk_ratio {saved['topk_ratio']} differs from this optimizer's "
                         f"{parts.topk_ratio}")
    number, states = _numbers(parts), state_dict["state"]
    for m in parts.host_params:
        piece = _saved_piece(states.get(number[m.param]), "host", m.param)
        what = f"the selected columns of the parameter of shape {tuple(m.param.shape)}"
        m.selected.check_state_dict(piece.get("device"), what)
        if saved["selection"]["has_chosen"]:
            m.selected.check_columns(piece["device"], m.num_columns, what)
    for v in parts.vector_params:
        v.state.check_state_dict(_saved_piece(states.get(number[v.param]), "vector", v.param),
                                 f"the parameter of shape {tuple(v.param.shape)}")
    parts.pipeline.check_state_dict(
        {"params": [states[number[m.param]]["host"] for m in parts.host_params],
         "in_flight": saved.get("in_flight"), "in_flight_jobs": saved.get("in_flight_jobs")},
        window_steps=saved["window_steps"])
    return state_dict


def _check_hyperparameters(owner: str, index: int, group: dict) -> None:
    """The AdamW numbers a param group would hold after the load pass the settings' rules."""
    try:
        AdamWHyperparameters.from_arguments(
            owner, **{k: group.get(k) for k in AdamWHyperparameters.model_fields})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"param_groups[{index}]: {str(exc).removeprefix(owner + ': ')}") from None


def _saved_piece(saved, kind: str, param) -> dict:
    if not isinstance(saved, dict) or saved.get("kind") != kind:
        raise ValueError(f"no {kind} state saved for the parameter of shape {tuple(param.shape)}")
    return saved


def _load(parts: StateParts, state_dict: dict) -> None:
    state_dict = check(parts, state_dict)
    number, states, saved = _numbers(parts), state_dict["state"], state_dict["zenflow"]
    parts.pipeline.load_state_dict({"params": [states[number[m.param]]["host"]
                                               for m in parts.host_params],
                                    "in_flight": saved["in_flight"],
                                    "in_flight_jobs": saved.get("in_flight_jobs")})
    for m in parts.host_params:
        m.selected.load_state_dict(states[number[m.param]]["device"])
    for v in parts.vector_params:
        v.state.load_state_dict(states[number[v.param]])
    for group, saved_group in zip(parts.param_groups, state_dict["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    parts.counters.load_state_dict(saved)
    parts.selector.load_state_dict(saved["selection"])
    parts.window.load_state_dict(saved["window"])
    # The weights as they are now (usually just loaded from the same checkpoint) belong with
    # this state; only later outside writes are adopted.
    parts.outside_writes.forget()


def save(opt, parts: StateParts) -> dict:
    """opt.state_dict(): compose() with torch's state_dict pre-hooks before and post-hooks after
    (a post-hook may return a new dict), as torch.optim.Optimizer.state_dict runs them; weights
    written outside the optimizer are adopted first, so the state saved goes with them."""
    for pre_hook in opt._optimizer_state_dict_pre_hooks.values():
        pre_hook(opt)
    parts.outside_writes.adopt()
    parts.outside_writes.adopt_data_writes()
    state_dict = compose(parts)
    for post_hook in opt._optimizer_state_dict_post_hooks.values():
        result = post_hook(opt, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def load(opt, parts: StateParts, state_dict: dict) -> None:
    """opt.load_state_dict(): restore what save() returned, checked first, so that a failed
    load leaves the optimizer as it was; torch's load_state_dict pre-hooks run before (each may
    return a new dict) and post-hooks after, as torch.optim.Optimizer.load_state_dict runs them."""
    if isinstance(state_dict, dict):
        state_dict = state_dict.copy()   # shallow, as torch does
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(opt, state_dict)
        if result is not None:
            state_dict = result
    _load(parts, state_dict)
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)
