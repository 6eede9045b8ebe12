"""Where each matrix sits in the host buffers, and what a window's host update of it is.

The host keeps each matrix at full width [rows, in] (rows: this rank's share; zenflow/host/buffers.py
says why). The buffers, all flat views of one `Arena` (zenflow/host/arena.py), are the layout's
`regions()`:

    master, exp_avg, exp_avg_sq    fp32, every matrix back to back (the moments bf16 with
                                   host_moments_dtype="bfloat16": host/compact_moments.py)
    grad_sum{slot}                 fp32; one per window in flight (two with overlap)
    staging{slot}_{dtype}          the parameters' dtype: gradients on their way to the sums
    step_coef                      fp32, one per staging slot: the factor of the gradients in
                                   that slot (0 for a skipped step), copied with them
    install_{dtype}                the parameters' dtype: new values on their way to the device
    rate_{dtype}                   with deferred_credit="moments": each value's AdamW rate,
                                   1 / (sqrt(v_hat) + eps), on its way to the device (bf16 for
                                   16-bit parameters: fp16 cannot hold 1 / eps)
    factors                        fp32, with deferred_credit="factored": per matrix, from its
                                   `factor_offset`, the window's row sums of squares [rows], column
                                   sums [cols] and host-owned mask [cols] from the device, and
                                   the rate factors alpha [rows] and beta [cols] to it

A matrix whose window sums the device keeps ("moments") sends its sum of squares too: into the
other sum slot, which only host-summed matrices fill during a window (the layout has two slots
then), so the squares cost the host no memory.

Matrices are laid out grouped by dtype, so each dtype's part of an fp32 buffer lines up with its
staging and install buffers and a whole group is accumulated or converted in one flat pass.
A window's update of one matrix is a `HostJob` (its hyperparameters a `HostUpdate`): plain data
that the worker process receives as it is; a window's jobs travel as `HostJobs`, their columns.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from zenflow.adamw import MOMENTS
from zenflow.host.transfers import STACK_ELEMENTS, STACK_RUN_ELEMENTS


@dataclass(frozen=True)
class HostUpdate:
    """A window's host AdamW of one matrix, as its deferred-credit rule set it
    (zenflow/host/credit.py): the hyperparameters, and how the window counts."""
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    lookahead: float = 0.0   # install values this fraction of the next step ahead (0: the values)
    moments: bool = False    # the window counts as its gradients' AdamW steps; squares summed
    factored: bool = False   # ... with the squares as row and column sums ("factored")


@functools.lru_cache(maxsize=4096)
def shared_update(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  lookahead: float = 0.0, moments: bool = False,
                  factored: bool = False) -> HostUpdate:
    """HostUpdate(...), one object for all the matrices whose updates are alike (frozen, so it
    may be shared): a window end makes one per matrix, thousands in a MoE, and each is built
    and pickled to the worker (pickle writes a shared object once)."""
    return HostUpdate(lr, beta1, beta2, eps, weight_decay, lookahead, moments, factored)


class HostJob(NamedTuple):
    """One matrix's host update for one window (everything the worker needs, nothing else)."""
    matrix: int          # index into HostLayout.matrices
    step: int            # the matrix's host step count after this update
    num_grads: int       # gradients summed in the buffer; the update uses their mean
    update: HostUpdate
    widen: bool = False  # the sum arrived narrow (bf16, from the device): widen it first

    def saved(self) -> list:
        """The job as a saved state holds it: [matrix, step, num_grads, lr, beta1, beta2, eps,
        weight_decay, lookahead, moments, factored] (zenflow/host/pipeline_state.py checks it)."""
        u = self.update
        return [self.matrix, self.step, self.num_grads, u.lr, u.beta1, u.beta2, u.eps,
                u.weight_decay, u.lookahead, u.moments, u.factored]

    @classmethod
    def from_saved(cls, values: list) -> HostJob:
        """saved()'s list (a state of format 3 or older has no moments, one of format 5 or older
        no factored: they are False)."""
        matrix, step, num_grads, *hyper = values
        return cls(matrix, step, num_grads, HostUpdate(*hyper))


