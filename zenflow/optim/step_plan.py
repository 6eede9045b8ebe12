"""A step's gradients, read once, and the per-matrix work they imply, worked out once.

Steps inside a window do the same per-matrix work as long as the same parameters have gradients:
the same matrices are staged for the host, the same selected columns stepped on the device, the
same ColumnBlocks gathered. A `StepPlan` holds those lists, and C-level pickers
(`operator.itemgetter`) that take each list's gradients out of the step's. `GradientReader` reads
a step's gradients in a few C-level passes over the parameters (what torch.optim's own step does
per parameter), checks them as `params.present_gradients` does, and keeps a plan per set of
parameters with gradients. Python bytecode per matrix then runs once per plan (a selection, a
parameter without a gradient), not every step: at an MoE's 5,000 experts, a microsecond per
matrix is 5 ms a step.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import chain, compress, repeat

import torch

from zenflow.distributed import is_sharded, local
from zenflow.optim.device_adam import MatrixSteps, picker
from zenflow.optim.params import HostParam, VectorParam, present_gradients
from zenflow.optim.step_scale import NormRun, alike_runs

_params_of = operator.itemgetter("params")
_grad = operator.attrgetter("grad")
_requires_grad = operator.attrgetter("requires_grad")
_dtype = operator.attrgetter("dtype")
_is_sparse = operator.attrgetter("is_sparse")
_device = operator.attrgetter("device")
_is_contiguous = torch.Tensor.is_contiguous

_NONE_TYPE = type(None)
_PLANS = 4   # plans kept (a few sets recur: all parameters, all but an unused one)


@dataclass
class StepPlan:
    """What a step does per matrix, for one set of parameters with gradients."""
    chosen: bool                 # planned with the columns chosen
    pick_present: Callable[[Sequence], Sequence]   # the gradients there are (trainable order)
    host_present: list[int]      # host indices with a gradient, ascending
    vector_present: list[int]    # positions among the vector parameters with one
    staged: list[int]            # of host_present, those whose columns the host updates
    pick_staged: Callable[[Sequence], Sequence]    # (by host index)
    stepped: list[HostParam]     # of host_present, those with selected columns to step
    pick_stepped: Callable[[Sequence], Sequence]   # (by host index: gradients, weights)
    matrix_steps: MatrixSteps | None   # of `stepped`
    norm_runs: list[NormRun]     # how the CPU takes the present gradients' norms
    importance: ImportanceSplit | None   # of the present matrices (None: there are none)

    @classmethod
    def build(cls, host_params: list[HostParam], vector_params: list[VectorParam],
              trainable: list[HostParam | VectorParam], missing: tuple[int, ...] | None,
              chosen: bool) -> StepPlan:
        """`trainable`: the parameters in the order the step reads their gradients, `missing`
        the positions there without one (None: all have one)."""
        gone = set(missing or ())
        present_at = [t for t in range(len(trainable)) if t not in gone]
        rank = {id(trainable[t]): r for r, t in enumerate(present_at)}   # position in the norms
        present = [m for m in host_params if id(m) in rank]
        staged = [m.host_index for m in present if m.host_owns_columns(chosen)]
        stepped = [m for m in present if chosen and m.k > 0]
        shapes = [(tuple(trainable[t].local.shape), trainable[t].param.dtype) for t in present_at]
        return cls(
            chosen, _pick_all_or(present_at, len(trainable)),
            [m.host_index for m in present],
            [j for j, v in enumerate(vector_params) if id(v) in rank],
            staged, picker(staged), stepped, picker([m.host_index for m in stepped]),
            MatrixSteps([m.selected for m in stepped], [m.group for m in stepped])
            if stepped else None,
            alike_runs(shapes), ImportanceSplit.of(present, [rank[id(m)] for m in present]))


@dataclass
class ImportanceSplit:
    """What importance_split() reads of the present matrices (ndim >= 2), worked out once."""
    norms: torch.Tensor          # their positions in the norms (StepGradients.present's order)
    count: int
    selected_grads: list[torch.Tensor]   # the gathered gradient columns of those with k > 0
    pick_selected: Callable[[Sequence], Sequence]   # each one's selected square, else 0.0
    deferred_columns: int
    selected_columns: int

    @classmethod
    def of(cls, present: list[HostParam], norm_at: list[int]) -> ImportanceSplit | None:
        """`norm_at`: each present matrix's position in the norms."""
        at = [n for m, n in zip(present, norm_at) if m.param.ndim >= 2]
        matrices = [m for m in present if m.param.ndim >= 2]
        if not matrices:
            return None
        selected = [m for m in matrices if m.k > 0]
        rank = {id(m): r for r, m in enumerate(selected)}
        return cls(torch.tensor(at, device=matrices[0].local.device), len(at),
                   [m.selected.grad for m in selected],
                   picker([rank.get(id(m), len(selected)) for m in matrices]),
                   sum(m.num_columns - m.k for m in matrices), sum(m.k for m in matrices))


