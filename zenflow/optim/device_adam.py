"""Device side of ZenFlow: AdamW on the selected columns of every matrix and on every vector.

All device state is fp32 (master values and both moments), whatever the parameter's dtype. Each
step count is a 0-dim fp32 tensor on the device (`count`; exact up to 2**24 updates): the fused
kernel reads it there, and a step inside a window advances it by the step's kept flag, so a step
skipped on the device counts nothing without the Python thread reading the flag. `step` reads it
as an int (saving, moving columns: places that read the device anyway). A vector parameter that is
already fp32 is its own master; every other master first takes what was written into the
parameter since the last step (adopt_written), as torch's AdamW, whose state is the parameter,
keeps a write through `.data`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from zenflow.adamw import FP32_STATE, adamw_
from zenflow.host.device_sums import picker
from zenflow.host.transfers import STACK_ELEMENTS, STACK_RUN_ELEMENTS
from zenflow.optim import columns
from zenflow.saved_state import check_count, check_saved_tensors


class _SavedAdamState:
    """state_dict() and load_state_dict() of fp32 AdamW state: the tensors named in `SAVED`
    and the integer step count."""
    SAVED: tuple[str, ...] = ()
    count: torch.Tensor   # AdamW updates so far: 0-dim fp32 on the device

    @property
    def step(self) -> int:
        """The step count as an int (one read of the device)."""
        return int(self.count.item())

    @step.setter
    def step(self, value: int) -> None:
        self.count.fill_(float(value))

    def state_dict(self) -> dict:
        return {"step": self.step, **{name: getattr(self, name).clone() for name in self.SAVED}}

    def check_state_dict(self, state: dict, what: str = "") -> None:
        """Raise ValueError, saying `what` failed, unless load_state_dict(state) would fit."""
        check_saved_tensors(state, {name: getattr(self, name) for name in self.SAVED}, what)
        check_count(state.get("step"), "step", what)

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        for name in self.SAVED:
            getattr(self, name).copy_(state[name])


@dataclass
class DeviceColumns(_SavedAdamState):
    """The selected columns of one matrix: which they are and their fp32 AdamW state, on the
    device."""
    column_indices: torch.Tensor   # long [k], sorted ascending
    master: torch.Tensor           # [out, k]
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    count: torch.Tensor            # 0-dim fp32: AdamW updates so far
    grad: torch.Tensor             # [out, k] scratch for the gathered gradient columns
    block: ColumnBlock | None = None   # whose [slot] views these are (alike small matrices)
    slot: int = 0

    SAVED = ("column_indices", *FP32_STATE)

    @classmethod
    def empty(cls, rows: int, k: int, device: torch.device) -> DeviceColumns:
        def z():
            return torch.zeros(rows, k, dtype=torch.float32, device=device)
        return cls(torch.zeros(k, dtype=torch.long, device=device), z(), z(), z(),
                   torch.zeros((), dtype=torch.float32, device=device), z())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (*(getattr(self, name) for name in self.SAVED), self.grad))

    def check_columns(self, state: dict, num_columns: int, what: str) -> None:
        """Raise ValueError unless the saved column indices are distinct columns of a matrix of
        `num_columns` columns, in ascending order (check_state_dict() the state first)."""
        saved = state["column_indices"]
        if saved.numel() and (int(saved.min()) < 0 or int(saved.max()) >= num_columns
                              or not bool((saved[1:] > saved[:-1]).all())):
            raise ValueError(f"{what}: saved column_indices must be distinct columns in "
                             f"0..{num_columns - 1}, ascending; got {saved.tolist()[:20]}")


@dataclass
class ColumnBlock:
    """The device columns of alike small matrices (an MoE's experts: thousands of [rows, cols]
    matrices with k selected columns each) side by side, as [size, rows, k]: each matrix's
    DeviceColumns are views of one slot, so that a step gathers, updates and scatters them all
    in a few launches, not a few per matrix."""
    column_indices: torch.Tensor   # long [size, k]
    master: torch.Tensor           # [size, rows, k] fp32
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor
    spread: torch.Tensor           # column_indices as an index into a [size, rows, cols] stack
    counts: torch.Tensor           # [size] fp32: each member's count (DeviceColumns.count)

    @property
    def size(self) -> int:
        return self.master.shape[0]

    @classmethod
    def of(cls, size: int, rows: int, k: int, device: torch.device
           ) -> tuple[ColumnBlock, list[DeviceColumns]]:
        """A block of `size` matrices, and its members' DeviceColumns."""
        indices = torch.zeros(size, k, dtype=torch.long, device=device)
        blocks = [torch.zeros(size, rows, k, dtype=torch.float32, device=device)
                  for _ in range(4)]
        counts = torch.zeros(size, dtype=torch.float32, device=device)
        block = cls(indices, *blocks, indices.unsqueeze(1).expand(size, rows, k), counts)
        members = [DeviceColumns(indices[j], *(b[j] for b in blocks[:3]), counts[j], blocks[3][j],
                                 block, j) for j in range(size)]
        return block, members

    def take(self, matrices: Sequence[torch.Tensor], out: torch.Tensor | None = None,
             slots: torch.Tensor | None = None) -> torch.Tensor:
        """The selected columns of `matrices` (its members', [rows, cols] each or the parameters'
        own shapes, contiguous, in slot order) as [size, rows, k]: into `out` (converted), else
        in the matrices' dtype. `slots`: the members `matrices` are, where not all of them (then
        written into those slots of `out`)."""
        spread = self.spread if slots is None else self.spread.index_select(0, slots)
        stack = torch.stack(matrices)
        if stack.dim() != 3:   # (parameters of more dimensions; a view is an operator a step)
            stack = stack.view(spread.shape[0], spread.shape[1], -1)
        if slots is not None and out is not None:
            return out.index_copy_(0, slots, torch.gather(stack, 2, spread).to(out.dtype))
        if out is None or out.dtype == stack.dtype:
            return torch.gather(stack, 2, spread, out=out)
        return out.copy_(torch.gather(stack, 2, spread))

    def put(self, matrices: list[torch.Tensor], slots: torch.Tensor | None = None) -> None:
        """The selected columns of `matrices` (its members', in slot order; `slots`: which,
        where not all) := the masters."""
        spread = self.spread if slots is None else self.spread.index_select(0, slots)
        master = self.master if slots is None else self.master.index_select(0, slots)
        stack = torch.stack(matrices)
        stack.scatter_(2, spread, master.to(stack.dtype))
        spread_rows(stack, matrices)


