"""The one state format of ZenFlowAdamW and OffloadAdamW, composed from its parts' own state.

    {"state": {param number: per-parameter state},     # numbered as torch.optim numbers them
     "param_groups": [... as torch.optim, "params" as numbers ...],   # [0]: "zenflow" as JSON
     "zenflow": {"format_version": FORMAT_VERSION,
                 "optimizer": its class name, the StepCounters' fields,
                 "selection": the ColumnSelector's, "window": the window's,
                 "in_flight", "in_flight_jobs": the host pipeline's update in flight,
                 "topk_ratio", "overlap_step", "world_size", "rank": what it must match,
                 "reshardable": whether the tensors say where they belong (below)}}

A parameter whose state lives on the host saves {"kind": "host", "host": the HostPipeline's state
of it, "device": its DeviceColumns'}; a vector updated on the device saves {"kind": "vector",
**its DeviceVector's}; both also save "weight_bits", a fingerprint of the weights the state goes
with (`OutsideWrites.weight_bits`). Every part writes and reads its own piece; loading checks
every piece before any part changes. torch's state-dict hooks (Optimizer.register_state_dict_pre_hook and
the three others) run around saving and loading as they do for any torch optimizer.

torch.distributed.checkpoint (DCP). `get_optimizer_state_dict` keeps only "state" and
"param_groups" (and names parameters by their module path instead of numbers), so
`param_groups[0]["zenflow"]` holds the "zenflow" section too, as a JSON string: a state without
the top-level section is read from there. A string, because DCP's full-state-dict load matches
the saved state's nested keys against a fresh optimizer's, and the section's lists (the update
in flight) have no fixed length. Under FSDP2 each rank's rows of every state tensor are saved as a DTensor
sharded like the parameter (`zenflow.distributed.sharded_like`), so DCP writes each block where
it belongs in the whole tensor and reads back whatever blocks the loading ranks hold: such a
state is "reshardable" (so is a single process's, whose tensors are whole), and loads on any
number of ranks through DCP. A DDP rank's state holds its share of the rows as plain tensors,
which DCP would take for replicas and keep one of: it loads only as each rank saved it.

Versions: zenflow/optim/state_versions.py (FORMAT_VERSION, and the step from each version to the
next).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from zenflow.adamw import FP32_STATE
from zenflow.config.settings import AdamWHyperparameters
from zenflow.distributed import Partition, is_sharded, local, sharded_like
from zenflow.optim.state_versions import FORMAT_VERSION, migrated, with_squares
from zenflow.saved_state import check_like, check_saved_tensors


@dataclass
class StepCounters:
    """What the optimizer counts, saved with its state."""
    step: int = 0            # steps taken (a skip inside a window counts: docs/semantics.md)
    window_steps: int = 0    # steps accumulated in the current window
    skipped_steps: int = 0
    num_windows: int = 0
    window_spoiled: bool = False   # a skipped step inside the current window: it is dropped

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):
            setattr(self, f.name, state[f.name])


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
    outside_writes: Any        # zenflow.optim.outside_writes.OutsideWrites
    topk_ratio: float
    overlap_step: bool
    world_size: int
    rank: int
    # the parameters are FSDP2 row shards (DTensors): the state is saved as DTensors too
    sharded: bool = False
    # DDP: each rank holds its share of every matrix's rows, as plain tensors
    replica_rows: bool = False


def _numbers(parts: StateParts) -> dict:
    """Each parameter's number, as torch.optim numbers them in a state dict."""
    return {p: i for i, p in enumerate(p for g in parts.param_groups for p in g["params"])}


def _saved_keys(parts: StateParts, state_dict: dict) -> dict:
    """Each parameter's key in the saved "state": the saved param groups' entries in order, as
    torch.optim.Optimizer.load_state_dict pairs them (numbers from state_dict(), module paths
    from torch.distributed.checkpoint.state_dict.get_optimizer_state_dict)."""
    saved = [k for g in state_dict["param_groups"] for k in g["params"]]
    return dict(zip((p for g in parts.param_groups for p in g["params"]), saved))