def _pick_all_or(positions: list[int], size: int) -> Callable[[Sequence], Sequence]:
    """picker(positions), or the sequence itself where `positions` is all of it."""
    return (lambda items: items) if len(positions) == size else picker(positions)


@dataclass
class StepGradients:
    """A step's gradients, in the order of the trainable parameters (None: none this step), by
    host index and by vector position, and the plan for them."""
    all: Sequence[torch.Tensor | None]
    host: Sequence[torch.Tensor | None]
    vectors: Sequence[torch.Tensor | None]
    plan: StepPlan
    host_params: list[HostParam]
    vector_params: list[VectorParam]

    def present(self) -> Sequence[torch.Tensor]:
        """The gradients there are, in the trainable parameters' order (the norms')."""
        return self.plan.pick_present(self.all)

    def staged(self) -> dict[int, torch.Tensor]:
        """{host index: gradient} of the matrices whose host-owned columns take it."""
        return dict(zip(self.plan.staged, self.plan.pick_staged(self.host)))

    @cached_property
    def by_param(self) -> dict:
        """{parameter: gradient}, as present_gradients gives it (a selection reads it: once a
        window)."""
        plan = self.plan
        pairs = [(self.host_params[i].param, self.host[i]) for i in plan.host_present]
        pairs += [(self.vector_params[j].param, self.vectors[j]) for j in plan.vector_present]
        return dict(pairs)


class GradientReader:
    """Reads each step's gradients (`read`), keeping a StepPlan per set of parameters with one;
    built for the parameters of `param_groups` as the optimizer was built on them."""

    def __init__(self, param_groups: list[dict], host_params: list[HostParam],
                 vector_params: list[VectorParam], device: torch.device, owner: str,
                 built: dict):
        self._device, self._owner, self._built = device, owner, built
        self.host_params, self.vector_params = host_params, vector_params
        self._params = [p for group in param_groups for p in group["params"]]
        self._frozen = [p for p in self._params if built[p] is None]
        held = {id(x.param): x for x in (*host_params, *vector_params)}
        self._held = [held[id(p)] for p in self._params if built[p] is not None]
        self._trainable = [x.param for x in self._held]
        at = {id(x): t for t, x in enumerate(self._held)}
        self._pick_host = _pick_all_or([at[id(m)] for m in host_params], len(self._held))
        self._pick_vectors = picker([at[id(v)] for v in vector_params])
        self._dtypes = [p.dtype for p in self._trainable]
        self._sharded = any(map(is_sharded, self._params))
        self._plans: dict[tuple, StepPlan] = {}

    def read(self, param_groups: list[dict], chosen: bool) -> StepGradients | None:
        """This step's gradients (present_gradients' checks of `param_groups`, the optimizer's
        as they are now), or None when there are none; `chosen`: the columns are chosen (the
        plan's device steps need them)."""
        grads = self._fast(param_groups)
        if grads is None:
            found = present_gradients(param_groups, self._device, self._owner, self._built)
            grads = [found.get(p) for p in self._trainable]
        missing = _missing(grads)
        if missing is not None and len(missing) == len(grads):
            return None
        return StepGradients(grads, self._pick_host(grads), self._pick_vectors(grads),
                             self._plan(missing, chosen), self.host_params, self.vector_params)

    def replan(self, grads: StepGradients, chosen: bool) -> StepGradients:
        """`grads` with the plan for `chosen` (the columns were chosen since it was read)."""
        if grads.plan.chosen == chosen:
            return grads
        return StepGradients(grads.all, grads.host, grads.vectors,
                             self._plan(_missing(grads.all), chosen),
                             self.host_params, self.vector_params)

    def _plan(self, missing: tuple[int, ...] | None, chosen: bool) -> StepPlan:
        key = (missing, chosen)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= _PLANS:
                del self._plans[next(iter(self._plans))]
            plan = self._plans[key] = StepPlan.build(self.host_params, self.vector_params,
                                                     self._held, missing, chosen)
        return plan

    def _fast(self, param_groups: list[dict]) -> list | None:
        """The gradients in the trainable parameters' order, or None when any check (or a
        parameter replaced in param_groups) needs present_gradients' look, one by one."""
        params = list(chain.from_iterable(map(_params_of, param_groups)))
        if len(params) != len(self._params) or not all(map(operator.is_, params, self._params)):
            return None
        if self._frozen and _some(map(_grad, self._frozen)):
            return None
        trainable = self._trainable
        if (not all(map(_requires_grad, trainable)) or list(map(_dtype, trainable)) != self._dtypes
                or not all(map(_is_contiguous, trainable))):
            return None
        grads = list(map(_grad, trainable))
        given = list(compress(grads, map(operator.is_not, grads, repeat(None)))) \
            if _any_none(grads) else grads
        if any(map(_is_sparse, given)) or set(map(_device, given)) - {self._device}:
            return None
        if self._sharded:
            grads = [None if g is None else local(g) for g in grads]
        return grads


