"""ZenFlowAdamW: AdamW that updates the important columns now and the rest asynchronously.

One step, top to bottom (docs/semantics.md):

    clip          global gradient norm and the step's factor, as device tensors (a non-finite norm
                  or GradScaler's found_inf marks the step skipped there: see "Skips" below)
    select        at a window boundary: choose each matrix's top-k columns (first time, or when due)
    stage         add host-owned gradient rows into the window's fp32 sums on the device (where
                  they fit `device_sum_budget`); queue the copy of the others to the host
    device        AdamW on the selected columns and on every vector parameter, fp32 state
    accumulate    tell the host to add the staged gradients to the window's fp32 sums
    end window    every `update_interval` steps: the host runs AdamW with the mean gradient

Warm-up steps (`full_warm_up_rounds`) are windows of one step with no column on the device.

Skips. A step strictly inside a window reads nothing back from the device: its factor and kept
flag (`StepScale`) go to every kernel (the fused AdamW takes the skip flag as torch.optim takes
GradScaler's found_inf; the "moments" interim step moves nothing), and the factor travels to the
host with the gradients. Whether it was skipped is settled at the window's end in one read
(`_settle_skips`), and a window with a skipped step is dropped: its deferred gradients count for
nothing (keeping a non-finite gradient out of the device's sums would cost a pass every step;
deciding at the window's end costs nothing). A window's first step (and a warm-up step) reads its
flag at once, since selecting columns needs finite gradients; a skip found there is undone
entirely, as if step() had not been called.
With `overlap_step`, a window's host update is installed at the end of the next window, so the
host works while the device trains; otherwise it is installed before step() returns.

The parts this class drives: `zenflow.optim.params` (each parameter, and where its state lives),
`zenflow.optim.selector.ColumnSelector` (choosing the columns, and choosing again),
`zenflow.host.pipeline.HostPipeline` (the host side: buffers, copies, the worker),
`zenflow.optim.windows` (when a window ends); `zenflow.optim.state` saves and loads them all;
`zenflow.config.settings` holds the knobs. What a script calls between steps (synchronize, attach,
close, stats, state_dict, ...) is the mixin in zenflow/optim/between_steps.py.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Literal

import torch

from zenflow.config.settings import (
    ADAMW_DEFAULTS,
    DEFAULTS,
    ZenFlowSettings,
    check_torch_adamw_flags,
    refuse_unknown_keywords,
)
from zenflow.distributed import Partition, environment_without_group, row_sharding_group
from zenflow.host.cores import local_rank_share, split_cores
from zenflow.host.credit import credit_for
from zenflow.host.device_sums import sum_dtype
from zenflow.host.pipeline import HostPipeline
from zenflow.host.telemetry import StepTimer
from zenflow.host.transfers import uses_cuda
from zenflow.host.weight_views import WeightViews
from zenflow.host.worker import start_server_early
from zenflow.optim import param_checks as _checks
from zenflow.optim.between_steps import BetweenSteps
from zenflow.optim.device_adam import group_hyperparameters
from zenflow.optim.installs import Installs
from zenflow.optim.outside_writes import OutsideWrites
from zenflow.optim.params import built_layout, device_update, sort_params
from zenflow.optim.selection_schedule import SelectionSchedule
from zenflow.optim.selector import ColumnSelector
from zenflow.optim.state import StepCounters
from zenflow.optim.step_plan import GradientReader, importance_split
from zenflow.optim.step_scale import Skips, gradient_norms, step_scale
from zenflow.optim.windows import DelayedAgreement, StepPeriod, window_for

log = logging.getLogger("zenflow")


class ZenFlowAdamW(BetweenSteps, torch.optim.Optimizer):
    """AdamW with ZenFlow's importance-aware split between device and host.

    Args:
        params: parameters (or param groups with lr/betas/eps/weight_decay), all on one device.
            Parameters that do not require grad are kept in the groups and skipped, as
            torch.optim does; they cost no host memory.
        lr, betas, eps, weight_decay: as in torch.optim.AdamW; read from param_groups at each use.
        topk_ratio ... worker: ZenFlow's knobs, keyword-only: the fields of
            `zenflow.ZenFlowSettings` (which says what each does; docs/knobs.md lists them), with
            its defaults (tests/test_settings.py checks both lists agree). The optimizer keeps
            them, validated, as `self.settings`; repr() shows them.
        amsgrad, maximize, foreach, capturable, differentiable, fused: torch.optim.AdamW's flags,
            so that a torch user's call runs as written. `foreach` and `fused` change nothing:
            the device update always runs torch's fused AdamW kernel where the device has one.
            The others are honoured at False, their default, and refused otherwise with the
            reason (zenflow.config.settings.UNSUPPORTED_TORCH_FLAGS).
        process_group: the torch.distributed group to partition the host state across (default:
            the default group when torch.distributed is initialized). Gradients must already be
            averaged across ranks (DDP or zenflow.initialize do it); the optimizer never reduces
            them again. FSDP2-sharded parameters (`fully_shard`: DTensors, Shard(0) on a 1-D
            mesh) use their mesh's group: each rank keeps the state of its own rows only, and
            the ranks sum column norms and squared gradient norms (docs/fsdp2.md).
    """

    _NAME = "ZenFlowAdamW"
    _VECTORS_ON_HOST = False    # OffloadAdamW keeps every parameter on the host
    # torch.amp.GradScaler then hands step() its scale and inf flag (self.grad_scale and
    # self.found_inf) instead of unscaling the gradients in a separate pass, which it refuses to
    # do for fp16 gradients: the unscale folds into the clipping factor the step applies anyway.
    _step_supports_amp_scaling = True

    def __new__(cls, *args, **kwargs):
        """Refuse a keyword the constructor does not take before Python does (type checkers
        read __init__'s signature, so they catch the same typo statically)."""
        refuse_unknown_keywords(cls._NAME, cls.__init__, kwargs)
        return super().__new__(cls)

    def __init__(self, params, lr: float = ADAMW_DEFAULTS.lr,
                 betas: tuple[float, float] = ADAMW_DEFAULTS.betas,
                 eps: float = ADAMW_DEFAULTS.eps, weight_decay: float = ADAMW_DEFAULTS.weight_decay,
                 amsgrad: bool = False, *,
                 # ZenFlow's knobs: ZenFlowSettings' fields, its defaults and its types.
                 topk_ratio: float = DEFAULTS.topk_ratio,
                 select_strategy: str = DEFAULTS.select_strategy,
                 select_interval: int | Literal["auto"] = DEFAULTS.select_interval,
                 update_interval: int | Literal["auto"] = DEFAULTS.update_interval,
                 full_warm_up_rounds: int = DEFAULTS.full_warm_up_rounds,
                 overlap_step: bool = DEFAULTS.overlap_step,
                 max_grad_norm: float | None = DEFAULTS.max_grad_norm,
                 importance: str = DEFAULTS.importance,
                 deferred_credit: str = DEFAULTS.deferred_credit,
                 install_lookahead: float = DEFAULTS.install_lookahead,
                 steps_per_epoch: int | None = DEFAULTS.steps_per_epoch,
                 pt_reserved_cores_perc: float | None = DEFAULTS.pt_reserved_cores_perc,
                 reselect_threshold: float = DEFAULTS.reselect_threshold,
                 auto_ratio: float | None = DEFAULTS.auto_ratio,
                 auto_update_bounds: tuple[int, int] = DEFAULTS.auto_update_bounds,
                 device_sum_budget: int | Literal["auto"] = DEFAULTS.device_sum_budget,
                 device_sum_dtype: str = DEFAULTS.device_sum_dtype,
                 host_moments_dtype: str = DEFAULTS.host_moments_dtype,
                 worker: bool = DEFAULTS.worker,
                 process_group=None,
                 # torch.optim.AdamW's flags (see the docstring).
                 maximize: bool = False, foreach: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None):
        # The knobs, as the signature above named them (every one a ZenFlowSettings field).
        knobs = {name: value for name, value in locals().items()
                 if name in ZenFlowSettings.model_fields}
        self._closed = True          # until the worker exists, close() has nothing to do
        self._lock = threading.RLock()
        check_torch_adamw_flags(self._NAME, amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                                capturable=capturable, differentiable=differentiable, fused=fused)
        self.settings = ZenFlowSettings.from_arguments(self._NAME, **knobs)
        if self.settings.worker:
            start_server_early()
        schedule = SelectionSchedule.for_settings(self.settings, self._NAME)
        self._window = window_for(self.settings)
        environment_without_group(self._NAME, process_group)
        params = _checks.param_list(self._NAME, params)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.device = _checks.parameters(self._NAME,
                                         [p for g in self.param_groups for p in g["params"]])
        # FSDP2-sharded parameters bring their own group (their mesh's), and their rows.
        shard_group = row_sharding_group(self._NAME, [p for g in self.param_groups
                                                      for p in g["params"]], process_group)
        self._partition = Partition.from_group(shard_group or process_group, self.device,
                                               rows_are_local=shard_group is not None)
        if shard_group is None:   # replicas (DDP) must agree; shards differ by design
            _checks.replicas_agree(self._NAME, [p for g in self.param_groups for p in g["params"]],
                                   self._partition)
        self._build(schedule)

    def _build(self, schedule: SelectionSchedule) -> None:
        self._built = built_layout(self.param_groups)
        self._host_params, self._vector_params = sort_params(
            self.param_groups, self.settings.topk_ratio, self._VECTORS_ON_HOST, self.device)
        # torch.optim's `state` says where each trainable parameter's state lives (the state
        # itself is in the parts below; state_dict() has all of it). It is never empty: an empty
        # one makes torch.distributed.checkpoint's get/set_optimizer_state_dict "initialize" the
        # optimizer by running step() on zero gradients, which would count a step and decay the
        # moments.
        for m in self._host_params:
            self.state[m.param] = {"kind": "host"}
        for v in self._vector_params:
            self.state[v.param] = {"kind": "vector"}
        self._timer, knobs, worker_cores = StepTimer(), self.settings, None
        if knobs.worker and self._host_params:
            cores = local_rank_share(sorted(os.sched_getaffinity(0)))
            worker_cores = split_cores(knobs.pt_reserved_cores_perc, cores)[1]
        weights = [m.param for m in self._host_params]
        self._group_of = {m.host_index: m.group for m in self._host_params}   # (_step_sizes)
        self._pipeline = HostPipeline(
            weights, self._partition, self.device, knobs.overlap_step, worker_cores, self._timer,
            self._NAME, device_sum_budget=knobs.device_sum_budget, lock=self._lock,
            credit=credit_for(knobs.deferred_credit, knobs.device_sum_budget,
                              uses_cuda(self.device), self._partition.splits_rows),
            device_sum_dtype=sum_dtype(knobs.device_sum_dtype, [w.dtype for w in weights]),
            moments_dtype=getattr(torch, knobs.host_moments_dtype))
        self._closed = False
        self._vector_weights = WeightViews([v.param for v in self._vector_params])
        self._selector = ColumnSelector(self._host_params, self._pipeline, self._partition,
                                        self.device, self.settings.importance, schedule)
        self.counters = StepCounters()
        self.decisions: list[tuple[int, str]] = []  # (step, "select"|"reselect"|"flush")
        self._step_period = StepPeriod()
        self._skips = Skips(self.counters, self._NAME)
        self._agreement = DelayedAgreement(self._partition)
        self._outside_writes = OutsideWrites(self._host_params, self._vector_params,
                                             self._pipeline, self._selector, self._NAME)
        self._installs = Installs(self._pipeline, self._host_params, self._outside_writes,
                                  self._selector, self._lock)
        self._gradients = GradientReader(self.param_groups, self._host_params, self._vector_params,
                                         self.device, self._NAME, self._built)

    def _step_sizes(self) -> dict[int, tuple[float, float]] | None:
        """Each matrix's (lr, AdamW step bound) now, for the rule's moves (None: it takes none)."""
        return self._pipeline.credit.step_sizes(self._group_of)

    # ------------------------------------------------------------------ the step
    def step(self, closure=None):
        """One optimizer step (module doc). `closure` (re-evaluates the loss: forward and
        backward) runs first, without the optimizer's lock: on CUDA the backward, its hooks and
        any forward that activation checkpointing recomputes run on autograd's device thread,
        and a hook there must never wait for a lock this thread holds while it waits for the
        backward. Every pending install is finished before the closure, so its forward's
        pre-hooks find nothing to do."""
        loss = None
        if closure is not None:
            self.wait_for_install()
            with torch.enable_grad():
                loss = closure()
        with self._lock:   # as every method that changes the state (between_steps.serialized)
            self._step()
        return loss

    @torch.no_grad()
    def _step(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self._NAME}: step() after close()")
        if self._installs.pending():   # an attached forward may have left some: were they read?
            self._installs.check_forward_reads(
                [m.host_index for m in self._host_params if m.param.grad is not None])
            self._installs.finish()
        self._pipeline.check()  # a dead worker fails this step, not only the next window end
        # GradScaler.unscale_ rewrites gradients without bumping their versions; scaler.step()
        # then hands found_inf but no grad_scale (the scale is out of the gradients already).
        self._pipeline.early_copies.step_began(unscaled_in_place=getattr(
            self, "found_inf", None) is not None and getattr(self, "grad_scale", None) is None)
        self._outside_writes.adopt()
        self._outside_writes.adopt_device_writes()
        grads = self._gradients.read(self.param_groups, self._selector.has_chosen)
        if grads is None:
            return
        self._timer.begin()
        self._step_period.tick()
        norms = gradient_norms(grads.present(), grads.plan.norm_runs)   # (in present()'s order)
        # torch.amp.GradScaler sets grad_scale and found_inf around step() (None without one)
        scale = step_scale(norms, self.settings.max_grad_norm,
                           getattr(self, "grad_scale", None), getattr(self, "found_inf", None),
                           self._partition)
        count = self.counters
        warming_up = count.step < self.settings.full_warm_up_rounds
        reads_now = warming_up or count.window_steps == 0
        # selecting columns needs finite gradients: a window's first step decides its skip now
        if reads_now and not self._skips.read_now(count.step, scale):
            self._timer.end(skipped=True)
            return
        if window_starts := not warming_up and count.window_steps == 0:
            with self._pipeline.transfers.window_work():   # a window's fixed cost (a
                self._outside_writes.adopt_data_writes()   # selection is not: its own schedule)
                self._pipeline.place()
            self._select_columns(grads.by_param)
            grads = self._gradients.replan(grads, self._selector.has_chosen)
        staged = grads.staged()
        credit = self._pipeline.credit   # its interim step writes the matrices it moves
        if not credit.prints_moves and not window_starts:   # (else fingerprinted: by its
            # compiled step, or by the window's start, which looked for writes through .data)
            self._outside_writes.watch_moves(credit.moving_among(staged), moved=False)
        self._pipeline.stage(staged, scale.coef, self._step_sizes())
        moved = credit.moving_among(staged)   # (again: stage() places a state loaded before)
        self._outside_writes.watch_moves(moved, moved=True, printed=credit.take_prints())
        if not reads_now:
            self._skips.defer(count.step, scale)
        device_update(grads, self._vector_params, scale, self._vector_weights)
        self._installs.columns_stepped(grads.plan)
        try:
            self._after_device_update(grads, norms, scale, warming_up, moved)
        finally:   # (written by an install in this step, or now)
            self._installs.write_stepped_columns()
        self._pipeline.fence()
        count.step += 1
        self._timer.end()

    def _after_device_update(self, grads, norms, scale, warming_up: bool, moved: list) -> None:
        """The rest of a step: the importance the window rule watches, the host's accumulate,
        and the window's end if it ends here (`moved`: what this step's interim move wrote)."""
        count = self.counters
        if not warming_up and self._window.watches_importance and (split := importance_split(
                grads, norms, scale, self._partition)) is not None:
            self._window.observe(*split)
        self._pipeline.accumulate()
        count.window_steps += 1
        if warming_up or self._window_ends():
            if not warming_up:
                log.debug("step %d: end window: %s", count.step, self._window.reason)
            self._settle_skips()
            self._skips.window_ended(dropped=count.window_spoiled)
            if count.window_spoiled:   # a skipped step inside it: its gradients are dropped
                self._pipeline.drop_window()
                count.window_spoiled = False
            # a one-step window's writes through .data were looked for at this step's start
            with self._pipeline.transfers.window_work(ends=True):
                self._end_window(synchronous=warming_up or not self.settings.overlap_step,
                                 looked=not warming_up and count.window_steps == 1, fresh=moved)

    def _settle_skips(self) -> None:
        """Read the kept flags of this window's steps so far (optim/step_scale.py); a skipped
        one spoils the window (saved with the counters: a state saved mid-window drops it at the
        same end), and the device's sums, which may hold its inf/NaN, are cleared."""
        if self._skips.settle():
            self._pipeline.clear_sums()
            self.counters.window_spoiled = True

    def _window_ends(self) -> bool:
        if self._selector.reselection_due_at(self.counters.step + 1):
            # ("step", N) reselects every N steps whatever the windows (as DeepSpeed does); columns
            # move only between windows, so this one ends the window (every rank alike).
            self._window.reason = "a reselection is due at the next step"
            return True
        host_s = step_s = install_s = work_s = 0.0
        if self.settings.worker:   # in process nothing overlaps the step: nothing to pace
            (host_s, install_s, work_s), step_s = self._pipeline.pacing(), self._step_period.seconds
        ends = self._window.should_end(self.counters.window_steps, self._pipeline.ready(),
                                       host_s, step_s, install_s, work_s)
        if self._window.needs_rank_agreement and self._partition.active:
            # Every rank must end the window at the same step, and only once every rank's rule
            # says so (an auto window: once every rank's host is ready, so that none waits):
            # one step after they all said so, so that no step waits for the vote.
            ends = self._agreement.ends(
                ends, forced=self._window.must_end(self.counters.window_steps))
        return ends

    def _decided(self, what: str) -> None:
        self.decisions.append((self.counters.step, what))
        del self.decisions[:-10_000]

    # ------------------------------------------------------------------ windows and selection
    def _end_window(self, synchronous: bool, looked: bool = False, fresh: list = ()) -> None:
        """Install the previous window's host update, hand this window's sums to the host, and
        with `synchronous` install that too. `looked`: writes through .data were looked for
        since the optimizer last wrote the host-owned columns (`fresh`: of those matrices)."""
        if not looked:
            self._outside_writes.adopt_data_writes(fresh)
        installed = self._installs.queue_update(self._step_sizes())
        self._pipeline.end_window([group_hyperparameters(m.group) for m in self._host_params],
                                  delayed=not synchronous,
                                  lookahead=self.settings.install_lookahead)
        if synchronous:
            installed += self._installs.queue_update()
        # An install takes its fingerprint when it is finished: now, or in a forward.
        done = set(installed)
        self._outside_writes.fingerprint([m.host_index for m in self._host_params
                                          if m.host_index not in done])
        self._window.ended(self.counters.window_steps)
        self._agreement.forget()
        self.counters.window_steps = 0
        self.counters.num_windows += 1
        self._decided("flush")

    def _select_columns(self, grads: dict) -> None:
        plan = self._selector.plan(self.counters.step, grads)
        if plan is None:
            return
        if not plan.first:
            self._installs.queue_update()  # state can only move once the host is drained
            self._installs.finish()
        self._selector.select(plan, self.counters.step)
        self._outside_writes.fingerprint()
        self._decided("select" if plan.first else "reselect")