# The dimension along which each saved tensor is split as the parameter's rows are: host state
# is a [rows, columns] view (a vector's is one row of all its elements), the selected columns'
# state is [rows, k] and a vector's device state has the parameter's own shape.
_HOST_TENSORS = (*FP32_STATE, "grad_sum", "grad_sq_sum", "rate")
_COLUMN_TENSORS = FP32_STATE


def _sharded(piece: dict, names, param, dim: int) -> dict:
    return {k: sharded_like(v, param, dim) if k in names else v for k, v in piece.items()}


def _sharded_factors(piece: dict, param) -> dict:
    """A "factored" matrix's factors under FSDP2, where each rank fits its own row shard
    (docs/semantics.md): "row_factors" [3, rows] split as the rows are; "col_factors" [3, cols],
    of this rank's rows alone, one block per rank (whole: [3 * ranks, cols]). As DTensors, so
    that DCP keeps every rank's: a plain tensor it takes for a replica and keeps one copy of."""
    if "col_factors" not in piece:
        return piece
    cols = piece["col_factors"]
    return {**piece, "row_factors": sharded_like(piece["row_factors"], param, 1),
            "col_factors": sharded_like(cols, param, 0, cols.shape[0] * param.device_mesh.size())}


def _own_factors(host, x, parts: StateParts):
    """A saved host piece with the "factored" factors this rank's rows use. A rank's own state
    (FSDP2's, or a DDP rank's, whose rows are its share of the replica's) holds them as they
    are; a full state dict (StateDictOptions(full_state_dict=True)) brings
    FSDP2's back whole ([3, all rows], [3 * ranks, cols]), and this rank takes its rows and its
    block. Column factors fitted to another split of the rows (another number of ranks) fit no
    shard here: the matrix starts as a state saved under another rule does (no factors until
    its next install). Malformed factors are left for check() to refuse."""
    rows, cols = (host.get(k) if isinstance(host, dict) else None
                  for k in ("row_factors", "col_factors"))
    if not (torch.is_tensor(rows) and torch.is_tensor(cols) and rows.ndim == cols.ndim == 2
            and len(rows) == 3 and len(cols) % 3 == 0 and len(cols)):
        return host
    own_rows = x.local.shape[0]
    if parts.replica_rows:   # DDP: this rank's host holds its share of the replica's rows
        own_rows = len(range(own_rows)[Partition(rank=parts.rank,
                                                 world_size=parts.world_size).rows(own_rows)])
    if rows.shape[1] == own_rows and len(cols) == 3:
        return host
    if parts.sharded and rows.shape[1] == x.param.shape[0] and len(cols) == 3 * parts.world_size:
        mine = Partition(rank=parts.rank, world_size=parts.world_size).rows(x.param.shape[0])
        block = slice(3 * parts.rank, 3 * parts.rank + 3)
        return {**host, "row_factors": rows[:, mine], "col_factors": cols[block]}
    return {k: v for k, v in host.items() if k not in ("row_factors", "col_factors")}


def _weight_bits(parts: StateParts, x):
    """The fingerprint of the weights this state goes with (OutsideWrites.weight_bits): one
    value per row, split across FSDP2 ranks as the rows are."""
    bits = parts.outside_writes.weight_bits(x)
    return sharded_like(bits, x.param, 0) if parts.sharded else bits


def _checked_bits(piece: dict, x, what: str):
    """The saved weight_bits of a parameter (None in a state of version 2, which had none)."""
    if "weight_bits" not in piece:
        return None
    expected = x.local.shape[0] if x.local.ndim >= 2 else x.local.numel()
    check_saved_tensors(piece, {"weight_bits": torch.zeros(expected, dtype=torch.int64)}, what)
    return piece["weight_bits"]


def _local(piece):
    """A saved piece with every DTensor replaced by this rank's block of it (DCP has placed the
    blocks of a reshardable state; a rank's own state_dict() holds its own)."""
    if isinstance(piece, dict):
        return {k: _local(v) for k, v in piece.items()}
    return local(piece) if is_sharded(piece) else piece