# (`None in tensors` compares each tensor with None through Tensor.__eq__, Python code: their
# types compare in C)
def _any_none(items) -> bool:
    return _NONE_TYPE in list(map(type, items))


def _some(items) -> bool:
    return bool(set(map(type, items)) - {_NONE_TYPE})


def _missing(grads: Sequence) -> tuple[int, ...] | None:
    """The positions of `grads` without one, or None when none is missing (one C-level scan)."""
    if not _any_none(grads):
        return None
    return tuple(compress(range(len(grads)), map(operator.is_, grads, repeat(None))))


def importance_split(grads, norms: torch.Tensor, scale, partition=None
                     ) -> tuple[float, int, float, int] | None:
    """(squared norm, columns) of the deferred and of the selected columns of the matrices with
    a gradient this step (`grads`, a zenflow.optim.step_plan.StepGradients), for the auto window;
    None when none has or the step was skipped (`scale`, a zenflow.optim.step_scale.StepScale,
    says so in the same read). The device update has just gathered and clipped the selected
    columns, so their norms take no extra pass over the gradients; `norms` (fp32, one per
    gradient of grads.present(), in its order) holds each whole gradient's norm before
    clipping. Where each rank holds some rows of every gradient (FSDP2,
    `partition.shards_gradients`), the squares are summed across ranks (one all-reduce), so
    every rank sees the whole matrices' split."""
    split = grads.plan.importance
    if split is None:
        return None
    selected = split.selected_grads
    squares = torch.cat([(norms[split.norms].double() * scale.coef).square(),
                         torch.stack(torch._foreach_norm(selected)).double().square()
                         if selected else torch.zeros(0, dtype=torch.float64,
                                                      device=norms.device)])
    if partition is not None and partition.shards_gradients:
        squares = partition.sum_(squares, "summing the deferred and selected gradient norms")
    # One stacked transfer instead of one device sync per matrix (the auto window's importance
    # criterion reads every step: an auto_ratio window's end depends on it).
    kept, *squares = torch.cat([scale.kept.double().reshape(1), squares]).tolist()
    if not kept:
        return None
    total_sq = squares[:split.count]
    sel_sq = squares[split.count:]
    deferred_sq = sum(map(max, [0.0] * len(total_sq),
                          map(operator.sub, total_sq, split.pick_selected(sel_sq + [0.0]))))
    return deferred_sq, split.deferred_columns, sum(sel_sq), split.selected_columns
