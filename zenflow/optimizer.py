"""ZenFlowAdamW: AdamW that updates the important columns now and the rest asynchronously.

One step, top to bottom (DESIGN.md section 2):

    clip          global gradient norm; a non-finite norm skips the step untouched
    select        at a window boundary: choose each matrix's top-k columns (first time, or when due)
    device        AdamW on the selected columns and on every vector parameter, fp32 state
    accumulate    add this step's gradients to the host's fp32 sums
    end window    every `update_interval` steps: the host runs AdamW with the mean gradient

Warm-up steps (`full_warm_up_rounds`) are windows of one step with no column on the device.
With `overlap_step`, a window's host update is installed at the end of the next window, so the
host works while the device trains; otherwise it is installed before step() returns.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from zenflow import _checks, columns, selection
from zenflow.accelerator import Transfers, pin_in_place, unpin
from zenflow.distributed import Partition, local_rank_share
from zenflow.device_adam import DeviceColumns, DeviceVector, device_step, hyper
from zenflow.host import HostJob, HostState, InlineHostRunner
from zenflow.kernels import clip_coefficient, gradient_norms, moment_rescale
from zenflow.telemetry import StepTimer
from zenflow.windows import AutoWindow, FixedWindow
from zenflow.worker import WorkerHostRunner, split_cores

_NAME = "ZenFlowAdamW"
log = logging.getLogger("zenflow")


@dataclass
class _Matrix:
    """Bookkeeping of one matrix parameter (ndim >= 2), viewed as [out, in]."""
    param: torch.nn.Parameter
    group: dict
    host: int                  # index into HostState.matrices
    k: int                     # number of columns updated on the device
    device: DeviceColumns
    rows: slice                # the rows of the host state this rank holds (all: one rank)
    host_step: int = 0         # host AdamW updates so far
    num_grads: int = 0         # gradients summed in the current window

    @property
    def num_columns(self) -> int:
        return self.param.numel() // self.param.shape[0]


@dataclass
class _Vector:
    param: torch.nn.Parameter
    group: dict
    state: DeviceVector


class ZenFlowAdamW(torch.optim.Optimizer):
    """AdamW with ZenFlow's importance-aware split between device and host.

    Args:
        params: trainable parameters (or param groups with lr/betas/eps/weight_decay), one device.
        lr, betas, eps, weight_decay: as in torch.optim.AdamW; read from param_groups at each use.
        topk_ratio: fraction of each matrix's columns (input channels) updated on the device.
        select_strategy: "step", "epoch" or "auto" (= "step").
        select_interval: steps (or epochs) between reselections, or "auto": reselect when the
            selected columns hold less than `reselect_threshold` of the best columns' importance.
        update_interval: steps per host window, or "auto": end a window when the deferred
            columns' summed gradient reaches one important step (see zenflow/windows.py).
        auto_ratio: the "auto" window threshold (DeepSpeed's key and default).
        auto_update_bounds: (min, max) window length for update_interval="auto".
        full_warm_up_rounds: initial steps that update every parameter fully (on the host).
        overlap_step: install each window's host update one window later, hiding the host's work.
        max_grad_norm: clip gradients to this global L2 norm (None: no clipping).
        importance: "l2" or "l1" column norm.
        steps_per_epoch: needed by select_strategy="epoch".
        pt_reserved_cores_perc: share of cores left to the training process (the rest: worker).
        reselect_threshold: retained-importance fraction under which "auto" reselects. One
            step's gradient is noisy: a few steps after a fresh selection the selected columns
            hold 0.66-0.81 of the best columns' importance when nothing has drifted (measured:
            MiniLM fine-tuned on BBC News, batch 16; a GPT from scratch), so the default 0.6
            fires on drift, not on noise.
        worker: run host updates in a separate worker process (False: in the training process,
            synchronously; for debugging).
        process_group: the torch.distributed group to partition the host state across (default:
            the default group when torch.distributed is initialized). Gradients must already be
            averaged across ranks (DDP or zenflow.initialize do it); the optimizer never reduces
            them again.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, topk_ratio: float = 0.1,
                 select_strategy: str = "auto", select_interval="auto", update_interval=4,
                 full_warm_up_rounds: int = 0, overlap_step: bool = True,
                 max_grad_norm: float | None = None, importance: str = "l2",
                 steps_per_epoch: int | None = None, pt_reserved_cores_perc: float = 0.5,
                 reselect_threshold: float = 0.6, auto_ratio: float = 0.99,
                 auto_update_bounds: tuple[int, int] = (1, 16), worker: bool = True,
                 process_group=None):
        self._built = False
        self.topk_ratio = _checks.between(_NAME, "topk_ratio", topk_ratio, 0.0, 1.0)
        self.select_strategy = _checks.choice(_NAME, "select_strategy", select_strategy,
                                              ("auto", "step", "epoch"))
        self.select_interval = _checks.integer(_NAME, "select_interval", select_interval, low=1,
                                               allow_auto=True)
        self.update_interval = _checks.integer(_NAME, "update_interval", update_interval, low=1,
                                               allow_auto=True)
        self.auto_ratio = _checks.number(_NAME, "auto_ratio", auto_ratio, low=0.0, low_open=True)
        self.auto_update_bounds = _checks.interval_bounds(_NAME, "auto_update_bounds",
                                                          auto_update_bounds)
        self.full_warm_up_rounds = _checks.integer(_NAME, "full_warm_up_rounds",
                                                   full_warm_up_rounds, low=0)
        if not isinstance(overlap_step, bool):
            raise TypeError(f"{_NAME}: overlap_step must be True or False, got {overlap_step!r}")
        self.overlap_step = overlap_step
        self.max_grad_norm = (None if max_grad_norm is None else
                              _checks.number(_NAME, "max_grad_norm", max_grad_norm, low=0.0,
                                             low_open=True))
        self.importance = _checks.choice(_NAME, "importance", importance, ("l2", "l1"))
        self.steps_per_epoch = (None if steps_per_epoch is None else
                                _checks.integer(_NAME, "steps_per_epoch", steps_per_epoch, low=1))
        self.pt_reserved_cores_perc = _checks.between(_NAME, "pt_reserved_cores_perc",
                                                      pt_reserved_cores_perc, 0.0, 1.0)
        self.reselect_threshold = _checks.between(_NAME, "reselect_threshold",
                                                  reselect_threshold, 0.0, 1.0)
        if not isinstance(worker, bool):
            raise TypeError(f"{_NAME}: worker must be True or False, got {worker!r}")
        self.worker = worker
        self._schedule = self._make_schedule()
        self._partition = Partition.from_group(process_group)
        if self.update_interval == "auto":
            self._window = AutoWindow(self.auto_ratio, *self.auto_update_bounds,
                                      overlap=self.overlap_step)
        else:
            self._window = FixedWindow(self.update_interval)

        params = _checks.param_list(_NAME, params)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        all_params = [p for g in self.param_groups for p in g["params"]]
        self.device = _checks.parameters(_NAME, all_params)
        self._build()

    def _make_schedule(self) -> selection.SelectionSchedule:
        if self.select_interval == "auto":
            return selection.SelectionSchedule(drift_threshold=self.reselect_threshold)
        if self.select_strategy == "epoch":
            if self.steps_per_epoch is None:
                raise ValueError(f"{_NAME}: select_strategy=\"epoch\" with select_interval="
                                 f"{self.select_interval} needs steps_per_epoch")
            return selection.SelectionSchedule(every_steps=self.select_interval *
                                               self.steps_per_epoch)
        return selection.SelectionSchedule(every_steps=self.select_interval)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_built", False):
            raise NotImplementedError(f"{_NAME}: add_param_group after construction is not "
                                      "supported; pass every group to the constructor")
        super().add_param_group(param_group)
        _checks.group_hyperparameters(_NAME, self.param_groups[-1])

    # ------------------------------------------------------------------ construction
    def _build(self) -> None:
        self._matrices: list[_Matrix] = []
        self._vectors: list[_Vector] = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim >= 2:
                    k = selection.num_selected(self.topk_ratio, p.numel() // p.shape[0])
                    cols = DeviceColumns.empty(p.shape[0], k, self.device, step=0)
                    self._matrices.append(_Matrix(p, group, len(self._matrices), k, cols,
                                                  self._partition.rows(p.shape[0])))
                else:
                    self._vectors.append(_Vector(p, group, DeviceVector.for_param(p)))
        num_slots = 2 if self.overlap_step else 1
        self._transfers = Transfers(self.device)
        self._pinned: list[torch.Tensor] = []
        own_rows = [columns.as_matrix(m.param.detach())[m.rows] for m in self._matrices]
        if self.worker and self._matrices:
            self._host = HostState.allocate(own_rows, num_slots, shared=True)
            if self._transfers.cuda:
                self._pinned = pin_in_place([t for m in self._host.matrices for t in m.tensors()])
            cores = local_rank_share(sorted(os.sched_getaffinity(0)))
            _, worker_cores = split_cores(self.pt_reserved_cores_perc, cores)
            self._runner = WorkerHostRunner(self._host, worker_cores)
        else:
            self._host = HostState.allocate(own_rows, num_slots)
            self._runner = InlineHostRunner(self._host)

        self._step = 0               # optimizer steps taken (skipped ones not counted)
        self._window_steps = 0       # steps accumulated in the current window
        self._slot = 0               # host gradient-sum buffer being filled
        self._selected = False       # columns chosen yet (false during warm-up)
        self._in_flight: list[int] | None = None   # matrices whose host update is not installed
        self.skipped_steps = 0
        self.num_reselections = 0
        self.num_windows = 0
        self.decisions: list[tuple[int, str]] = []  # (step, "select"|"reselect"|"flush")
        self._timer = StepTimer()
        self._step_seconds = 0.0     # moving average of the time between step() calls
        self._last_step_start = None
        self._closed = False
        self._built = True

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._closed:
            raise RuntimeError(f"{_NAME}: step() after close()")
        self._runner.check()  # a dead worker fails this step, not only the next window end
        grads = self._gradients()
        if all(g is None for g in grads.values()):
            return loss
        self._timer.begin()
        self._measure_step_period()
        norms = dict(zip((p for p, g in grads.items() if g is not None),
                         gradient_norms([g for g in grads.values() if g is not None])))
        clip_coef = clip_coefficient(list(norms.values()), self.max_grad_norm)
        if clip_coef is None:
            self.skipped_steps += 1
            self._timer.end(skipped=True)
            return loss

        warming_up = self._step < self.full_warm_up_rounds
        if not warming_up and self._window_steps == 0:
            self._maybe_select(grads, clip_coef)
        self._device_update(grads, clip_coef)
        if not warming_up and isinstance(self._window, AutoWindow):
            self._observe_importance(grads, norms, clip_coef)
        self._accumulate(grads, clip_coef)
        self._window_steps += 1
        if warming_up or self._window_ends():
            if not warming_up:
                log.debug("step %d: end window: %s", self._step, self._window.reason)
            self._end_window(synchronous=warming_up or not self.overlap_step)
        self._step += 1
        self._timer.end()
        return loss

    def _gradients(self) -> dict[torch.Tensor, torch.Tensor | None]:
        grads = {}
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is not None and (g.is_sparse or g.device != self.device):
                    raise ValueError(f"{_NAME}: the gradient of a parameter of shape "
                                     f"{tuple(p.shape)} is {'sparse' if g.is_sparse else 'on ' + str(g.device)}"
                                     f"; dense gradients on {self.device} are required")
                grads[p] = g
        return grads

    def _window_ends(self) -> bool:
        ends = self._window.should_end(self._window_steps, self._runner.ready(),
                                       self._runner.last_update_seconds, self._step_seconds)
        if isinstance(self._window, AutoWindow):
            # Timings differ between ranks; every rank must end the window at the same step.
            ends = self._partition.any(ends, "agreeing on the end of a host window")
        return ends

    def _measure_step_period(self) -> None:
        now = time.perf_counter()
        if self._last_step_start is not None:
            period = now - self._last_step_start
            self._step_seconds = (period if self._step_seconds == 0.0
                                  else 0.8 * self._step_seconds + 0.2 * period)
        self._last_step_start = now

    def _observe_importance(self, grads, norms, clip_coef: float) -> None:
        """Feed the auto window this step's squared norms of deferred and selected columns."""
        present = [m for m in self._matrices if grads[m.param] is not None]
        if not present:
            return
        # The device update just gathered (and clipped) the selected columns: their norms need
        # no extra pass. One stacked transfer instead of one device sync per matrix.
        selected = [m for m in present if m.k > 0]
        selected_norms = torch._foreach_norm([m.device.grad for m in selected]) if selected else []
        total = torch.stack([norms[m.param] for m in present]).double() * clip_coef
        total_sq = total.square().tolist()
        sel_sq = dict(zip((id(m) for m in selected),
                          torch.stack(selected_norms).double().square().tolist()
                          if selected else []))
        deferred_sq = sum(max(0.0, t - sel_sq.get(id(m), 0.0)) for m, t in zip(present, total_sq))
        self._window.observe(deferred_sq, sum(m.num_columns - m.k for m in present),
                             sum(sel_sq.values()), sum(m.k for m in present))

    def _device_update(self, grads, clip_coef: float) -> None:
        matrices = []
        if self._selected:
            matrices = [(m.param, grads[m.param], m.device, m.group) for m in self._matrices
                        if m.k > 0 and grads[m.param] is not None]
        vectors = [(v.param, grads[v.param], v.state, v.group) for v in self._vectors
                   if grads[v.param] is not None]
        device_step(matrices, vectors, clip_coef)

    def _host_owns_columns(self, m: _Matrix) -> bool:
        return not self._selected or m.k < m.num_columns

    def _accumulate(self, grads, clip_coef: float) -> None:
        todo = [m for m in self._matrices
                if grads[m.param] is not None and self._host_owns_columns(m)]
        on_host = self._transfers.to_host([columns.as_matrix(grads[m.param])[m.rows]
                                           for m in todo])
        for m, g in zip(todo, on_host):
            grad_sum = self._host.matrices[m.host].grad_sums[self._slot]
            columns.add_(grad_sum, g, alpha=clip_coef)
            self._timer.moved(d2h=g.numel() * g.element_size())
            m.num_grads += 1

    # ------------------------------------------------------------------ windows
    def _end_window(self, synchronous: bool) -> None:
        """Hand the window's gradient sums to the host; install results per the overlap rule."""
        self._install_in_flight()
        jobs = []
        for m in self._matrices:
            if m.num_grads == 0:
                continue
            m.host_step += 1
            jobs.append(HostJob(m.host, m.host_step, m.num_grads, *hyper(m.group)))
            m.num_grads = 0
        self._window.last_interval = self._window_steps
        self._window.ended()
        self._window_steps = 0
        self.num_windows += 1
        self.decisions.append((self._step, "flush"))
        if not jobs:
            return
        self._runner.submit(jobs, self._slot)
        self._in_flight = [job.matrix for job in jobs]
        if synchronous:
            self._install_in_flight()
        else:
            self._slot = 1 - self._slot

    def _install_in_flight(self) -> None:
        """Wait for the submitted host update (if any) and copy its columns to the device."""
        if self._in_flight is None:
            return
        self._timer.stall(self._runner.wait())
        installs = [self._matrices[index] for index in self._in_flight]
        self._transfers.to_device([(columns.as_matrix(m.param.data), self._installed_values(m))
                                   for m in installs])
        for m in installs:
            param = columns.as_matrix(m.param.data)
            self._timer.moved(h2d=param.numel() * param.element_size())
            if self._selected and m.k > 0:
                # The host updated every column; the device's own columns are newer.
                columns.scatter_columns(param, m.device.index, m.device.master)
        self._in_flight = None

    def _installed_values(self, m: _Matrix) -> torch.Tensor:
        """The host's new values of a whole matrix: this rank's rows, plus the other ranks'."""
        master = self._host.matrices[m.host].master
        if not self._partition.active:
            return master
        # Only the parameter's dtype needs to travel; each rank keeps its own fp32 rows.
        return self._partition.gather_rows(master.to(m.param.dtype), m.param.shape[0],
                                           "installing host-updated rows")

    def synchronize(self) -> None:
        """Wait for the in-flight host update and install it now (before evaluation or saving
        the final model). Training continues correctly afterwards; the update is just visible
        earlier than the overlap schedule would make it."""
        self._install_in_flight()

    # ------------------------------------------------------------------ selection
    def _maybe_select(self, grads, clip_coef: float) -> None:
        if not self._selected:
            self._select(grads, first=True)
            return
        if not self._schedule.wants_check(self._step):
            return
        retained = None
        if self._schedule.every_steps is None:
            retained = self._retained_fraction(grads)
        if self._schedule.due(retained):
            log.debug("step %d: reselect (%s)", self._step,
                      f"retained importance {retained:.3f} < {self.reselect_threshold}"
                      if retained is not None else f"{self._schedule.every_steps} steps passed")
            self._install_in_flight()  # state can only move once the host is drained
            self._select(grads, first=False)
        elif retained is not None:
            log.debug("step %d: keep selection (retained importance %.3f); next check in %d "
                      "window(s)", self._step, retained, self._schedule.check_gap)

    def _importances(self, grads, matrices: list[_Matrix]) -> list[torch.Tensor]:
        """Column importance of each matrix. Across ranks, each computes it over its own rows and
        the ranks add them up: one number per column travels, never a gradient."""
        partial = []
        for m in matrices:
            g = grads[m.param]
            if g is None:  # no gradient: ties everywhere, so the first columns win
                partial.append(torch.zeros(m.num_columns, device=self.device))
                continue
            if self._partition.active:
                g = columns.as_matrix(g)[m.rows]
            norms = selection.column_importance(g, self.importance)
            partial.append(norms.square_() if self.importance == "l2" and
                           self._partition.active else norms)
        if not self._partition.active or not partial:
            return partial
        flat = self._partition.sum_(torch.cat(partial).cpu(), "exchanging column norms")
        out = list(flat.to(self.device).split([m.num_columns for m in matrices]))
        return [t.sqrt() for t in out] if self.importance == "l2" else out

    def _retained_fraction(self, grads) -> float:
        held = best = 0.0
        todo = [m for m in self._matrices if 0 < m.k < m.num_columns]
        for m, importance in zip(todo, self._importances(grads, todo)):
            h, b = selection.retained_mass(importance, m.device.index, m.k)
            held, best = held + h, best + b
        return 1.0 if best == 0.0 else held / best

    def _select(self, grads, first: bool) -> None:
        todo = [m for m in self._matrices if m.k > 0]
        for m, importance in zip(todo, self._importances(grads, todo)):
            new_index = selection.top_columns(importance, m.k)
            if first:
                self._take_from_host(m, new_index)
            elif m.k < m.num_columns:
                self._move_columns(m, new_index)
        self._selected = True
        self._schedule.selected(self._step)
        if not first:
            self.num_reselections += 1
        self.decisions.append((self._step, "select" if first else "reselect"))

    def _take_from_host(self, m: _Matrix, index: torch.Tensor) -> None:
        """First selection: the device side starts at the host's count with the host's state."""
        host = self._host.matrices[m.host]
        cpu_index = index.cpu()
        dev = m.device
        dev.index.copy_(index)
        dev.step = m.host_step
        for dst, src in ((dev.master, host.master), (dev.exp_avg, host.exp_avg),
                         (dev.exp_avg_sq, host.exp_avg_sq)):
            dst.copy_(self._gather_host_columns(m, src, cpu_index))

    def _gather_host_columns(self, m: _Matrix, host_tensor: torch.Tensor,
                             cols: torch.Tensor) -> torch.Tensor:
        """host_tensor[:, cols] over all rows of the matrix (other ranks hold the other rows)."""
        own = columns.gather_columns(host_tensor, cols,
                                     out=host_tensor.new_empty(host_tensor.shape[0], len(cols)))
        return self._partition.gather_rows(own, m.param.shape[0], "moving columns to the device")

    def _move_columns(self, m: _Matrix, new_index: torch.Tensor) -> None:
        """Reselection: columns that leave the device go back to the host and columns that join
        come from it, with master values, moments (rescaled between the two sides' step counts
        so bias-corrected values are unchanged) and nothing reset."""
        host = self._host.matrices[m.host]
        dev = m.device
        beta1, beta2 = (float(b) for b in m.group["betas"])
        old = dev.index.cpu()
        new = new_index.cpu()
        stays = torch.isin(new, old)
        leaves = ~torch.isin(old, new)

        # Device -> host for the columns that leave.
        out_cols, out_pos = old[leaves], leaves.nonzero().flatten().to(dev.index.device)
        for name, beta in (("master", None), ("exp_avg", beta1), ("exp_avg_sq", beta2)):
            leaving = getattr(dev, name)[m.rows].index_select(1, out_pos).cpu()
            if beta is not None:
                leaving.mul_(moment_rescale(beta, dev.step, m.host_step))
            columns.scatter_columns(getattr(host, name), out_cols, leaving)

        # New device arrays: staying columns from the device, joining ones from the host.
        stay_src = torch.searchsorted(old, new[stays]).to(dev.index.device)
        stay_dst = stays.nonzero().flatten().to(dev.index.device)
        join_cols = new[~stays]
        join_dst = (~stays).nonzero().flatten().to(dev.index.device)
        for name, beta in (("master", None), ("exp_avg", beta1), ("exp_avg_sq", beta2)):
            current = getattr(dev, name)
            fresh = torch.empty_like(current)
            fresh.index_copy_(1, stay_dst, current.index_select(1, stay_src))
            joining = self._gather_host_columns(m, getattr(host, name), join_cols)
            if beta is not None:
                joining.mul_(moment_rescale(beta, m.host_step, dev.step))
            fresh.index_copy_(1, join_dst, joining.to(fresh.device))
            setattr(dev, name, fresh)
        dev.index = new_index.to(dev.index.device)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the host worker and release its memory. Idempotent.

        There is deliberately no __del__ here: frameworks wrap optimizers in objects that share
        this one's __dict__ (Lightning's LightningOptimizer does), and such a wrapper's
        collection must not stop the worker the real optimizer still uses. The runner stops
        its worker when the runner itself is collected, and at interpreter exit."""
        if not getattr(self, "_closed", True):
            self._closed = True
            self._runner.close()
            unpin(self._pinned)
            self._pinned = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def stats(self) -> dict:
        """Telemetry: counters and per-step timings of the training process and the host."""
        return {
            "steps": self._step,
            "skipped_steps": self.skipped_steps,
            "windows": self.num_windows,
            "reselections": self.num_reselections,
            "update_interval": self.update_interval,
            "last_window_steps": self._window.last_interval,
            "retained_importance": self._schedule.last_retained,
            "world_size": self._partition.world_size,
            "collective_bytes_sent": dict(self._partition.bytes_sent),
            "host_busy_s": self._runner.busy_seconds,
            "worker": isinstance(self._runner, WorkerHostRunner),
            "host_bytes": self._host.nbytes(),
            **self._timer.summary(),
        }

    def timeline(self) -> dict:
        """Per-step records of the training process ({start, end, step_s, stall_s, d2h_bytes,
        h2d_bytes, skipped}) and the (start, end) of each host update, in perf_counter() seconds,
        for plotting the two side by side."""
        return {"steps": list(self._timer.records),
                "host_updates": list(getattr(self._runner, "updates", []))}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Everything needed to continue exactly: host and device state, selection, counters and
        the partial window. Waits for in-flight host work first (without installing it)."""
        self._timer.stall(self._runner.wait())
        index_of = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state = {}
        for m in self._matrices:
            host = self._host.matrices[m.host]
            state[index_of[m.param]] = {
                "kind": "matrix", "host_step": m.host_step, "num_grads": m.num_grads,
                "host_master": host.master.clone(), "host_exp_avg": host.exp_avg.clone(),
                "host_exp_avg_sq": host.exp_avg_sq.clone(),
                "host_grad_sum": host.grad_sums[self._slot].clone(),
                "device_step": m.device.step, "device_index": m.device.index.clone(),
                "device_master": m.device.master.clone(),
                "device_exp_avg": m.device.exp_avg.clone(),
                "device_exp_avg_sq": m.device.exp_avg_sq.clone(),
            }
        for v in self._vectors:
            state[index_of[v.param]] = {
                "kind": "vector", "step": v.state.step, "master": v.state.master.clone(),
                "exp_avg": v.state.exp_avg.clone(), "exp_avg_sq": v.state.exp_avg_sq.clone(),
            }
        groups = []
        for g in self.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": [index_of[p] for p in g["params"]]})
        return {"state": state, "param_groups": groups, "zenflow": {
            "step": self._step, "window_steps": self._window_steps, "selected": self._selected,
            "in_flight": self._in_flight, "skipped_steps": self.skipped_steps,
            "num_reselections": self.num_reselections, "num_windows": self.num_windows,
            "schedule": self._schedule.state_dict(), "window": self._window.state_dict(),
            "topk_ratio": self.topk_ratio,
            "overlap_step": self.overlap_step, "world_size": self._partition.world_size,
            "rank": self._partition.rank,
        }}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state saved by state_dict() from an optimizer over the same parameters."""
        saved = state_dict.get("zenflow")
        if saved is None:
            raise ValueError(f"{_NAME}: load_state_dict got a state dict without the 'zenflow' "
                             "section; it was not saved by ZenFlowAdamW")
        params = [p for g in self.param_groups for p in g["params"]]
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"{_NAME}: load_state_dict: saved param groups have sizes "
                             f"{[len(g['params']) for g in groups]}, this optimizer's have "
                             f"{[len(g['params']) for g in self.param_groups]}")
        if saved.get("world_size", 1) != self._partition.world_size:
            raise ValueError(f"{_NAME}: load_state_dict: the state was saved by rank "
                             f"{saved.get('rank', 0)} of {saved.get('world_size', 1)}, but this "
                             f"run has {self._partition.world_size} rank(s); each rank holds "
                             "only its share of the host state, so resume on the same number "
                             "of ranks")
        if saved.get("rank", 0) != self._partition.rank:
            raise ValueError(f"{_NAME}: load_state_dict: this is rank {self._partition.rank} "
                             f"but the state belongs to rank {saved.get('rank', 0)}")
        if saved["topk_ratio"] != self.topk_ratio:
            raise ValueError(f"{_NAME}: load_state_dict: saved topk_ratio {saved['topk_ratio']} "
                             f"differs from this optimizer's {self.topk_ratio}")
        self._timer.stall(self._runner.wait())
        index_of = {p: i for i, p in enumerate(params)}
        for m in self._matrices:
            s = state_dict["state"][index_of[m.param]]
            if s["kind"] != "matrix" or s["host_master"].shape != self._host.matrices[m.host].master.shape:
                raise ValueError(f"{_NAME}: load_state_dict: saved state for the parameter of "
                                 f"shape {tuple(m.param.shape)} does not match it")
            host = self._host.matrices[m.host]
            host.master.copy_(s["host_master"])
            host.exp_avg.copy_(s["host_exp_avg"])
            host.exp_avg_sq.copy_(s["host_exp_avg_sq"])
            for buf in host.grad_sums:
                buf.zero_()
            host.grad_sums[0].copy_(s["host_grad_sum"])
            m.host_step, m.num_grads = s["host_step"], s["num_grads"]
            dev = m.device
            dev.step = s["device_step"]
            for name in ("index", "master", "exp_avg", "exp_avg_sq"):
                getattr(dev, name).copy_(s[f"device_{name}"])
        for v in self._vectors:
            s = state_dict["state"][index_of[v.param]]
            if s["kind"] != "vector" or s["master"].shape != v.state.master.shape:
                raise ValueError(f"{_NAME}: load_state_dict: saved state for the parameter of "
                                 f"shape {tuple(v.param.shape)} does not match it")
            v.state.step = s["step"]
            for name in ("master", "exp_avg", "exp_avg_sq"):
                getattr(v.state, name).copy_(s[name])
        for group, saved_group in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        self._slot = 0
        self._step, self._window_steps = saved["step"], saved["window_steps"]
        self._selected, self._in_flight = saved["selected"], saved["in_flight"]
        self.skipped_steps = saved["skipped_steps"]
        self.num_reselections, self.num_windows = saved["num_reselections"], saved["num_windows"]
        self._schedule.load_state_dict(saved["schedule"])
        self._window.load_state_dict(saved["window"])
