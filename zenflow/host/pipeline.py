"""The host side of one optimizer step: staging, accumulation, window end, install.

    stage(grads, coef)  add this step's gradient rows, times `coef` (a 0-dim device tensor, 0 on a
                        skipped step), into the window's sums on the device
                        (zenflow/host/device_sums.py), for the matrices whose sums fit the
                        device budget; copy the other matrices' rows and `coef` to a staging
                        buffer (on CUDA: queued on a side stream; the Python thread does not wait),
                        unless a backward hook already copied that very gradient there
                        (zenflow/host/early_copies.py)
    accumulate()        tell the host to add that buffer, times its `coef`, to the window's sums
    end_window(jobs)    copy the device's sums to the host, and tell the host to run AdamW on
                        the window's mean gradient
    install()           wait for that update and queue the copy of the new values to the
                        parameters, one copy per matrix
    finish(installs)    before a matrix is read: order the device after its copy (and correct
                        a "moments" matrix's values); zenflow/optim/installs.py decides when

With deferred_credit="moments" (`moments`), the matrices summed on the device also sum their
squares there, stage() moves their deferred columns a step at the host's rates, and an install
corrects the host's values for the window's gradients the host has not applied
(zenflow/host/device_sums.py). The others take the "mean" credit.

The training thread does no host arithmetic: the worker (or, with worker=False, the inline
runner) does the adds and the AdamW. Commands reach it through the worker link
(zenflow/host/worker_link.py), each once the copies it reads have landed (a `Ticket`): the worker
is told to read a staging buffer only once its bytes have landed, and to overwrite the install
buffer only once the device has read it. Where copies land within the step (the CPU), one staging
buffer is enough: the worker adds a step's gradients during the next forward and backward. Where
they land later (CUDA: the step returns with the copy in flight, and the link's dispatch thread
sends the accumulate once it has landed), two staging buffers alternate, so the worker has a
whole step to add one before it is reused. One install buffer is enough: it is copied long before
the next update is due. A slow host shows up as stall in stats(), never as a race.
With overlap, two gradient-sum slots alternate: one window fills one while the host's update of
the previous window reads the other.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass

import torch

from zenflow.distributed import Partition, local
from zenflow.host import numa
from zenflow.host.buffers import (
    FP32_KINDS,
    HostJob,
    HostLayout,
    HostState,
    landing_of,
    rate_dtype,
)
from zenflow.host.commands import Accumulate, Update
from zenflow.host.device_sums import DeviceSums, choose_placement, takes_moments
from zenflow.host.early_copies import EarlyCopies
from zenflow.host.telemetry import StepTimer
from zenflow.host.transfers import DONE, Ticket, Transfers, all_of
from zenflow.host.worker_link import Command, WorkerLink
from zenflow.saved_state import check_count, check_saved_tensors

log = logging.getLogger("zenflow")


@dataclass
class InFlight:
    """A window's host update, from its hand-off until it is installed."""
    jobs: list[HostJob]
    command: Command | None = None   # its Update on the worker link (None: done already)

    @property
    def matrices(self) -> list[int]:
        return [job.matrix for job in self.jobs]


@dataclass
class QueuedInstall:
    """One matrix's install, queued: its copy to the device may still be landing. finish() it
    before anything reads the matrix."""
    matrix: int
    ticket: Ticket    # the copy of its values (and of its rates, under "moments")
    # "moments" at a window end: (learning rate, AdamW's step bound) and the number of gradients
    # summed since the update was handed off, for the correction; None: no correction.
    step: tuple[float, float] | None = None
    count: int = 0


def host_view(t: torch.Tensor) -> torch.Tensor:
    """The [rows, cols] view the host keeps of a parameter or gradient (vectors: one row). A
    shard may hold no rows (FSDP2, fewer rows than ranks): its view is [0, cols]."""
    if t.ndim >= 2:
        return t.reshape(t.shape[0], math.prod(t.shape[1:]))
    return t.reshape(1, t.numel())