def compose(parts: StateParts) -> dict:
    """The state of the optimizer from its parts (the host pipeline drains first)."""
    number = _numbers(parts)
    host = parts.pipeline.state_dict()
    state = {}
    for m in parts.host_params:
        host_piece, device_piece = host["params"][m.host_index], m.selected.state_dict()
        if parts.sharded:
            host_piece = _sharded(host_piece, _HOST_TENSORS, m.param, 0 if m.param.ndim >= 2 else 1)
            host_piece = _sharded_factors(host_piece, m.param)
            if m.param.ndim >= 2:   # a vector on the host (OffloadAdamW) selects no columns
                device_piece = _sharded(device_piece, _COLUMN_TENSORS, m.param, 0)
        state[number[m.param]] = {"kind": "host", "host": host_piece, "device": device_piece,
                                  "weight_bits": _weight_bits(parts, m)}
    for v in parts.vector_params:
        piece = v.state.state_dict()
        if parts.sharded:
            piece = _sharded(piece, _COLUMN_TENSORS, v.param, 0)
        state[number[v.param]] = {"kind": "vector", **piece, "weight_bits": _weight_bits(parts, v)}
    section = {
        "format_version": FORMAT_VERSION, "optimizer": parts.owner, **parts.counters.state_dict(),
        "selection": parts.selector.state_dict(), "window": parts.window.state_dict(),
        "in_flight": host["in_flight"], "in_flight_jobs": host["in_flight_jobs"],
        "topk_ratio": parts.topk_ratio, "overlap_step": parts.overlap_step,
        "world_size": parts.world_size, "rank": parts.rank,
        "reshardable": not parts.replica_rows}
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [number[p] for p in g["params"]]} for g in parts.param_groups]
    # Where torch.distributed.checkpoint keeps it (the module docstring).
    groups[0]["zenflow"] = json.dumps(section)
    return {"state": state, "param_groups": groups, "zenflow": section}


def check(parts: StateParts, state_dict: dict) -> dict:
    """Raise ValueError, naming the optimizer, unless `state_dict` fits; changes nothing. Returns
    what loading reads: the saved "param_groups", the "zenflow" section in this version's format
    and "pieces", each parameter's saved state with this rank's blocks of it."""
    try:
        return _check(parts, state_dict)
    except ValueError as exc:
        raise ValueError(f"{parts.owner}: load_state_dict: {exc}") from None
    except (KeyError, TypeError, IndexError, AttributeError) as exc:
        # A shape no check above foresaw: still a refusal before anything changed.
        raise ValueError(f"{parts.owner}: load_state_dict: the state is malformed "
                         f"({type(exc).__name__}: {exc})") from None


def _section(state_dict) -> tuple[dict, bool]:
    """(the "zenflow" section, whether it came through torch.distributed.checkpoint: only in
    param_groups[0], where get_optimizer_state_dict keeps it)."""
    if not isinstance(state_dict, dict):
        raise ValueError(f"the state dict is a {type(state_dict).__name__}, not a dict")
    if isinstance(state_dict.get("zenflow"), dict):
        return state_dict["zenflow"], False
    groups = state_dict.get("param_groups")
    if isinstance(groups, list) and groups and isinstance(groups[0], dict) \
            and isinstance(groups[0].get("zenflow"), str):
        try:
            section = json.loads(groups[0]["zenflow"])
        except ValueError as exc:
            raise ValueError(f"param_groups[0]['zenflow'] is not valid JSON ({exc})") from None
        if isinstance(section, dict):
            return section, True
    raise ValueError("got a state dict without the 'zenflow' section; it was not saved by "
                     "ZenFlowAdamW or OffloadAdamW")


def _check_ranks(parts: StateParts, saved: dict, through_dcp: bool) -> None:
    """A rank's own state loads on the same rank of as many ranks; a reshardable state that came
    through torch.distributed.checkpoint (whose "rank" is whichever rank DCP kept the section
    of) loads on any number of FSDP2 ranks or one process."""
    world_size, rank = saved.get("world_size", 1), saved.get("rank", 0)
    if through_dcp:
        if not saved.get("reshardable", world_size == 1):
            raise ValueError(
                f"the state was saved by {world_size} data-parallel (DDP) ranks, each holding "
                "its share of the rows as plain tensors, and came through "
                "torch.distributed.checkpoint, which keeps one rank's copy of a plain tensor; "
                "save and load each rank's opt.state_dict() instead (zenflow.initialize's "
                "save_checkpoint does), or shard the model with FSDP2")
        if parts.replica_rows:
            raise ValueError(
                f"this optimizer runs on {parts.world_size} data-parallel (DDP) ranks, each "
                "holding its share of the rows, and cannot take its state from "
                "torch.distributed.checkpoint; load each rank's opt.state_dict() instead, or "
                "shard the model with FSDP2")
        return
    if world_size != parts.world_size:
        raise ValueError(f"the state was saved by rank {rank} of {world_size}, but this run has "
                         f"{parts.world_size} rank(s); each rank holds only its share of "
                         "the host state, so resume on the same number of ranks (an FSDP2 "
                         "state saved through torch.distributed.checkpoint reshards)")
    if rank != parts.rank:
        raise ValueError(f"this is rank {parts.rank} but the state belongs to rank {rank}")


