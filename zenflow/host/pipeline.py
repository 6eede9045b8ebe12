"""The host side of one optimizer step: staging, accumulation, window end, and the update that
an install takes.

    stage(grads, coef)  add this step's gradient rows, times `coef` (a 0-dim device tensor, 0 on a
                        skipped step), into the window's sums on the device
                        (zenflow/host/device_sums.py), for the matrices whose sums fit the
                        device budget; copy the other matrices' rows and `coef` to a staging
                        buffer (on CUDA: queued on a side stream; the Python thread does not wait),
                        unless a backward hook already copied that very gradient there
                        (zenflow/host/early_copies.py)
    accumulate()        tell the host to add that buffer, times its `coef`, to the window's sums
    end_window(...)     copy the device's sums to the host, and tell the host to run AdamW on
                        the window's sums
    take_update()       wait for that update: its new values are in the install buffer
                        (zenflow/optim/installs.py copies them into the parameters)

The deferred-credit rule (zenflow/host/credit.py) says how a window counts: the pipeline calls
it where a step adds to the sums, where a window ends, and where the sums are placed.

The training thread does no host arithmetic: the worker (or, with worker=False, the inline
runner) does the adds and the AdamW. Commands reach it through the worker link
(zenflow/host/worker_link.py), each once the copies it reads have landed (a `Ticket`): the worker
is told to read a staging buffer (zenflow/host/staging.py) only once its bytes have landed, and to
overwrite the install buffer only once the device has read it. One install buffer is enough: it
is copied long before the next update is due. A slow host shows up as stall in stats(), never as
a race.
With overlap, two gradient-sum slots alternate: one window fills one while the host's update of
the previous window reads the other.
"""
from __future__ import annotations

import logging
import operator
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import filterfalse
from typing import NamedTuple

import torch

from zenflow.distributed import Partition, local
from zenflow.host import numa, pipeline_state
from zenflow.host.buffers import HostState
from zenflow.host.commands import Update
from zenflow.host.credit import Credit, on_replicas
from zenflow.host.device_sums import DeviceSums, picker
from zenflow.host.early_copies import EarlyCopies
from zenflow.host.layout import HostJobs, HostLayout
from zenflow.host.placement import SumPlacement
from zenflow.host.staging import Staging, counted_once, first_gradients
from zenflow.host.telemetry import StepTimer
from zenflow.host.transfers import DONE, Ticket, Transfers, all_of
from zenflow.host.weight_views import WeightViews, host_view
from zenflow.host.worker_link import Command, WorkerLink

log = logging.getLogger("zenflow")


class _Split(NamedTuple):
    """A list of staged matrices (HostPipeline.stage's `grads`), split by where they are summed."""
    on_device: list[int]
    pick_on_device: Callable[[Sequence], Sequence]   # their gradients, by position in the list
    on_host: list[int]
    pick_on_host: Callable[[Sequence], Sequence]
    rows_are_whole: bool     # each device-summed gradient is its own rows (Staging.own_rows)
    counted: list[int]       # 1 for each device-summed matrix, by index, else 0


@dataclass
class InFlight:
    """A window's host update, from its hand-off until it is installed."""
    jobs: HostJobs
    command: Command | None = None   # its Update on the worker link (None: done already)

    @property
    def matrices(self) -> list[int]:
        return list(self.jobs.matrices)