class HostPipeline:
    """Host state of a list of parameters (each viewed [rows, cols]) and its data path. Of an
    FSDP2-sharded parameter, the pipeline sees the rank's local shard only (`local`)."""

    def __init__(self, params: list[torch.Tensor], partition: Partition, device: torch.device,
                 overlap: bool, worker_cores: list[int] | None, timer: StepTimer,
                 owner: str, available_bytes: int | None = None,
                 device_sum_budget: int | str = 0, moments: bool = False,
                 lock: threading.RLock | None = None,
                 device_sum_dtype: torch.dtype = torch.float32):
        """`lock`: the owner's lock around its calls into this pipeline; with it, host-summed
        gradients may start their copy during backward (zenflow/host/early_copies.py)."""
        self.params = params
        self.partition = partition
        self.rows = [partition.rows(host_view(local(p)).shape[0]) for p in params]
        self.timer = timer
        shapes = [(len(range(host_view(local(p)).shape[0])[r]), host_view(local(p)).shape[1],
                   p.dtype) for p, r in zip(params, self.rows)]
        self.transfers = Transfers(device, copy_cores=worker_cores)
        # Where no matrix can take "moments", the host holds no rates for them either.
        self.moments = takes_moments("moments" if moments else "mean", device_sum_budget,
                                     self.transfers.cuda, partition.splits_rows)
        self.layout = HostLayout.build(shapes, sum_slots=2 if overlap or self.moments else 1,
                                       staging_slots=2 if self.transfers.copies_outlive_step else 1,
                                       rates=self.moments)
        # The worker's memory: on its cores' NUMA node(s) (zenflow/host/numa.py).
        self.host = HostState.allocate(self.layout, owner, available_bytes, numa.nodes_for(
            worker_cores or sorted(os.sched_getaffinity(0))))
        self._load_masters(range(len(params)))
        self.transfers.pin([self.host.arena.views[n] for n in self.layout.install_regions()])
        self.worker_cores = worker_cores   # None: the host work runs in process
        self.link = WorkerLink(self.host, worker_cores, timer)

        self.device = device
        self.device_sum_budget = device_sum_budget
        self.device_sums = DeviceSums(self.transfers, device_sum_dtype)
        self._sums_placed = False   # decided at the first step (the budget may need its peak)
        self._memory_warned = False
        self._restored: dict = {}   # squares and rates loaded before that: index -> (sq, rate)
        self.host_step = [0] * len(params)   # host AdamW updates of each parameter so far
        self.num_grads = [0] * len(params)   # gradients summed in the current window
        self._start_over()
        self.early_copies = EarlyCopies(self, params, lock)

    def _start_over(self) -> None:
        """No buffer being read, no update in flight; every slot at 0."""
        self._sum_slot = self._staging_slot = 0
        # the accumulate reading each staging buffer; the copy reading the install buffer
        self._staging_reader: list[Command | None] = [None] * self.layout.staging_slots
        self._install_reader: Ticket = DONE
        self._staged: tuple[int, list[int], Ticket, float] | None = None
        self._last_copy: Ticket = DONE
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
    def _place_sums(self) -> None:
        """Decide which matrices sum on the device (the budget's "auto" reads the device's peak
        memory so far, so this runs at the first step, after the first backward)."""
        budget = self.device_sum_budget
        if budget == "auto":
            budget = self.transfers.spare_device_bytes()
        matrices = self.layout.matrices
        moments_bytes = 0   # "moments": the squares and the widest rates, per element
        if self.moments and matrices:
            moments_bytes = 4 + max(rate_dtype(m.dtype).itemsize for m in matrices)
        chosen, moving = choose_placement([m.numel for m in matrices], int(budget), moments_bytes,
                                          self.device_sums.dtype.itemsize)
        self.device_sums.allocate({i: (matrices[i].rows, matrices[i].cols,
                                       rate_dtype(matrices[i].dtype) if i in moving else None)
                                   for i in chosen}, self.device)
        for i in chosen:   # a window restored before the first step summed on the host so far
            if self.num_grads[i]:
                self.device_sums.sums[i].copy_(self.host.fp32(f"grad_sum{self._sum_slot}", i))
            if self.moves(i) and i in self._restored:
                squares, rate = self._restored[i]
                self.device_sums.squares[i].copy_(squares)
                self.device_sums.rates[i].copy_(rate)
        self._restored = {}
        self.early_copies.stop_watching(chosen)
        self._lock_copied_spans(chosen)
        self._sums_placed = True
        log.info("window sums of %d of %d matrices on the device (%.2f GiB of a budget of "
                 "%.2f GiB); the rest on the host%s", len(chosen), len(self.layout.matrices),
                 self.device_sums.nbytes() / 2**30, int(budget) / 2**30,
                 "; deferred_credit 'moments' on those, 'mean' on the rest" if self.moments
                 else "")

    def _lock_copied_spans(self, on_device: list[int]) -> None:
        """Page-lock what the copies of this placement touch, and nothing else: the staging
        buffers over the matrices summed on the host (their gradients cross every step), and
        the sum buffers over those summed on the device (their sums, and under "moments" their
        squares, cross at window ends). Every sum on the device: no staging buffer is locked."""
        placed = set(on_device)
        on_host = [i for i in range(len(self.params)) if i not in placed]
        spans = [view for s in range(self.layout.staging_slots)
                 for view in self.host.span(f"staging{s}", on_host)]
        spans += [view for s in range(self.layout.sum_slots)
                  for view in self.host.span(f"grad_sum{s}", on_device)]
        self.transfers.pin(spans)

    def moves(self, i: int) -> bool:
        """Whether matrix i takes deferred_credit "moments" (its sums are on the device)."""
        return i in self.device_sums.rates

    def stage(self, grads: dict[int, torch.Tensor], coef: torch.Tensor,
              lrs: dict[int, tuple[float, float]] | None = None) -> None:
        """This step's gradient rows of parameters `grads` (index -> gradient), times `coef` (the
        step's 0-dim fp32 factor on the device, 0 on a skipped step, never read here): added into
        the device sums of the matrices summed there, and for the others copied, with `coef`, to
        a staging buffer that accumulate() hands to the host. With `lrs` (index -> (learning
        rate, AdamW's step bound)), the "moments" matrices also take their interim step. Every
        gradient counts in num_grads; drop_window() drops a window with a skipped step."""
        start = time.perf_counter()
        if not self._sums_placed:
            self._place_sums()
        on_device = {i: host_view(g)[self.rows[i]] for i, g in grads.items()
                     if i in self.device_sums}
        if on_device:
            self.device_sums.add(on_device, [i for i in on_device if self.num_grads[i] == 0],
                                 coef)
            if lrs is not None and self.device_sums.rates:
                self.device_sums.move({i: self._weights(i) for i in on_device if self.moves(i)},
                                      on_device, coef, lrs)
            for i in on_device:
                self.num_grads[i] += 1
            grads = {i: g for i, g in grads.items() if i not in self.device_sums}
        slot = self._staging_slot
        # Copies the backward's hooks made; the fence covers the ones no longer wanted too.
        early, self._last_copy, early_bytes = self.early_copies.take(grads, slot)
        self.timer.moved(d2h=early_bytes)
        if not grads:
            self.timer.offload(time.perf_counter() - start)
            return
        waited = 0.0
        reader = self._staging_reader[slot]
        if reader is not None:   # the previous accumulate of this slot, sent or still queued
            waited = self.link.wait(reader)
            self.timer.stall(waited)
            self._staging_reader[slot] = None
        ticket, nbytes = self.copy_to_staging(
            slot, {i: g for i, g in grads.items() if i not in early}, coef)
        ticket = all_of(self._last_copy, ticket)
        self._staged = (slot, list(grads), ticket)
        self._last_copy = ticket
        self.timer.moved(d2h=nbytes)
        self.timer.offload(time.perf_counter() - start - waited)

    def copy_to_staging(self, slot: int, grads: dict[int, torch.Tensor],
                        coef: torch.Tensor | None = None) -> tuple[Ticket, int]:
        """Queue the copy of the rows of `grads` (index -> gradient) into staging buffer `slot`,
        and of the step's factor `coef` into the slot's step_coef (stage() does; a backward hook
        copies gradients only); returns its ticket and the bytes it moves."""
        pairs = [] if coef is None else [(self.host.step_coef(slot), coef.reshape(()))]
        nbytes = 0
        for i, grad in grads.items():
            src = host_view(grad)[self.rows[i]]
            pairs.append((self.host.staging(slot, i), src))
            nbytes += src.numel() * src.element_size()
        return (self.transfers.to_host(pairs) if pairs else DONE), nbytes

    def free_staging_slot(self) -> int | None:
        """The staging slot the next stage() writes, or None while a host command reads it (or
        is queued to). Never blocks: a backward hook asks (zenflow/host/early_copies.py)."""
        slot = self._staging_slot
        reader = self._staging_reader[slot]
        if reader is None:
            return slot
        try:
            return slot if self.link.done(reader) else None
        except RuntimeError:   # the next step() reports it (check()); a hook only skips its copy
            return None

    def accumulate(self) -> None:
        """Have the host add the staged gradients, times their coef, to this window's sums."""
        if self._staged is None:
            return
        slot, matrices, ticket = self._staged
        self._staged = None
        if not matrices:
            return
        fresh = [i for i in matrices if self.num_grads[i] == 0]
        added = [i for i in matrices if self.num_grads[i] > 0]
        for i in matrices:
            self.num_grads[i] += 1
        self._staging_reader[slot] = self.link.submit(
            ticket, Accumulate(slot, self._sum_slot, tuple(added), tuple(fresh)))
        self._staging_slot = (slot + 1) % self.layout.staging_slots

    def drop_window(self) -> None:
        """The window about to end had a skipped step (docs/semantics.md, "Skipped steps"): its
        gradients count for nothing, neither in its host update (there is none) nor in an
        install's "moments" correction; the next window's first gradient overwrites its sums."""
        self.num_grads = [0] * len(self.params)

    def _watch_device_memory(self) -> None:
        """With device_sum_budget="auto" the sums were placed for the first step's activations
        (with room for them to double); a longer batch since may have taken that room. Say so
        once, at a window end, while there is still a margin: 5% of the device."""
        if self.device_sum_budget != "auto" or self._memory_warned or not self.device_sums.sums:
            return
        peak, total = self.transfers.device_memory()
        if peak > 0.95 * total:
            self._memory_warned = True
            log.warning("the device's peak memory has reached %.1f of %.1f GiB since the window "
                        "sums were placed (device_sum_budget='auto': %.2f GiB of sums, placed for "
                        "the first step's activations); a longer batch could now run out of "
                        "device memory. Set device_sum_budget to fewer bytes (0: every sum on "
                        "the host) or shorten the longest batch.", peak / 2**30, total / 2**30,
                        self.device_sums.nbytes() / 2**30)

    def end_window(self, hyperparameters: list[tuple]) -> bool:
        """Hand the window's sums to the host: AdamW on the mean gradient with
        `hyperparameters[i]` = (lr, beta1, beta2, eps, weight_decay, lookahead) for every
        parameter that got a gradient. Returns whether any did. The caller installs the previous
        window's update first (install()), per the overlap rule."""
        assert self.in_flight is None, "install() the previous window first"
        self._watch_device_memory()
        jobs = []
        for i, n in enumerate(self.num_grads):
            if n:
                moments = self.moves(i)
                self.host_step[i] += n if moments else 1   # "moments" counts gradients
                # A narrow (bf16) device sum lands in the first half of its fp32 sum's bytes,
                # and the update widens it there first.
                widen = i in self.device_sums and self.device_sums.sums[i].dtype != torch.float32
                jobs.append(HostJob(i, self.host_step[i], n, *hyperparameters[i], moments, widen))
                self.num_grads[i] = 0
        if not jobs:
            return False
        flight = InFlight(jobs)
        on_device = [j.matrix for j in jobs if j.matrix in self.device_sums]
        squared = [j.matrix for j in jobs if j.moments]
        landing = {i: landing_of(self.host.fp32(f"grad_sum{self._sum_slot}", i),
                                 self.device_sums.sums[i].dtype) for i in on_device}
        sums = self.device_sums.copy_out(
            landing, {i: self.host.square_sum(self._sum_slot, i) for i in squared})
        self.timer.moved(d2h=sum(t.numel() * t.element_size() for t in landing.values())
                         + 4 * sum(self.layout.matrices[i].numel for i in squared))
        # The update reads the sums once they have landed, and overwrites the install buffer
        # once the last install copy has read it.
        flight.command = self.link.submit(all_of(self._install_reader, sums),
                                          Update(self._sum_slot, tuple(jobs)))
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
            self.in_flight.jobs = [j for j in self.in_flight.jobs if j.matrix not in dropped]

    def _load_masters(self, indices) -> None:
        """The host master values of `indices` := the parameters' current values (own rows)."""
        for i in indices:
            self.host.fp32("master", i).copy_(host_view(local(self.params[i]).detach())[self.rows[i]])

    def ready(self) -> bool:
        """Whether no host update is in flight (never blocks)."""
        if self.in_flight is None or self.in_flight.command is None:
            return True
        self.link.send_landed()
        return self.link.done(self.in_flight.command)

    def install(self, lrs: dict[int, tuple[float, float]] | None = None) -> list[QueuedInstall]:
        """Wait for the in-flight update and queue the copy of its new values into the
        parameters; returns one QueuedInstall per matrix (finish() each before it is read; the
        caller then writes its own newer columns over it). With `lrs` (index -> (learning rate,
        AdamW's step bound); at a window end), finishing corrects the "moments" matrices' values
        for the window's gradients summed since the update was handed off."""
        if self.in_flight is None:
            return []
        flight, self.in_flight = self.in_flight, None
        # Send the update if it is still queued, but not the commands after it: this step's
        # accumulate may still be waiting for its copy, which install does not need.
        if flight.command is not None:
            self.timer.stall(self.link.wait(flight.command))
        moving = {j.matrix for j in flight.jobs if j.moments and self.moves(j.matrix)}
        self.transfers.new_install()
        installs = [QueuedInstall(i, ticket) for i, ticket in
                    copy_rows_to_params(self, flight.matrices, with_rates=moving).items()]
        if lrs is not None:
            for q in installs:
                if q.matrix in moving and self.num_grads[q.matrix]:
                    q.step, q.count = lrs[q.matrix], self.num_grads[q.matrix]
        self._install_reader = all_of(*(q.ticket for q in installs))
        return installs

    def finish(self, installs: list[QueuedInstall]) -> None:
        """Order the device after the copies of `installs` (on a CPU the training thread waits
        for them), then correct the installed values of the "moments" matrices."""
        self.transfers.order_after([q.ticket for q in installs])
        corrected = [q for q in installs if q.step is not None]
        if corrected:
            self.device_sums.correct({q.matrix: self._weights(q.matrix) for q in corrected},
                                     {q.matrix: q.step for q in corrected},
                                     {q.matrix: q.count for q in corrected})

    def _weights(self, i: int) -> torch.Tensor:
        """The [rows, cols] view of parameter i that the device's steps write (this rank's: the
        "moments" matrices are never split by rows across replicas)."""
        return host_view(local(self.params[i]).data)

    def install_masters(self, indices: list[int]) -> list[QueuedInstall]:
        """Queue the install of the host values of `indices` themselves (updates installed with a
        lookahead lead them), once the host has finished everything sent to it and the last
        install has been finished."""
        assert self.in_flight is None, "install() the update in flight first"
        self.drain()
        self.timer.stall(self._install_reader.wait())  # its last copy to the device landed
        self.host.copy_masters(indices)
        self.transfers.new_install()
        installs = [QueuedInstall(i, ticket)
                    for i, ticket in copy_rows_to_params(self, indices).items()]
        self._install_reader = all_of(*(q.ticket for q in installs))
        return installs

    def fence(self) -> None:
        """End of step(): later device work may not overwrite this step's gradient sources. (On
        the CPU this waits for the copy thread: the part of the copy the step did not hide.)"""
        start = time.perf_counter()
        self.transfers.fence(self._last_copy)
        self._last_copy = DONE
        self.link.send_landed()   # what has landed: the worker may start adding it now
        self.timer.offload(time.perf_counter() - start)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Host values, moments and the filling sums, per parameter; counters; the in-flight set.
        Drains first, so the snapshot is consistent (the in-flight update is done, not installed).
        A "moments" matrix also has its squares and the device's rates (zeros for the others)."""
        self.drain()
        per_param = []
        for i in range(len(self.params)):
            grad_sum = (self.device_sums.sums[i].to("cpu", torch.float32, copy=True)
                        if i in self.device_sums
                        else self.host.fp32(f"grad_sum{self._sum_slot}", i))
            squares = rate = torch.zeros_like(grad_sum)
            if self.moves(i):
                squares = self.device_sums.squares[i].to("cpu", copy=True)
                rate = self.device_sums.rates[i].to("cpu", torch.float32, copy=True)
            elif i in self._restored:   # loaded, and no step has placed them yet
                squares, rate = (t.to(torch.float32, copy=True) for t in self._restored[i])
            per_param.append({
                **{kind: self.host.fp32(kind, i).clone() for kind in FP32_KINDS},
                # A sum no gradient reached yet holds stale bytes (the next one overwrites them).
                "grad_sum": grad_sum.clone() if self.num_grads[i] else torch.zeros_like(grad_sum),
                "grad_sq_sum": squares if self.num_grads[i] else torch.zeros_like(grad_sum),
                "rate": rate,
                "host_step": self.host_step[i], "num_grads": self.num_grads[i]})
        in_flight = jobs = None
        if self.in_flight is not None:
            in_flight = self.in_flight.matrices
            jobs = [list(job)[:10] for job in self.in_flight.jobs]   # done: nothing to widen
        return {"params": per_param, "in_flight": in_flight, "in_flight_jobs": jobs}

    def check_state_dict(self, state: dict, window_steps: int | None = None) -> None:
        """Raise ValueError unless `state`, as state_dict() returns it, fits these parameters:
        finite fp32 state of each one's shape (a non-negative exp_avg_sq), a gradient sum,
        integer counts, no more gradients summed than the window has steps (`window_steps`),
        and an in-flight update naming distinct parameters with well-formed jobs."""
        saved_params = state.get("params")
        if not isinstance(saved_params, list) or len(saved_params) != len(self.params):
            raise ValueError(f"saved host state covers {_length(saved_params)} parameter(s), "
                             f"this optimizer has {len(self.params)}")
        for i, (saved, param) in enumerate(zip(saved_params, self.params)):
            what = f"host state of the parameter of shape {tuple(param.shape)}"
            buffers = {kind: self.host.fp32(kind, i) for kind in FP32_KINDS}
            check_saved_tensors(saved, {**buffers, "grad_sum": buffers["master"],
                                        "grad_sq_sum": buffers["master"],
                                        "rate": buffers["master"]}, what)
            check_count(saved.get("host_step"), "host_step", what)
            check_count(saved.get("num_grads"), "num_grads", what)
            if window_steps is not None and saved["num_grads"] > window_steps:
                raise ValueError(f"{what}: saved num_grads {saved['num_grads']} exceeds the "
                                 f"saved window_steps {window_steps}")
        in_flight = state.get("in_flight")
        if in_flight is not None and not (
                isinstance(in_flight, list)
                and all(isinstance(i, int) and not isinstance(i, bool) for i in in_flight)
                and in_flight == sorted(set(in_flight))
                and all(0 <= i < len(self.params) for i in in_flight)):
            raise ValueError(f"saved in_flight must be None or distinct ascending parameter "
                             f"numbers in 0..{len(self.params) - 1}, got {in_flight!r}")
        check_in_flight_jobs(state.get("in_flight_jobs"), in_flight or [])

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned (check_state_dict() it first). After a worker died
        mid-work this is the roll-back: every host buffer is overwritten and a new worker
        starts."""
        if self.link.torn:
            self.link.restart()
        self.drain()
        # No copy may still read the buffers rewritten below: the last install (the install
        # buffer) and the last copy of the device sums.
        self.timer.stall(self._install_reader.wait() + self.device_sums.wait_copied())
        self._start_over()
        for i, s in enumerate(state["params"]):
            for kind in FP32_KINDS:
                self.host.fp32(kind, i).copy_(s[kind])
            if i in self.device_sums:
                self.device_sums.sums[i].copy_(s["grad_sum"])
            else:
                self.host.fp32("grad_sum0", i).copy_(s["grad_sum"])
            if self.moves(i):
                self.device_sums.squares[i].copy_(s["grad_sq_sum"])
                self.device_sums.rates[i].copy_(s["rate"])
            elif self.moments and not self._sums_placed:   # placed at the first step
                self._restored[i] = (s["grad_sq_sum"].clone(), s["rate"].clone())
            self.host_step[i], self.num_grads[i] = s["host_step"], s["num_grads"]
        if state["in_flight"] is not None:
            # The update is done; its install buffer is rebuilt from the values it produced.
            # A "moments" job's rates go to the device only where this optimizer moves that
            # matrix (a state saved under other settings installs the values alone).
            jobs = [HostJob(*job)._replace(moments=len(job) == 10 and job[9] and self.moments)
                    for job in state.get("in_flight_jobs") or []] or [
                HostJob(i, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0) for i in state["in_flight"]]
            self.host.publish(jobs)
            self.in_flight = InFlight(jobs)

    # -- lifecycle --------------------------------------------------------------------------------
    def pinned_bytes(self) -> int:
        return self.transfers.pinned_bytes

    def close(self) -> None:
        self.early_copies.close()
        self.link.close()
        self.transfers.close()
        self.host.arena.close_fd()


# Installs are queued in batches of consecutive matrices of at least this many bytes: a large
# matrix is its own batch (its layer waits for it alone), while thousands of small ones (MoE
# experts) do not cost a queued copy and an event each.
INSTALL_BATCH_BYTES = 8 << 20


def copy_rows_to_params(pipe: HostPipeline, indices: list[int],
                        with_rates: set[int] = frozenset()) -> dict[int, Ticket]:
    """Queue the install buffer's values of `indices` into their parameters, every rank's rows
    (FSDP2: this rank's shard, which is all it holds), in the order given (the model's, as a
    forward reads them), with its rates for the "moments" matrices `with_rates`; returns each
    one's Ticket (its batch's). NCCL's all-gather of the other ranks' rows runs on the current
    stream, which waits for the copy first ("moments" never splits rows)."""
    start = time.perf_counter()
    host, partition, transfers = pipe.host, pipe.partition, pipe.transfers
    tickets, nbytes = {}, 0
    batch, batch_pairs, batch_bytes = [], [], 0
    what = "installing host-updated rows"

    def queue_batch() -> None:
        nonlocal batch, batch_pairs, batch_bytes, nbytes
        ticket = transfers.to_device(batch_pairs)
        tickets.update((j, ticket) for j in batch)
        nbytes += batch_bytes
        batch, batch_pairs, batch_bytes = [], [], 0
    for i in indices:
        param = host_view(local(pipe.params[i]).data)
        values = host.install(i)
        if partition.splits_rows and partition.on_device:
            # NCCL: this rank's rows to the device, then all ranks gather there.
            own = partition.own_rows_buffer(param.shape[0], param)
            # Its ticket still says when the install buffer may be overwritten: the device
            # waits for the copy now, the host's next update only once it has been read.
            tickets[i] = transfers.to_device([(own[: values.shape[0]], values)])
            transfers.order_after([tickets[i]])
            partition.gather_rows_into(param, own, what)
            nbytes += values.numel() * values.element_size()
            continue
        if partition.splits_rows:  # gloo: every rank's rows, gathered in host memory
            values = partition.gather_rows(values, param.shape[0], what)
        pairs = [(param, values)]
        if i in with_rates:
            pairs.append((pipe.device_sums.rates[i], host.rate(i)))
        batch.append(i)
        batch_pairs += pairs
        batch_bytes += sum(dst.numel() * dst.element_size() for dst, _ in pairs)
        if batch_bytes >= INSTALL_BATCH_BYTES:
            queue_batch()
    if batch:
        queue_batch()
    pipe.timer.moved(h2d=nbytes)
    pipe.timer.offload(time.perf_counter() - start)
    return tickets


def _length(value) -> str:
    return str(len(value)) if isinstance(value, list) else type(value).__name__


def check_in_flight_jobs(jobs, matrices: list[int]) -> None:
    """A saved in-flight update's jobs (None for states saved without them) fit its matrices:
    one [matrix, step, num_grads, lr, beta1, beta2, eps, weight_decay, lookahead, moments] each
    (states of format 3 and older: without moments), with counts that are positive integers and
    hyperparameters that AdamW accepts."""
    if jobs is None:
        return
    shape = ("'in_flight_jobs' must hold one [matrix, step, num_grads, lr, beta1, beta2, eps, "
             "weight_decay, lookahead, moments] per in-flight matrix")
    if not (isinstance(jobs, list) and all(isinstance(j, (list, tuple)) and len(j) in (9, 10)
                                           for j in jobs)
            and [j[0] for j in jobs] == list(matrices)):
        raise ValueError(shape)
    for job in jobs:
        matrix, step, num_grads, lr, beta1, beta2, eps, weight_decay, lookahead = job[:9]
        if len(job) == 10 and not isinstance(job[9], bool):
            raise ValueError(f"{shape}; the job of matrix {matrix} has moments {job[9]!r}, "
                             "expected a bool")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1
                   for x in (step, num_grads)):
            raise ValueError(f"{shape}; the job of matrix {matrix} has step {step!r} and "
                             f"num_grads {num_grads!r}, expected positive integers")
        numbers = (lr, beta1, beta2, eps, weight_decay, lookahead)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                   for x in numbers) or not (
                lr >= 0 and 0 <= beta1 < 1 and 0 <= beta2 < 1 and eps > 0 and weight_decay >= 0
                and lookahead >= 0):
            raise ValueError(f"{shape}; the job of matrix {matrix} has (lr, beta1, beta2, eps, "
                             f"weight_decay, lookahead) = {numbers}, expected finite lr >= 0, "
                             "betas in [0, 1), eps > 0, weight_decay >= 0, lookahead >= 0")