def _check(parts: StateParts, state_dict: dict) -> dict:
    section, through_dcp = _section(state_dict)
    saved = migrated(section)
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise ValueError("'param_groups' must be a list of dicts, each with a 'params' list")
    if saved.get("optimizer", parts.owner) != parts.owner:
        raise ValueError(f"the state was saved by {saved['optimizer']}, not {parts.owner}")
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
    _check_ranks(parts, saved, through_dcp)
    if saved["topk_ratio"] != parts.topk_ratio:
        raise ValueError(f"saved topk_ratio {saved['topk_ratio']} differs from this optimizer's "
                         f"{parts.topk_ratio}")
    key, states = _saved_keys(parts, state_dict), state_dict["state"]
    pieces, bits = {}, {}
    for m in parts.host_params:
        piece = pieces[m.param] = _local(_saved_piece(states.get(key[m.param]), "host", m.param))
        piece["host"] = _own_factors(piece.get("host"), m, parts)
        if not saved.get("squares_saved", True) and isinstance(piece.get("host"), dict):
            piece = pieces[m.param] = {**piece, "host": with_squares(piece["host"])}
        what = f"the selected columns of the parameter of shape {tuple(m.param.shape)}"
        m.selected.check_state_dict(piece.get("device"), what)
        if saved["selection"]["has_chosen"]:
            m.selected.check_columns(piece["device"], m.num_columns, what)
        bits[m.param] = _checked_bits(piece, m, f"the parameter of shape {tuple(m.param.shape)}")
    for v in parts.vector_params:
        piece = pieces[v.param] = _local(_saved_piece(states.get(key[v.param]), "vector", v.param))
        what = f"the parameter of shape {tuple(v.param.shape)}"
        v.state.check_state_dict(piece, what)
        bits[v.param] = _checked_bits(piece, v, what)
    parts.pipeline.check_state_dict(
        {"params": [pieces[m.param]["host"] for m in parts.host_params],
         "in_flight": saved.get("in_flight"), "in_flight_jobs": saved.get("in_flight_jobs")},
        window_steps=saved["window_steps"])
    # What _load() reads: the section in this version's format and each parameter's piece with
    # this rank's blocks, by parameter.
    return {"param_groups": groups, "zenflow": saved, "pieces": pieces,
            "weight_bits": {p: b for p, b in bits.items() if b is not None}}


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
    checked = check(parts, state_dict)
    pieces, saved = checked["pieces"], checked["zenflow"]
    parts.pipeline.load_state_dict({"params": [pieces[m.param]["host"]
                                               for m in parts.host_params],
                                    "in_flight": saved["in_flight"],
                                    "in_flight_jobs": saved.get("in_flight_jobs")})
    for m in parts.host_params:
        m.selected.load_state_dict(pieces[m.param]["device"])
    for v in parts.vector_params:
        v.state.load_state_dict(pieces[v.param])
    for group, saved_group in zip(parts.param_groups, checked["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k not in ("params", "zenflow")})
    parts.counters.load_state_dict(saved)
    parts.selector.load_state_dict(saved["selection"])
    parts.window.load_state_dict(saved["window"])
    # The weights as they are now (usually just loaded from the same checkpoint) belong with
    # this state, and so do the state's own weights loaded before the next step (DCP's
    # set_state_dict loads the optimizer first); other writes are adopted.
    parts.outside_writes.forget(saved_bits=checked["weight_bits"])


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