class HostPipeline:
    """Host state of a list of parameters (each viewed [rows, cols]) and its data path. Of an
    FSDP2-sharded parameter, the pipeline sees the rank's local shard only (`local`)."""

    def __init__(self, params: list[torch.Tensor], partition: Partition, device: torch.device,
                 overlap: bool, worker_cores: list[int] | None, timer: StepTimer,
                 owner: str, available_bytes: int | None = None,
                 device_sum_budget: int | str = 0, credit: Credit | None = None,
                 lock: threading.RLock | None = None,
                 device_sum_dtype: torch.dtype = torch.float32,
                 moments_dtype: torch.dtype = torch.float32):
        """`credit`: the deferred-credit rule (default "mean"); `lock`: the owner's lock around
        its calls into this pipeline; with it, host-summed gradients may start their copy during
        backward (zenflow/host/early_copies.py)."""
        self.params = params
        self.weight_views = WeightViews(params)   # (what weights() returns)
        self.partition = partition
        self.rows = [partition.rows(host_view(local(p)).shape[0]) for p in params]
        self.timer = timer
        shapes = [(len(range(host_view(local(p)).shape[0])[r]), host_view(local(p)).shape[1],
                   p.dtype) for p, r in zip(params, self.rows)]
        self.transfers = Transfers(device, copy_cores=worker_cores)
        # DDP: "factored" fits each rank's row block and gathers every rank's factors
        self.credit = on_replicas(credit if credit is not None else Credit(), partition,
                                  [host_view(local(p)).shape[0] for p in params])
        # A rule's rates go to the device through the host's rate buffers, and its squares
        # through the sum slot the window does not fill (zenflow/host/layout.py).
        rates = self.credit.host_rates
        self.layout = HostLayout.build(shapes, sum_slots=2 if overlap or rates else 1,
                                       staging_slots=2 if self.transfers.copies_outlive_step else 1,
                                       rates=rates, factors=self.credit.host_factors,
                                       moments_dtype=moments_dtype)
        # The worker's memory: on its cores' NUMA node(s) (zenflow/host/numa.py).
        self.host = HostState.allocate(self.layout, owner, available_bytes, numa.nodes_for(
            worker_cores or sorted(os.sched_getaffinity(0))))
        self._load_masters(range(len(params)))
        self.transfers.pin([self.host.arena.views[n] for n in self.layout.install_regions()])
        self.worker_cores = worker_cores   # None: the host work runs in process
        self.link = WorkerLink(self.host, worker_cores, timer)
        self.staging = Staging(self.host, self.transfers, self.link, partition, self.rows)

        self.device = device
        self.placement = SumPlacement(device_sum_budget)
        self.device_sums = DeviceSums(self.transfers, device_sum_dtype)
        self.host_step = [0] * len(params)   # host AdamW updates of each parameter so far
        self.num_grads = [0] * len(params)   # gradients summed in the current window
        self._splits: dict[tuple, _Split] = {}   # see _split
        self._start_over()
        self.early_copies = EarlyCopies(self.staging, params, lock, owner)

    def _start_over(self) -> None:
        """No buffer being read, no update in flight; every slot at 0."""
        self._sum_slot = 0
        self.staging.start_over()
        self._install_reader: Ticket = DONE   # the copies reading the install buffer
        self.in_flight: InFlight | None = None

    # -- the worker ---------------------------------------------------------------------------
    @property
    def runner(self):
        return self.link.runner

    def drain(self) -> None:
        """Wait until the host has done everything sent to it (before reading host state)."""
        self.link.drain()

    def check(self) -> None:
        """Raise if the worker died mid-work (replace it if it died idle); send whatever
        became ready since the last step."""
        self.link.check()

    # -- one step -------------------------------------------------------------------------------
    def place(self) -> None:
        """Place the window sums and the credit rule's device state, once, at the first step
        (its backward has run: "auto" measures the room left), before anything installs: a
        reselection at the first step after a load installs the update in flight, with the
        rates of the matrices the rule moves. Every rank calls it at the same points (a
        rule's collective may run here: Credit.gather_loaded)."""
        if not self.placement.placed:
            self.placement.place(self)
        self.credit.gather_loaded()

    def stage(self, grads: dict[int, torch.Tensor], coef: torch.Tensor,
              sizes: dict[int, tuple[float, float]] | None = None) -> None:
        """This step's gradient rows of parameters `grads` (index -> gradient), times `coef` (the
        step's 0-dim fp32 factor on the device, 0 on a skipped step, never read here): added into
        the device sums of the matrices summed there (and the credit rule's own, with its interim
        step at `sizes`: index -> (learning rate, AdamW's step bound)), and for the others copied,
        with `coef`, to a staging buffer that accumulate() hands to the host. Every gradient
        counts in num_grads; drop_window() drops a window with a skipped step."""
        start = time.perf_counter()
        self.place()
        split = self._split(grads)
        if split.on_device:
            values = list(grads.values())
            on_device = dict(zip(split.on_device, split.pick_on_device(values)))
            if not split.rows_are_whole:
                on_device = {i: self.staging.own_rows(i, g) for i, g in on_device.items()}
            fresh = first_gradients(split.on_device, self.num_grads)
            # every row the device holds moves (DDP: every rank's, alike on every replica)
            whole = ({i: host_view(grads[i]) for i in on_device} if self.partition.splits_rows
                     else on_device)
            self.device_sums.fence()
            # the rule's matrices whose sum, statistics and interim step one kernel each took
            fused = self.credit.fused_step(on_device, whole, self.device_sums.sums,
                                           self.weight_views.all(), fresh, coef, sizes)
            self.num_grads[:] = map(operator.add, self.num_grads, split.counted)
            if fused:   # (C-level passes: filterfalse, pickers)
                rest = list(filterfalse(fused.__contains__, on_device))
                on_device = dict(zip(rest, picker(rest)(on_device)))
                whole = dict(zip(rest, picker(rest)(whole)))
                fresh = list(filterfalse(fused.__contains__, fresh))
            self.device_sums.add(on_device, fresh, coef)
            self.credit.add(on_device, fresh, coef)
            if moving := self.credit.moving_among(on_device):
                self.credit.interim(dict(zip(moving, picker(moving)(self.weight_views.all()))),
                                    whole, coef, sizes)
            grads = dict(zip(split.on_host, split.pick_on_host(values)))
        # Copies the backward's hooks made; the fence covers the ones no longer wanted too.
        early, early_ticket, early_bytes = self.early_copies.take(grads, self.staging.slot)
        nbytes, waited = self.staging.put(grads, coef, early, early_ticket)
        self.timer.stall(waited)
        self.timer.moved(d2h=early_bytes + nbytes)
        self.timer.offload(time.perf_counter() - start - waited)

    def _split(self, grads: dict[int, torch.Tensor]) -> _Split:
        """Which of `grads`' matrices are summed on the device, worked out once per list of
        matrices and placement (the same come step after step: no Python per matrix then)."""
        key = (tuple(grads), self.device_sums.version)
        split = self._splits.get(key)
        if split is None:
            if len(self._splits) >= 8:
                self._splits.clear()
            at = [(j, i) for j, i in enumerate(grads) if i in self.device_sums]
            rest = [(j, i) for j, i in enumerate(grads) if i not in self.device_sums]
            on_device = [i for _, i in at]
            split = self._splits[key] = _Split(
                on_device, picker([j for j, _ in at]), [i for _, i in rest],
                picker([j for j, _ in rest]),
                all(self.staging.own_rows(i, grads[i]) is grads[i] for i in on_device),
                counted_once(on_device, len(self.params)))
        return split

    def accumulate(self) -> None:
        """Have the host add the staged gradients, times their coef, to this window's sums."""
        self.staging.accumulate(self.num_grads, self._sum_slot)

    def drop_window(self) -> None:
        """The window about to end had a skipped step (docs/semantics.md, "Skipped steps"): its
        gradients count for nothing, neither in its host update (there is none) nor in an
        install's correction; the next window's first gradient overwrites its sums."""
        self.num_grads = [0] * len(self.params)

    def clear_sums(self) -> None:
        """Zero the device's sums (a skipped step's inf or NaN may be in them)."""
        self.device_sums.clear()
        self.credit.clear()

    def end_window(self, adamw: list[tuple[float, float, float, float, float]], delayed: bool,
                   lookahead: float) -> bool:
        """Hand the window's sums to the host: each parameter that got a gradient takes the host
        AdamW its credit rule makes of `adamw[i]` = its group's (lr, beta1, beta2, eps,
        weight_decay); `delayed`: installed one window later, leading by `lookahead` of a step.
        Returns whether any parameter did. The caller installs the previous window's update
        first (take_update()), per the overlap rule."""
        assert self.in_flight is None, "take_update() the previous window first"
        self.placement.watch(self)
        self.early_copies.window_ended()
        jobs = HostJobs()
        for i, n in enumerate(self.num_grads):
            if n:
                self.host_step[i] += self.credit.host_steps(i, n)
                # A narrow (bf16) device sum lands in the first half of its fp32 sum's bytes,
                # and the update widens it there first.
                widen = i in self.device_sums and self.device_sums.sums[i].dtype != torch.float32
                jobs.append(i, self.host_step[i], n,
                            self.credit.host_update(i, adamw[i], n, delayed, lookahead), widen)
                self.num_grads[i] = 0
        if not jobs:
            return False
        flight = InFlight(jobs)
        on_device = [i for i in jobs.matrices if i in self.device_sums]
        slot = f"grad_sum{self._sum_slot}"
        also = self.credit.copy_out([i for i, u in zip(jobs.matrices, jobs.updates) if u.moments],
                                    self.host, self._sum_slot)
        sums, nbytes = self.device_sums.copy_out(
            on_device,
            lambda i: self.host.landing(slot, i, self.device_sums.sums[i].dtype),
            lambda first, last: self.host.span(slot, [first, last])[0], also)
        self.timer.moved(d2h=nbytes)
        # The update reads the sums once they have landed, and overwrites the install buffer
        # once the last install copy has read it.
        flight.command = self.link.submit(all_of(self._install_reader, sums),
                                          Update(self._sum_slot, jobs))
        self.in_flight = flight
        self._sum_slot = (self._sum_slot + 1) % self.layout.sum_slots
        return True

    def adopt(self, indices: list[int]) -> None:
        """Take the parameters' current values as the host master values of `indices` (weights
        changed outside the optimizer); an in-flight update of theirs is no longer installed."""
        self.drain()
        self._load_masters(indices)
        if self.in_flight is not None:
            dropped = set(indices)
            self.in_flight.jobs = self.in_flight.jobs.without(dropped)

    def _load_masters(self, indices) -> None:
        """The host master values of `indices` := the parameters' current values (own rows)."""
        for i in indices:
            self.host.fp32("master", i).copy_(host_view(local(self.params[i]).detach())[self.rows[i]])

    def pacing(self) -> tuple[float, float, float]:
        """What paces an auto window, measured (seconds): the host's last update, the device's
        wait for the last install and its own work in the last window (host/transfers.py)."""
        t = self.transfers
        return self.runner.last_update_seconds, t.last_install_wait_seconds, t.last_window_work_seconds

    def ready(self) -> bool:
        """Whether no host update is in flight (never blocks)."""
        if self.in_flight is None or self.in_flight.command is None:
            return True
        self.link.send_landed()
        return self.link.done(self.in_flight.command)

    def take_update(self) -> InFlight | None:
        """Wait for the update in flight (if any): once this returns, its new values (and a
        credit rule's rates) are in the install buffer. zenflow/optim/installs.py copies them
        into the parameters and tells read_by() which copies read the buffer."""
        if self.in_flight is None:
            return None
        flight, self.in_flight = self.in_flight, None
        # Send the update if it is still queued, but not the commands after it: this step's
        # accumulate may still be waiting for its copy, which an install does not need.
        if flight.command is not None:
            self.timer.stall(self.link.wait(flight.command))
        return flight

    def take_masters(self, indices: list[int]) -> None:
        """The install buffer := the host values of `indices` themselves (updates installed with
        a lookahead lead them), once the host has finished everything sent to it and the last
        install's copies have read the buffer."""
        assert self.in_flight is None, "take_update() the update in flight first"
        self.drain()
        self.timer.stall(self._install_reader.wait())
        self.host.copy_masters(indices)

    def read_by(self, ticket: Ticket) -> None:
        """The install buffer is read by these copies: no update overwrites it before they land."""
        self._install_reader = ticket

    def weights(self, i: int) -> torch.Tensor:
        """The [rows, cols] view of parameter i that the device's steps write: every row the
        device holds (a DDP replica's every rank's, an FSDP2 shard's own)."""
        return self.weight_views[i]

    def fence(self) -> None:
        """End of step(): later device work may not overwrite this step's gradient sources. (On
        the CPU this waits for the copy thread: the part of the copy the step did not hide.)"""
        start = time.perf_counter()
        self.transfers.fence(self.staging.last_copy)
        self.staging.last_copy = DONE
        self.link.send_landed()   # what has landed: the worker may start adding it now
        self.timer.offload(time.perf_counter() - start)

    # -- checkpoints: zenflow/host/pipeline_state.py -------------------------------------------
    def state_dict(self) -> dict:
        return pipeline_state.save(self)

    def check_state_dict(self, state: dict, window_steps: int | None = None) -> None:
        pipeline_state.check(self, state, window_steps)

    def load_state_dict(self, state: dict) -> None:
        jobs = pipeline_state.load(self, state)
        if jobs is not None:
            self.in_flight = InFlight(jobs)

    # -- lifecycle --------------------------------------------------------------------------------
    def use_transfers(self, transfers: Transfers) -> None:
        """Copy through `transfers` from now on (the selftest and the tests swap in a path that
        lands copies late, or too early)."""
        self.transfers = self.device_sums.transfers = self.staging.transfers = transfers

    def pinned_bytes(self) -> int:
        return self.transfers.pinned_bytes

    def close(self) -> None:
        self.early_copies.close()
        self.link.close()
        self.transfers.close()
        self.host.arena.close_fd()