def spread_rows(stack: torch.Tensor, matrices: list[torch.Tensor]) -> None:
    """matrices[j] := stack[j], for alike [rows, cols] matrices, in one multi-tensor copy that
    makes no Python object per matrix (unbinding the stack made a view each: a few us, and
    thousands of objects for Python's collector at a window end of an MoE's experts)."""
    rows = matrices[0].shape[0]
    torch.split_with_sizes_copy(stack.view(len(matrices) * rows, -1), [rows] * len(matrices), 0,
                                out=matrices)


def column_blocks(shapes: list[tuple[int, int, torch.dtype, int]], device: torch.device
                  ) -> list[DeviceColumns]:
    """DeviceColumns for matrices of `shapes` (rows, cols, dtype, k): alike small ones (the same
    shape, dtype and k, at most transfers.STACK_ELEMENTS values each) share ColumnBlocks of at
    least two, the others have their own tensors."""
    alike: dict[tuple, list[int]] = {}
    for i, (rows, cols, dtype, k) in enumerate(shapes):
        if k > 0 and rows * cols <= STACK_ELEMENTS:
            alike.setdefault((rows, cols, dtype, k), []).append(i)
    made: list[DeviceColumns | None] = [None] * len(shapes)
    for (rows, cols, _, k), indices in alike.items():
        per_block = max(1, STACK_RUN_ELEMENTS // max(1, rows * cols))
        for start in range(0, len(indices), per_block):
            run = indices[start:start + per_block]
            if len(run) > 1:
                for i, member in zip(run, ColumnBlock.of(len(run), rows, k, device)[1]):
                    made[i] = member
    return [cols if cols is not None else DeviceColumns.empty(rows, k, device)
            for cols, (rows, _, _, k) in zip(made, shapes)]


class Runs(NamedTuple):
    """Positions in a list of matrices: `stacked`, members of ColumnBlocks in slot order (with
    `blocks`, theirs, and `slots`, None for a whole block, else the members' slots), and
    `single`, the rest (one launch each)."""
    stacked: list[list[int]]
    blocks: list[ColumnBlock]
    single: list[int]
    slots: list[torch.Tensor | None]


def runs_of(selected: list[DeviceColumns], partial: bool = False) -> Runs:
    """The positions of `selected` that are whole blocks, in slot order, and the rest; with
    `partial`, also two or more members of a block in slot order (an MoE's experts that some
    step leaves without a gradient)."""
    by_block: dict[int, list[int]] = {}
    single = []
    for j, cols in enumerate(selected):
        if cols.block is None:
            single.append(j)
        else:
            by_block.setdefault(id(cols.block), []).append(j)
    stacked, blocks, slots = [], [], []
    for run in by_block.values():
        block = selected[run[0]].block
        order = [selected[j].slot for j in run]
        if len(run) == block.size and order == list(range(block.size)):
            stacked.append(run)
            blocks.append(block)
            slots.append(None)
        elif partial and len(run) > 1 and order == sorted(set(order)):
            stacked.append(run)
            blocks.append(block)
            slots.append(torch.tensor(order, device=block.master.device))
        else:
            single.extend(run)
    return Runs(stacked, blocks, sorted(single), slots)


def write_selected(weights: list[torch.Tensor], selected: list[DeviceColumns],
                   runs: Runs | None = None) -> None:
    """Each weight's selected columns := its master values (converted to its dtype): the members
    of a whole ColumnBlock at once (`runs`, runs_of(selected) unless given), the rest one scatter
    each."""
    runs = runs or runs_of(selected, partial=True)
    for run, block, slots in zip(runs.stacked, runs.blocks, runs.slots):
        block.put([weights[j] for j in run], slots)
    columns.scatter_columns_of([weights[j] for j in runs.single],
                               [selected[j].column_indices for j in runs.single],
                               [selected[j].master for j in runs.single])


@dataclass
class DeviceVector(_SavedAdamState):
    """AdamW state of a vector parameter (bias, norm weight), always updated on the device."""
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    count: torch.Tensor            # 0-dim fp32: AdamW updates so far

    SAVED = FP32_STATE

    @classmethod
    def for_param(cls, param: torch.Tensor) -> DeviceVector:
        master = param.data if param.dtype == torch.float32 else param.detach().float().clone()
        return cls(master, torch.zeros_like(master), torch.zeros_like(master),
                   torch.zeros((), dtype=torch.float32, device=master.device))

    def nbytes(self, param: torch.Tensor) -> int:
        """Bytes it adds to the device (an fp32 parameter is its own master)."""
        owned = [self.exp_avg, self.exp_avg_sq]
        if self.master.data_ptr() != param.data_ptr():
            owned.append(self.master)
        return sum(t.numel() * t.element_size() for t in owned)


class _Batch:
    """Tensors that share hyperparameters, for one fused kernel call."""

    def __init__(self):
        self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.counts = [], [], [], [], []

    def add(self, master, grad, exp_avg, exp_avg_sq, count):
        self.params.append(master)
        self.grads.append(grad)
        self.exp_avgs.append(exp_avg)
        self.exp_avg_sqs.append(exp_avg_sq)
        self.counts.append(count)   # (advanced before the kernel: device_step)

    def extend(self, other: _Batch) -> None:
        for mine, theirs in zip((self.params, self.grads, self.exp_avgs, self.exp_avg_sqs,
                                 self.counts),
                                (other.params, other.grads, other.exp_avgs, other.exp_avg_sqs,
                                 other.counts)):
            mine.extend(theirs)


def group_hyperparameters(group: dict) -> tuple[float, float, float, float, float]:
    """(lr, beta1, beta2, eps, weight_decay) as plain floats, read from the group at each use."""
    beta1, beta2 = group["betas"]
    return (float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
            float(group["weight_decay"]))


class MatrixSteps:
    """The selected columns a device step updates, worked out once for a list of matrices (those
    with a gradient, which stay the same step after step: zenflow/optim/step_plan.py): their
    ColumnBlocks and the rest (`runs`), which gradients each gathers (C-level pickers), and the
    fused kernel's lists per param group. A step then gathers, updates and counts them in a few
    launches with no Python per matrix (thousands of an MoE's experts)."""

    def __init__(self, columns: list[DeviceColumns], groups: list[dict]):
        self.columns = columns
        self.runs = runs = runs_of(columns, partial=True)
        # (the same positions pick each matrix's gradient and its weights)
        self.run_picks = [picker(run) for run in runs.stacked]
        self.single_pick = picker(runs.single)
        single = [columns[j] for j in runs.single]
        self.single_indices = [cols.column_indices for cols in single]
        self.single_bufs = [cols.grad for cols in single]
        self.single_masters = [cols.master for cols in single]
        self.gathered = [block.grad for block in runs.blocks] + self.single_bufs
        # (a whole block's counts in one tensor; a block some of whose members have no
        # gradient counts theirs alone)
        self.counts = [block.counts for block, slots in zip(runs.blocks, runs.slots)
                       if slots is None] + [columns[j].count for run, slots in zip(
                           runs.stacked, runs.slots) if slots is not None for j in run] + [
                           cols.count for cols in single]
        by_group: dict[int, tuple[dict, _Batch]] = {}
        for cols, group in zip(columns, groups):
            by_group.setdefault(id(group), (group, _Batch()))[1].add(
                cols.master, cols.grad, cols.exp_avg, cols.exp_avg_sq, cols.count)
        self.by_group = list(by_group.values())

    def write(self, weights: Sequence[torch.Tensor]) -> None:
        """write_selected() of the columns into `weights` (in the columns' order)."""
        for block, pick, slots in zip(self.runs.blocks, self.run_picks, self.runs.slots):
            block.put(list(pick(weights)), slots)
        columns.scatter_columns_of(self.single_pick(weights), self.single_indices,
                                   self.single_masters)


def device_step(matrices: MatrixSteps | None, grads: Sequence[torch.Tensor],
                vectors: list[tuple[torch.Tensor, torch.Tensor, DeviceVector, dict]],
                scale) -> None:
    """One AdamW step of the selected columns of `matrices` (`grads`: their gradients, in its
    order) and of the vectors; the vectors are written into their params, the columns are not
    (MatrixSteps.write: the caller writes them once, after a window end's install where there is
    one: zenflow/optim/installs.py).

    `vectors` holds (weights, grad, state, group), `weights` the view the optimizer writes the
    parameter through (one row); entries without a gradient are left out by the caller, exactly
    as torch.optim skips them. `scale` (a `zenflow.optim.step_scale.StepScale`) multiplies every
    gradient; on a step it marks skipped, nothing changes: the counts advance by its kept flag and
    the fused kernel, handed its skip flag as torch.optim hands GradScaler's found_inf, leaves the
    state alone. The members of a whole ColumnBlock are gathered together.
    """
    batches: dict[tuple, _Batch] = {}
    hyperparameters: dict[int, tuple] = {}   # id(group) -> its own: read once per group

    def batch_of(group: dict) -> _Batch:
        key = hyperparameters.get(id(group))
        if key is None:
            key = hyperparameters[id(group)] = group_hyperparameters(group)
        batch = batches.get(key)
        if batch is None:
            batch = batches[key] = _Batch()
        return batch

    counts = []
    if matrices is not None and matrices.columns:
        for block, pick, slots in zip(matrices.runs.blocks, matrices.run_picks,
                                      matrices.runs.slots):
            block.take(pick(grads), out=block.grad, slots=slots)
        columns.gather_columns_of([columns.as_matrix(g) for g in matrices.single_pick(grads)],
                                  matrices.single_indices, matrices.single_bufs)
        for group, lists in matrices.by_group:
            batch_of(group).extend(lists)
        # one launch for all, not one per matrix (thousands of them in a MoE)
        torch._foreach_mul_(matrices.gathered, scale.coef)
        counts += matrices.counts
    scaled = (torch._foreach_mul([grad.float() for _, grad, _, _ in vectors], scale.coef)
              if vectors else [])
    for (_, _, state, group), vector_grad in zip(vectors, scaled):
        batch_of(group).add(state.master, vector_grad, state.exp_avg, state.exp_avg_sq,
                            state.count)

    # Every count this step updates advances by the kept flag: a whole block's in one add. A
    # list of the flag, not the flag: given one 0-dim tensor, _foreach_add_ picks its Scalar
    # overload and reads the flag into a number, which waits for the device.
    counts += [state.count for _, _, state, _ in vectors]
    if counts:
        torch._foreach_add_(counts, [scale.kept] * len(counts))
    for (lr, beta1, beta2, eps, weight_decay), b in batches.items():
        adamw_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.counts, lr=lr, beta1=beta1,
               beta2=beta2, eps=eps, weight_decay=weight_decay, skip=scale.skip)

    for weights, _, state, _ in vectors:
        if state.master.data_ptr() != weights.data_ptr():
            weights.copy_(state.master.view(weights.shape))