@dataclass
class HostJobs:
    """A window's HostJobs, as columns: a HostJob per matrix would be thousands of objects (an
    MoE's) that outlive the step that made them, and Python's collector scans every object of
    the process each time enough such survivors have piled up (at 5,000 matrices a full scan
    every few steps, 30 ms a step). Lists of numbers and shared HostUpdates are a few objects.
    Iterating gives each job as a HostJob."""
    matrices: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    num_grads: list[int] = field(default_factory=list)
    updates: list[HostUpdate] = field(default_factory=list)
    widen: list[bool] = field(default_factory=list)

    @classmethod
    def of(cls, jobs) -> HostJobs:
        made = cls()
        for job in jobs:
            made.append(*job)
        return made

    def append(self, matrix: int, step: int, num_grads: int, update: HostUpdate,
               widen: bool = False) -> None:
        self.matrices.append(matrix)
        self.steps.append(step)
        self.num_grads.append(num_grads)
        self.updates.append(update)
        self.widen.append(widen)

    def __len__(self) -> int:
        return len(self.matrices)

    def __iter__(self):
        return map(HostJob, self.matrices, self.steps, self.num_grads, self.updates, self.widen)

    def without(self, dropped: set[int]) -> HostJobs:
        """The jobs of the matrices not in `dropped`."""
        return HostJobs.of(job for job in self if job.matrix not in dropped)


