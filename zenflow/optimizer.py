"""ZenFlowAdamW: AdamW that updates the important columns now and the rest asynchronously.

One step, top to bottom (docs/semantics.md):

    clip          global gradient norm; a non-finite norm skips the step untouched
    select        at a window boundary: choose each matrix's top-k columns (first time, or when due)
    stage         queue the copy of host-owned gradient rows to the host (no host arithmetic here)
    device        AdamW on the selected columns and on every vector parameter, fp32 state
    accumulate    tell the host to add the staged gradients to the window's fp32 sums
    end window    every `update_interval` steps: the host runs AdamW with the mean gradient

Warm-up steps (`full_warm_up_rounds`) are windows of one step with no column on the device.
With `overlap_step`, a window's host update is installed at the end of the next window, so the
host works while the device trains; otherwise it is installed before step() returns. The host
side (buffers, copies, the worker) is `zenflow.pipeline.HostPipeline`.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from zenflow import _checks, columns, handoff, selection
from zenflow.device_adam import DeviceColumns, DeviceVector, device_step, hyper
from zenflow.distributed import Partition, environment_without_group, local_rank_share
from zenflow.kernels import clip_coefficient, gradient_norms
from zenflow.pipeline import HostPipeline
from zenflow.settings import ADAMW_DEFAULTS, DEFAULTS, AdamWHyperparameters, ZenFlowSettings
from zenflow.telemetry import StepTimer
from zenflow.windows import AutoWindow, FixedWindow
from zenflow.worker import split_cores

log = logging.getLogger("zenflow")


@dataclass
class _HostParam:
    """A parameter whose state lives on the host, except for its `k` selected columns."""
    param: torch.nn.Parameter
    group: dict
    index: int                 # its number in the HostPipeline
    k: int                     # number of columns updated on the device
    columns: DeviceColumns     # the device side of the selected columns

    @property
    def num_columns(self) -> int:
        return self.param.numel() // max(1, self.param.shape[0]) if self.param.ndim >= 2 else \
            self.param.numel()


@dataclass
class _DeviceParam:
    """A vector parameter (bias, norm weight): plain AdamW on the device, every step."""
    param: torch.nn.Parameter
    group: dict
    state: DeviceVector


class ZenFlowAdamW(torch.optim.Optimizer):
    """AdamW with ZenFlow's importance-aware split between device and host.

    Args:
        params: parameters (or param groups with lr/betas/eps/weight_decay), all on one device.
            Parameters that do not require grad are kept in the groups and skipped, as
            torch.optim does; they cost no host memory.
        lr, betas, eps, weight_decay: as in torch.optim.AdamW; read from param_groups at each use.
        topk_ratio, select_strategy, select_interval, update_interval, full_warm_up_rounds,
        overlap_step, max_grad_norm, importance, steps_per_epoch, pt_reserved_cores_perc,
        reselect_threshold, auto_ratio, auto_update_bounds, worker: ZenFlow's knobs, the fields
            of `zenflow.ZenFlowSettings` (which says what each does and holds the defaults);
            the optimizer keeps them, validated, as `self.settings`.
        process_group: the torch.distributed group to partition the host state across (default:
            the default group when torch.distributed is initialized). Gradients must already be
            averaged across ranks (DDP or zenflow.initialize do it); the optimizer never reduces
            them again.
    """

    _NAME = "ZenFlowAdamW"
    _VECTORS_ON_HOST = False    # OffloadAdamW keeps every parameter on the host
    # torch.amp.GradScaler then hands step() its scale and inf flag (self.grad_scale and
    # self.found_inf) instead of unscaling the gradients in a separate pass, which it refuses to
    # do for fp16 gradients: the unscale folds into the clipping factor the step applies anyway.
    _step_supports_amp_scaling = True

    def __init__(self, params, lr: float = ADAMW_DEFAULTS.lr,
                 betas: tuple[float, float] = ADAMW_DEFAULTS.betas,
                 eps: float = ADAMW_DEFAULTS.eps, weight_decay: float = ADAMW_DEFAULTS.weight_decay,
                 *, topk_ratio: float = DEFAULTS.topk_ratio,
                 select_strategy: str = DEFAULTS.select_strategy,
                 select_interval: int | str = DEFAULTS.select_interval,
                 update_interval: int | str = DEFAULTS.update_interval,
                 full_warm_up_rounds: int = DEFAULTS.full_warm_up_rounds,
                 overlap_step: bool = DEFAULTS.overlap_step,
                 max_grad_norm: float | None = DEFAULTS.max_grad_norm,
                 importance: str = DEFAULTS.importance,
                 steps_per_epoch: int | None = DEFAULTS.steps_per_epoch,
                 pt_reserved_cores_perc: float = DEFAULTS.pt_reserved_cores_perc,
                 reselect_threshold: float = DEFAULTS.reselect_threshold,
                 auto_ratio: float = DEFAULTS.auto_ratio,
                 auto_update_bounds: tuple[int, int] = DEFAULTS.auto_update_bounds,
                 worker: bool = DEFAULTS.worker, process_group=None):
        self._closed = True          # until the worker exists, close() has nothing to do
        self.settings = ZenFlowSettings.from_arguments(
            self._NAME, topk_ratio=topk_ratio, select_strategy=select_strategy,
            select_interval=select_interval, update_interval=update_interval,
            full_warm_up_rounds=full_warm_up_rounds, overlap_step=overlap_step,
            max_grad_norm=max_grad_norm, importance=importance, steps_per_epoch=steps_per_epoch,
            pt_reserved_cores_perc=pt_reserved_cores_perc, reselect_threshold=reselect_threshold,
            auto_ratio=auto_ratio, auto_update_bounds=auto_update_bounds, worker=worker)
        settings = self.settings
        self._schedule = selection.SelectionSchedule.for_settings(settings, self._NAME)
        environment_without_group(self._NAME, process_group)
        if settings.update_interval == "auto":
            self._window = AutoWindow(settings.auto_ratio, *settings.auto_update_bounds,
                                      overlap=settings.overlap_step)
        else:
            self._window = FixedWindow(settings.update_interval)
        params = _checks.param_list(self._NAME, params)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.device = _checks.parameters(self._NAME,
                                         [p for g in self.param_groups for p in g["params"]])
        self._partition = Partition.from_group(process_group, self.device)
        self._build()

    def __getattr__(self, name: str):
        """The knobs read as attributes too: `opt.topk_ratio` is `opt.settings.topk_ratio`."""
        settings = self.__dict__.get("settings")
        if settings is not None and name in ZenFlowSettings.model_fields:
            return getattr(settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "_pipeline"):
            raise NotImplementedError(f"{self._NAME}: add_param_group after construction is not "
                                      "supported; pass every group to the constructor")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        AdamWHyperparameters.from_arguments(self._NAME, **{k: group[k] for k in
                                                          AdamWHyperparameters.model_fields})

    def _build(self) -> None:
        self._host_params: list[_HostParam] = []
        self._device_params: list[_DeviceParam] = []
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                if p.ndim >= 2 or self._VECTORS_ON_HOST:
                    k = selection.num_selected(self.settings.topk_ratio, p.numel() // p.shape[0]) \
                        if p.ndim >= 2 else 0
                    cols = DeviceColumns.empty(p.shape[0] if p.ndim >= 2 else 1, k,
                                               self.device, step=0)
                    self._host_params.append(_HostParam(p, group, len(self._host_params), k,
                                                        cols))
                else:
                    self._device_params.append(_DeviceParam(p, group, DeviceVector.for_param(p)))
        self._timer = StepTimer()
        worker_cores = None
        if self.settings.worker and self._host_params:
            cores = local_rank_share(sorted(os.sched_getaffinity(0)))
            worker_cores = split_cores(self.settings.pt_reserved_cores_perc, cores)[1]
        self._pipeline = HostPipeline([m.param for m in self._host_params], self._partition,
                                      self.device, self.settings.overlap_step, worker_cores, self._timer,
                                      self._NAME)
        self._closed = False
        self._step = 0               # optimizer steps taken (skipped ones not counted)
        self._window_steps = 0       # steps accumulated in the current window
        self._selected = False       # columns chosen yet (false during warm-up)
        self.skipped_steps = 0
        self.num_reselections = 0
        self.num_windows = 0
        self.decisions: list[tuple[int, str]] = []  # (step, "select"|"reselect"|"flush")
        self._step_seconds = 0.0     # moving average of the time between step() calls
        self._last_step_start = None
        self._consecutive_skips = 0
        self._versions = self._param_versions()

    @property
    def _runner(self):
        return self._pipeline.runner

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._closed:
            raise RuntimeError(f"{self._NAME}: step() after close()")
        self._pipeline.check()  # a dead worker fails this step, not only the next window end
        self._adopt_outside_writes()
        grads = self._gradients()
        if not grads:
            return loss
        self._timer.begin()
        self._measure_step_period()
        norms = dict(zip(grads, gradient_norms(list(grads.values()))))
        clip_coef = None
        if not self._amp_found_inf():
            clip_coef = clip_coefficient(list(norms.values()), self.settings.max_grad_norm,
                                         self._amp_grad_scale())
        if clip_coef is None:
            self._skip()
            return loss
        self._consecutive_skips = 0

        warming_up = self._step < self.settings.full_warm_up_rounds
        if not warming_up and self._window_steps == 0:
            self._maybe_select(grads)
        self._pipeline.stage({m.index: grads[m.param] for m in self._host_params
                              if m.param in grads and self._host_owns_columns(m)})
        self._device_update(grads, clip_coef)
        if not warming_up and isinstance(self._window, AutoWindow):
            self._observe_importance(grads, norms, clip_coef)
        self._pipeline.accumulate(clip_coef)
        self._window_steps += 1
        if warming_up or self._window_ends():
            if not warming_up:
                log.debug("step %d: end window: %s", self._step, self._window.reason)
            self._end_window(synchronous=warming_up or not self.settings.overlap_step)
        self._pipeline.fence()
        self._step += 1
        self._timer.end()
        return loss

    def _gradients(self) -> dict[torch.Tensor, torch.Tensor]:
        """The present gradients of trainable parameters, checked."""
        grads = {}
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None or not p.requires_grad:
                    continue
                if g.is_sparse or g.device != self.device:
                    where = "sparse" if g.is_sparse else f"on {g.device}"
                    raise ValueError(f"{self._NAME}: the gradient of a parameter of shape "
                                     f"{tuple(p.shape)} is {where}; dense gradients on "
                                     f"{self.device} are required")
                grads[p] = g
        return grads

    def _skip(self) -> None:
        self.skipped_steps += 1
        self._consecutive_skips += 1
        n = self._consecutive_skips
        if n & (n - 1) == 0:   # 1, 2, 4, 8, ...: loud at first, then rate-limited
            log.warning("%s: skipped step %d: the gradients are not finite (%d consecutive "
                        "skipped steps, %d in all)", self._NAME, self._step, n, self.skipped_steps)
        self._timer.end(skipped=True)

    def _param_versions(self) -> dict:
        return {p: p._version for p in (*(m.param for m in self._host_params),
                                        *(v.param for v in self._device_params))}

    def _adopt_outside_writes(self) -> None:
        """Weights changed outside the optimizer since it last wrote them (model.load_state_dict,
        an in-place edit under no_grad: anything that bumps a tensor's version counter) become
        the new master values, as if the optimizer had been built on them; the moments stay.
        Our own writes go through .data and do not bump the counter."""
        host = [m for m in self._host_params if m.param._version != self._versions[m.param]]
        vectors = [v for v in self._device_params if v.param._version != self._versions[v.param]]
        if not host and not vectors:
            return
        log.info("%s: adopting the new values of %d parameter(s) changed outside the optimizer",
                 self._NAME, len(host) + len(vectors))
        self._pipeline.adopt([m.index for m in host])
        for m in host:
            if self._selected and m.k > 0:
                columns.gather_columns(columns.as_matrix(m.param.detach()), m.columns.index,
                                       out=m.columns.master)
        for v in vectors:
            if v.state.master.data_ptr() != v.param.data_ptr():
                v.state.master.copy_(v.param.detach())
        self._versions = self._param_versions()

    def _amp_found_inf(self) -> bool:
        found_inf = getattr(self, "found_inf", None)     # set by GradScaler.step around step()
        return found_inf is not None and bool(found_inf.item() > 0)

    def _amp_grad_scale(self) -> float:
        grad_scale = getattr(self, "grad_scale", None)   # None once unscale_() has run
        return 1.0 if grad_scale is None else float(grad_scale)

    def _host_owns_columns(self, m: _HostParam) -> bool:
        return not self._selected or m.k < m.num_columns

    def _window_ends(self) -> bool:
        ends = self._window.should_end(self._window_steps, self._pipeline.ready(),
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
        present = [m for m in self._host_params if m.param in grads and m.param.ndim >= 2]
        if not present:
            return
        # The device update just gathered (and clipped) the selected columns: their norms need
        # no extra pass. One stacked transfer instead of one device sync per matrix.
        selected = [m for m in present if m.k > 0]
        selected_norms = torch._foreach_norm([m.columns.grad for m in selected]) if selected else []
        total_sq = (torch.stack([norms[m.param] for m in present]).double() * clip_coef
                    ).square().tolist()
        sel_sq = dict(zip((id(m) for m in selected),
                          torch.stack(selected_norms).double().square().tolist()
                          if selected else []))
        deferred_sq = sum(max(0.0, t - sel_sq.get(id(m), 0.0)) for m, t in zip(present, total_sq))
        self._window.observe(deferred_sq, sum(m.num_columns - m.k for m in present),
                             sum(sel_sq.values()), sum(m.k for m in present))

    def _device_update(self, grads, clip_coef: float) -> None:
        matrices = []
        if self._selected:
            matrices = [(m.param, grads[m.param], m.columns, m.group) for m in self._host_params
                        if m.k > 0 and m.param in grads]
        vectors = [(v.param, grads[v.param], v.state, v.group) for v in self._device_params
                   if v.param in grads]
        device_step(matrices, vectors, clip_coef)

    # ------------------------------------------------------------------ windows
    def _end_window(self, synchronous: bool) -> None:
        """Install the previous window's host update, hand this window's sums to the host, and
        with `synchronous` install that too before returning."""
        self._install_in_flight()
        self._pipeline.end_window([hyper(m.group) for m in self._host_params])
        if synchronous:
            self._install_in_flight()
        self._window.last_interval = self._window_steps
        self._window.ended()
        self._window_steps = 0
        self.num_windows += 1
        self.decisions.append((self._step, "flush"))
        del self.decisions[:-10_000]

    def _install_in_flight(self) -> None:
        """Wait for the host update in flight (if any), install it, and write the device's own,
        newer columns back over it."""
        for i in self._pipeline.install():
            m = self._host_params[i]
            if self._selected and m.k > 0:
                columns.scatter_columns(columns.as_matrix(m.param.data), m.columns.index,
                                        m.columns.master)

    def synchronize(self) -> None:
        """Wait for the in-flight host update and install it now (before evaluation or saving
        the final model). Training continues correctly afterwards; the update is just visible
        earlier than the overlap schedule would make it."""
        self._adopt_outside_writes()
        self._install_in_flight()

    # ------------------------------------------------------------------ selection
    def _maybe_select(self, grads) -> None:
        if not self._selected:
            todo = [m for m in self._host_params if m.k > 0]
            self._select(todo, self._importances(grads, todo), first=True)
            return
        movable = [m for m in self._host_params if 0 < m.k < m.num_columns]
        if not movable or not self._schedule.wants_check(self._step):
            return
        # One pass over the gradients serves both the drift check and the new selection.
        importances = self._importances(grads, movable)
        retained = None
        if self._schedule.every_steps is None:
            retained = self._retained_fraction(movable, importances)
        if self._schedule.due(retained):
            log.debug("step %d: reselect (%s)", self._step,
                      f"retained importance {retained:.3f} < {self.settings.reselect_threshold}"
                      if retained is not None else f"{self._schedule.every_steps} steps passed")
            self._install_in_flight()  # state can only move once the host is drained
            self._select(movable, importances, first=False)
        elif retained is not None:
            log.debug("step %d: keep selection (retained importance %.3f); next check in %d "
                      "window(s)", self._step, retained, self._schedule.check_gap)

    def _importances(self, grads, todo: list[_HostParam]) -> list[torch.Tensor]:
        """Column importance of each matrix. Across ranks, each computes it over its own rows and
        the ranks add them up: one number per column travels, never a gradient."""
        partial = []
        for m in todo:
            g = grads.get(m.param)
            if g is None:  # no gradient: ties everywhere, so the first columns win
                partial.append(torch.zeros(m.num_columns, device=self.device))
                continue
            if self._partition.active:
                g = columns.as_matrix(g)[self._pipeline.rows[m.index]]
            norms = selection.column_importance(g, self.settings.importance)
            partial.append(norms.square_() if self.settings.importance == "l2" and
                           self._partition.active else norms)
        if not self._partition.active or not partial:
            return partial
        # On the device under NCCL; sum_ copies through the CPU only for gloo.
        flat = self._partition.sum_(torch.cat(partial), "exchanging column norms")
        out = list(flat.split([m.num_columns for m in todo]))
        return [t.sqrt() for t in out] if self.settings.importance == "l2" else out

    def _retained_fraction(self, todo: list[_HostParam], importances) -> float:
        held = best = 0.0
        for m, importance in zip(todo, importances):
            h, b = selection.retained_mass(importance, m.columns.index, m.k)
            held, best = held + h, best + b
        return 1.0 if best == 0.0 else held / best

    def _select(self, todo: list[_HostParam], importances, first: bool) -> None:
        self._pipeline.drain()
        for m, importance in zip(todo, importances):
            new_index = selection.top_columns(importance, m.k)
            host = {kind: self._pipeline.host.fp32(kind, m.index)
                    for kind in ("master", "exp_avg", "exp_avg_sq")}
            host_step = self._pipeline.host_step[m.index]
            if first:
                handoff.take_from_host(m.columns, host, new_index, host_step, m.param.shape[0],
                                       self._partition)
            else:
                betas = tuple(float(b) for b in m.group["betas"])
                handoff.move_columns(m.columns, host, new_index, host_step, betas,
                                     self._pipeline.rows[m.index], m.param.shape[0],
                                     self._partition)
        self._selected = True
        self._schedule.selected(self._step)
        if not first:
            self.num_reselections += 1
        self.decisions.append((self._step, "select" if first else "reselect"))

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the host worker and release its memory. Idempotent.

        There is deliberately no __del__ here: frameworks wrap optimizers in objects that share
        this one's __dict__ (Lightning's LightningOptimizer does), and such a wrapper's
        collection must not stop the worker the real optimizer still uses. The runner stops
        its worker when the runner itself is collected, and at interpreter exit."""
        if not getattr(self, "_closed", True):
            self._closed = True
            self._pipeline.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def stats(self) -> dict:
        """Telemetry: counters, memory per parameter, per-step timings and bytes moved."""
        from zenflow.state import device_bytes
        host_numel = sum(m.param.numel() for m in self._host_params)
        numel = host_numel + sum(v.param.numel() for v in self._device_params)
        dev = device_bytes(self)
        return {
            "steps": self._step,
            "skipped_steps": self.skipped_steps,
            "windows": self.num_windows,
            "reselections": self.num_reselections,
            "update_interval": self.settings.update_interval,
            "last_window_steps": self._window.last_interval,
            "retained_importance": self._schedule.last_retained,
            "world_size": self._partition.world_size,
            "collective_bytes_sent": dict(self._partition.bytes_sent),
            "host_busy_s": self._runner.busy_seconds,
            "worker": self.settings.worker and bool(self._host_params),
            "host_bytes": self._pipeline.nbytes(),
            "host_bytes_per_param": self._pipeline.nbytes() / max(1, host_numel),
            "pinned_bytes": self._pipeline.pinned_bytes(),
            "device_state_bytes": dev,
            "device_state_bytes_per_param": dev / max(1, numel),
            **self._timer.summary(),
        }

    def timeline(self) -> dict:
        """Per-step records of the training process ({start, end, step_s, stall_s, offload_s,
        d2h_bytes, h2d_bytes, skipped}) and the (start, end) of each host update, in
        perf_counter() seconds, for plotting the two side by side."""
        return {"steps": list(self._timer.records), "host_updates": list(self._runner.updates)}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Everything needed to continue exactly: host and device state, selection, counters and
        the partial window. Waits for in-flight host work first (without installing it)."""
        from zenflow.state import optimizer_state_dict
        self._adopt_outside_writes()
        return optimizer_state_dict(self)

    def check_state_dict(self, state_dict: dict) -> None:
        """Raise ValueError if load_state_dict(state_dict) would fail; changes nothing."""
        from zenflow.state import validate
        validate(self, state_dict)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state saved by state_dict() from an optimizer over the same parameters.
        Everything is checked before anything changes: a failed load leaves this optimizer as
        it was. Load the model's weights first, then this (as frameworks do): weights loaded
        afterwards count as changed outside the optimizer and become the master values."""
        from zenflow.state import load_optimizer_state_dict
        load_optimizer_state_dict(self, state_dict)
        # The weights as they are now (usually just loaded from the same checkpoint) belong with
        # this state; only later outside writes are adopted.
        self._versions = self._param_versions()
