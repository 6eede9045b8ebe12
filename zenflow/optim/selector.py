"""Choosing each matrix's device columns, and choosing again, with the state moving along.

The first selection happens at the first window boundary after warm-up; after that, at window
boundaries where the schedule (`selection_schedule.SelectionSchedule`) says so. Choosing is split in two so
that the optimizer can drain the host in between: `plan()` looks at this step's gradients and
says which matrices get which importance, `select()` moves the columns (`zenflow.optim.handoff`).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from zenflow.adamw import FP32_STATE
from zenflow.distributed import Partition
from zenflow.host.cores import lent_threads
from zenflow.host.pipeline import HostPipeline
from zenflow.optim import columns, handoff
from zenflow.optim.device_adam import runs_of, write_selected
from zenflow.optim.importance import MEASURES, retained_masses, top_columns
from zenflow.optim.params import HostParam
from zenflow.optim.selection_schedule import SelectionSchedule

log = logging.getLogger("zenflow")

# Above this share of the time since the first selection, reselections (each moves the selected
# columns' state between the device and the host buffers while the device waits: seconds at 7B
# parameters) are reported once, with the interval that would keep them within RESELECT_BUDGET.
RESELECT_WARN_SHARE = 0.10
RESELECT_BUDGET = 0.05


@dataclass
class SelectionPlan:
    first: bool                       # the first selection (else a reselection)
    matrices: list[HostParam]
    importances: list[torch.Tensor]   # per matrix, per column


class ColumnSelector:
    """Which columns of each matrix the device updates."""

    def __init__(self, matrices: list[HostParam], pipeline: HostPipeline, partition: Partition,
                 device: torch.device, importance: str, schedule: SelectionSchedule):
        self.every_matrix = matrices
        self.matrices = [m for m in matrices if m.k > 0]
        # Matrices whose selection can change (not every column on the device).
        self.movable = [m for m in self.matrices if m.k < m.num_columns]
        self.pipeline = pipeline
        self.device = device
        self.partition = partition
        self.measure = MEASURES[importance]
        self.schedule = schedule
        self.has_chosen = False      # columns chosen yet (not during warm-up)
        self.num_reselections = 0
        # wall seconds of the training thread in reselections (stats()), and since when
        self.reselect_seconds, self.last_reselect_seconds = 0.0, 0.0
        self._first: tuple[float, int] | None = None   # (perf_counter, step) of the first
        self._warned = False

    def plan(self, step: int, grads: dict) -> SelectionPlan | None:
        """At a window boundary: what to select now, or None to keep the selection."""
        if not self.has_chosen:
            return SelectionPlan(True, self.matrices, self._importances(grads, self.matrices))
        movable = self.movable
        if not movable:
            return None
        self.schedule.window_passed()
        if not self.schedule.check_due(step):
            return None
        # One pass over the gradients serves both the drift check and the new selection.
        importances = self._importances(grads, movable)
        retained = None
        if self.schedule.every_steps is None:
            retained = self._retained_fraction(movable, importances)
            self.schedule.drift_checked(retained)
        if not self.schedule.reselection_due(retained):
            log.debug("step %d: keep selection (retained importance %.3f); next check in %d "
                      "window(s)", step, retained, self.schedule.check_gap)
            return None
        log.debug("step %d: reselect (%s)", step,
                  f"retained importance {retained:.3f} < {self.schedule.drift_threshold}"
                  if retained is not None else f"every {self.schedule.every_steps} steps")
        return SelectionPlan(False, movable, importances)

    def reselection_due_at(self, step: int) -> bool:
        """Whether the schedule reselects at `step` whatever the windows (an interval schedule),
        so that the window in progress must end the step before. Nothing to move: never."""
        return self.has_chosen and bool(self.movable) and self.schedule.due_at(step)

    def select(self, plan: SelectionPlan, step: int) -> None:
        """Move the columns of `plan` (the host must hold no update in flight)."""
        start = time.perf_counter()
        self.pipeline.drain()
        with lent_threads(self.pipeline.worker_cores):   # the drained worker's cores are idle
            self._move(plan)
        self.has_chosen = True
        self.schedule.selected(step)
        self.tell_owned_columns()
        now = time.perf_counter()
        if plan.first or self._first is None:   # (a resumed run: from its first reselection)
            self._first = (now, step)
        if plan.first:
            return
        self.num_reselections += 1
        self.last_reselect_seconds = now - start
        self.reselect_seconds += now - start
        self._report_costly(now, step)

    def _report_costly(self, now: float, step: int) -> None:
        """Once: say so when reselections take more than RESELECT_WARN_SHARE of the time since
        the first selection (two of them at least), and what keeps them within RESELECT_BUDGET."""
        if self._warned or self._first is None or self.num_reselections < 2:
            return
        since, first_step = self._first
        elapsed, steps = now - since, step - first_step
        if steps <= 0 or self.reselect_seconds <= RESELECT_WARN_SHARE * elapsed:
            return
        self._warned = True
        step_s = max(1e-9, (elapsed - self.reselect_seconds) / steps)
        interval = math.ceil(self.last_reselect_seconds / (RESELECT_BUDGET * step_s))
        log.warning("reselections took %.1f s of the %.1f s since the first selection (%d of "
                    "them, the last %.2f s; %s): each moves the selected columns' state between "
                    "the device and the host while the device waits. Reselecting no more "
                    "often than every %d steps keeps them within %.0f%%: select_strategy='step' "
                    "with select_interval=%d, or under 'drift' a lower reselect_threshold.",
                    self.reselect_seconds, elapsed, self.num_reselections,
                    self.last_reselect_seconds, self.schedule.description, interval,
                    100 * RESELECT_BUDGET, interval)

    def _move(self, plan: SelectionPlan) -> None:
        done = self._move_blocks(plan)
        for j, (m, importance) in enumerate(zip(plan.matrices, plan.importances)):
            if j in done:
                continue
            chosen = top_columns(importance, m.k)
            host = {kind: self.pipeline.host.state(kind, m.host_index)
                    for kind in FP32_STATE}
            host_step = self.pipeline.host_step[m.host_index]
            if plan.first:
                handoff.take_from_host(m.selected, host, chosen, host_step, m.local.shape[0],
                                       self.partition)
            else:
                betas = tuple(float(b) for b in m.group["betas"])
                handoff.move_columns(m.selected, host, chosen, host_step, betas,
                                     self.pipeline.rows[m.host_index], m.local.shape[0],
                                     self.partition)
            if m.k:   # the device's columns now hold the host's values: the weights too (every
                # device step first takes the weights as written, optim/device_adam.py)
                m.param_from_selected(self.pipeline.weights(m.host_index))

    def _move_blocks(self, plan: SelectionPlan) -> set[int]:
        """The columns of whole ColumnBlocks whose members are back to back on the host, a block
        at once (the first selection: handoff.take_block_from_host; a reselection:
        move_block_columns; under data parallel every rank's rows of all the members in one
        gather); returns the positions in `plan` done."""
        done: set[int] = set()
        runs = runs_of([m.selected for m in plan.matrices])
        for run, block in zip(runs.stacked, runs.blocks):
            members = [plan.matrices[j] for j in run]
            indices = [m.host_index for m in members]
            stacks = {kind: self.pipeline.host.stacked_state(kind, indices) for kind in FP32_STATE}
            betas = {tuple(float(b) for b in m.group["betas"]) for m in members}
            if any(v is None for v in stacks.values()) or len(betas) > 1:
                continue
            chosen = top_columns(torch.stack([plan.importances[j] for j in run]), members[0].k)
            host_steps = [self.pipeline.host_step[i] for i in indices]
            if plan.first:
                handoff.take_block_from_host(block, stacks, chosen, host_steps, self.partition)
            else:
                handoff.move_block_columns(block, stacks, chosen, host_steps, *betas,
                                           self.pipeline.rows[indices[0]], self.partition)
            write_selected([self.pipeline.weights(i) for i in indices],
                           [m.selected for m in members])
            done.update(run)
        return done

    def tell_owned_columns(self) -> None:
        """The credit rule learns which columns the device owns now (after a selection or a
        load): each matrix's selected ones, or none before the first selection."""
        for m in self.every_matrix:
            owned = m.selected.column_indices if self.has_chosen and m.param.ndim >= 2 else None
            self.pipeline.credit.owned_columns(m.host_index, owned)

    def _importances(self, grads: dict, todo: list[HostParam]) -> list[torch.Tensor]:
        """Column importance of each matrix. Across ranks, each computes its measure's partial over
        its own rows and the ranks add them up: one number per column travels, never a gradient.
        (Under FSDP2 a rank's own rows are its shard: the same sum gives the same selection.)"""
        if not todo:
            return []
        partial: list = [None] * len(todo)
        own = self.pipeline.rows
        runs = runs_of([m.selected for m in todo])
        for run in runs.stacked:   # alike small matrices (a ColumnBlock's): one stack for all
            grads_run = [grads.get(todo[j].param) for j in run]
            if any(g is None for g in grads_run):
                runs.single.extend(run)
                continue
            stack = torch.stack([columns.as_matrix(g) for g in grads_run])
            if self.partition.active:   # (alike in rows, so alike in this rank's rows)
                stack = stack[:, own[todo[run[0]].host_index]]
            for j, sums in zip(run, self.measure.partial(stack).unbind(0)):
                partial[j] = sums
        for j in runs.single:
            m = todo[j]
            g = grads.get(m.param)
            if g is None:  # no gradient: ties everywhere, so the first columns win
                partial[j] = torch.zeros(m.num_columns, device=self.device)
                continue
            rows = columns.as_matrix(g)
            if self.partition.active:
                rows = rows[own[m.host_index]]
            partial[j] = self.measure.partial(rows)
        flat = torch.cat(partial)   # finished at once (one launch, not one a matrix)
        if self.partition.active:
            # On the device under NCCL; sum_ copies through the CPU only for gloo.
            flat = self.partition.sum_(flat, "exchanging column norms")
        return list(self.measure.finish(flat).split([m.num_columns for m in todo]))

    @staticmethod
    def _retained_fraction(todo: list[HostParam], importances) -> float:
        if not todo:
            return 1.0
        # One read of the device for every matrix (summed in double, as a Python loop would).
        held, best = retained_masses(importances, [m.selected.column_indices for m in todo],
                                     [m.k for m in todo]).tolist()
        return 1.0 if best == 0.0 else held / best

    def state_dict(self) -> dict:
        return {"has_chosen": self.has_chosen, "num_reselections": self.num_reselections,
                "schedule": self.schedule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.has_chosen, self.num_reselections = state["has_chosen"], state["num_reselections"]
        self.schedule.load_state_dict(state["schedule"])