@dataclass(frozen=True)
class HostMatrix:
    """Where one matrix (this rank's rows of it) sits in the host buffers."""
    rows: int
    cols: int
    dtype: torch.dtype    # the parameter's dtype: staging and install buffers use it
    offset: int           # first element in the fp32 buffers
    typed_offset: int     # first element in its dtype's staging and install buffers
    factor_offset: int = 0   # first element in the factors buffer (2 rows + 3 cols of it)

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class HostLayout:
    matrices: tuple[HostMatrix, ...]        # in the order the optimizer numbers them
    groups: tuple[tuple[torch.dtype, int, int], ...]  # (dtype, fp32 offset, numel), contiguous
    sum_slots: int
    staging_slots: int = 1
    rates: bool = False      # deferred_credit="moments": a rate buffer per dtype
    factors: bool = False    # deferred_credit="factored": the factors buffer
    moments_dtype: torch.dtype = torch.float32   # host_moments_dtype
    # back_to_back's and fp32_runs' answers, by the indices asked for: every step asks them of
    # the same indices (staging, accumulate, installs), and 5,000 matrices take a few ms of
    # Python each time
    _runs: dict = field(default_factory=dict, compare=False, repr=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_runs": {}}   # (the worker gets the layout: not the answers)

    def back_to_back(self, indices: list[int]) -> list[list[int]]:
        """`indices` in runs: small matrices alike in shape and dtype and back to back in the
        typed buffers (staging, install: build() places them so) are one run, copied at once
        between host and device (at most STACK_ELEMENTS values each, STACK_RUN_ELEMENTS a run);
        any other matrix is a run of its own. The runs come in the order of their first member
        in `indices`. The answer is kept (the caller does not change it)."""
        return self._kept(self._back_to_back, indices)

    def fp32_runs(self, indices: list[int]) -> list[tuple[int, int, torch.dtype]]:
        """Maximal runs (fp32 offset, numel, dtype) covering `indices`' matrices in the fp32
        buffers, merged where adjacent. The answer is kept (the caller does not change it)."""
        return self._kept(self._fp32_runs, indices)

    def _kept(self, answer, indices: list[int]):
        key = (answer.__name__, tuple(indices))
        runs = self._runs.get(key)
        if runs is None:
            if len(self._runs) >= 16:
                self._runs.clear()
            runs = self._runs[key] = answer(indices)
        return runs

    def _fp32_runs(self, indices: list[int]) -> list[tuple[int, int, torch.dtype]]:
        runs: list[list] = []
        for i in sorted(indices, key=lambda i: self.matrices[i].offset):
            m = self.matrices[i]
            if m.numel == 0:
                continue
            if runs and runs[-1][0] + runs[-1][1] == m.offset and runs[-1][2] == m.dtype:
                runs[-1][1] += m.numel
            else:
                runs.append([m.offset, m.numel, m.dtype])
        return [tuple(r) for r in runs]

    def _back_to_back(self, indices: list[int]) -> list[list[int]]:
        position = {i: p for p, i in enumerate(indices)}
        runs: list[list[int]] = []
        size = 0
        for i in sorted(indices, key=lambda i: (dtype_name(self.matrices[i].dtype),
                                                self.matrices[i].typed_offset)):
            m = self.matrices[i]
            if runs:
                last = self.matrices[runs[-1][-1]]
                if (m.numel <= STACK_ELEMENTS and size + m.numel <= STACK_RUN_ELEMENTS
                        and (m.rows, m.cols, m.dtype) == (last.rows, last.cols, last.dtype)
                        and m.typed_offset == last.typed_offset + last.numel):
                    runs[-1].append(i)
                    size += m.numel
                    continue
            runs.append([i])
            size = m.numel
        return sorted(runs, key=lambda run: min(position[i] for i in run))

    @classmethod
    def build(cls, shapes: list[tuple[int, int, torch.dtype]], sum_slots: int,
              staging_slots: int = 1, rates: bool = False, factors: bool = False,
              moments_dtype: torch.dtype = torch.float32) -> HostLayout:
        """Layout for matrices given as (rows, cols, dtype), numbered in the given order."""
        # By dtype, in order, except that alike small matrices (an MoE's experts, interleaved with
        # others in the model) are placed together, where the first of them is: back to back
        first: dict[tuple, int] = {}
        keys = [(dtype_name(dtype), first.setdefault((rows, cols, dtype), i)
                 if rows * cols <= STACK_ELEMENTS else i, i)
                for i, (rows, cols, dtype) in enumerate(shapes)]
        order = sorted(range(len(shapes)), key=keys.__getitem__)
        placed: dict[int, HostMatrix] = {}
        groups, offset = [], 0
        factor_offsets = [0]
        for rows, cols, _ in shapes:
            factor_offsets.append(factor_offsets[-1] + 2 * rows + 3 * cols)
        for i in order:
            rows, cols, dtype = shapes[i]
            if not groups or groups[-1][0] != dtype:
                groups.append([dtype, offset, 0])
            group = groups[-1]
            placed[i] = HostMatrix(rows, cols, dtype, offset, group[2], factor_offsets[i])
            group[2] += rows * cols
            offset += rows * cols
        if rates and sum_slots < 2:
            raise ValueError("rates (deferred_credit='moments') need two sum slots: the squares "
                             "of device-summed matrices go into the slot the window does not read")
        return cls(tuple(placed[i] for i in range(len(shapes))),
                   tuple(tuple(g) for g in groups), sum_slots, staging_slots, rates, factors,
                   moments_dtype)

    @property
    def numel(self) -> int:
        return sum(g[2] for g in self.groups)

    @property
    def factors_numel(self) -> int:
        """Elements of the factors buffer (0 without one)."""
        return sum(2 * m.rows + 3 * m.cols for m in self.matrices) if self.factors else 0

    def regions(self) -> list[tuple[str, torch.dtype, int]]:
        out = [("master", torch.float32, self.numel),
               *((name, self.moments_dtype, self.numel) for name in MOMENTS),
               *((f"grad_sum{s}", torch.float32, self.numel) for s in range(self.sum_slots))]
        out.append(("step_coef", torch.float32, self.staging_slots))
        if self.factors:
            out.append(("factors", torch.float32, self.factors_numel))
        for dtype, _, numel in self.groups:
            out += [(name, dtype, numel) for name in self._typed_names(dtype)]
            if self.rates:
                out.append((f"rate_{dtype_name(dtype)}", rate_dtype(dtype), numel))
        return out

    def _typed_names(self, dtype: torch.dtype) -> list[str]:
        name = dtype_name(dtype)
        return [*(f"staging{s}_{name}" for s in range(self.staging_slots)), f"install_{name}"]

    def dma_regions(self) -> list[str]:
        """Every buffer that device copies may read or write (which of them are page-locked
        depends on where the sums are placed: install_regions() and HostState.span())."""
        return ["step_coef", *(["factors"] if self.factors else []),
                *(name for dtype, _, _ in self.groups
                  for name in [*self._typed_names(dtype),
                               *([f"rate_{dtype_name(dtype)}"] if self.rates else [])])]

    def install_regions(self) -> list[str]:
        """The buffers that every window's copies read or write whatever the sums' placement
        (the install's values and rates, and the steps' factors): page-locked from the start.
        The staging and sum buffers are locked once the sums are placed, where their copies
        run (zenflow/host/pipeline.py)."""
        return ["step_coef", *(["factors"] if self.factors else []),
                *(name for dtype, _, _ in self.groups
                  for name in [f"install_{dtype_name(dtype)}",
                               *([f"rate_{dtype_name(dtype)}"] if self.rates else [])])]

def rate_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the AdamW rates of a parameter of `param_dtype`: bf16 for 16-bit weights
    (fp16 overflows at 1 / eps), fp32 for the others."""
    return torch.bfloat16 if param_dtype.itemsize == 2 else torch.float32

