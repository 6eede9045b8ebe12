"""The CUDA seam: the one place that knows about CUDA streams, events and page-locked memory
(zenflow/host/page_locks.py registers the host buffers for it).

Every copy between the device and the host goes through `Transfers`, which returns a `Ticket`
instead of waiting:

- to_host: the copies run on a side stream that first waits for the kernels that produced the
  sources (an event recorded on the device's current stream), into page-locked host buffers.
  The Python thread returns at once; the ticket says when the bytes have landed, and the pipeline
  only tells the worker to read them after that. `fence` makes the current stream wait for the
  copies at the end of step(), so nothing queued after step() (an in-place zero_grad, the next
  backward accumulating into the same gradient) can overwrite a source before it is read.
  Copies land in the order queued (one stream; on the CPU, one thread). A post-accumulate-grad
  hook queues them too (zenflow/host/early_copies.py): in a hook the current stream is the one
  autograd accumulated that gradient on, so the copy still waits for its producer.
- to_device: the copies run on a second side stream after everything queued so far on the
  current stream (the destinations are free). Nothing waits for them at once: `order_after`
  makes the current stream's later work wait for a ticket (a forward pre-hook does it for the
  layer about to read its weights: zenflow/optim/installs.py), and the Python thread never
  blocks. The ticket also says when the host sources may be overwritten.
  `last_install_wait_seconds` is how long the device waited for the last install: on CUDA
  from timing events recorded on the current stream around each wait, read once they have
  completed (never synchronized); on a CPU the seconds the training thread blocked.
  `last_window_work_seconds`, timed the same way (`window_work`), is the device's time in the
  last window's own work, less those waits: with them, what a window costs whatever its length.

The device is always passed explicitly (never the implicit current device), so a rank that
trains on cuda:3 never opens a context on cuda:0. On a CPU "device" (CPU-only torch, or the
tests) a copy thread plays the GPU's copy engine for both directions: it runs on the worker's
cores beside the training thread, copies in the order queued, its tickets really complete
later, and `fence` and `order_after` wait for it (the training thread is the CPU's only
"stream"). Without worker cores copies are plain and synchronous and their tickets already done
(an install's copy then counts as waited for).
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable

import torch

from zenflow.host.page_locks import PageLocks
from zenflow.host.tickets import DONE, ThreadTicket, Ticket, all_of

__all__ = ["DONE", "Ticket", "Transfers", "all_of", "copy", "uses_cuda"]

log = logging.getLogger("zenflow")


# Alike small tensors are stacked into one copy or launch where each would be its own: a launch
# costs the Python thread ~5 us, more than a GPU takes to copy a tensor of this many values.
STACK_ELEMENTS = 1 << 16
STACK_RUN_ELEMENTS = 1 << 24   # values in one stack: at most 64 MiB of fp32 temporaries


def uses_cuda(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def copy(dst: torch.Tensor | list[torch.Tensor], src: torch.Tensor,
         non_blocking: bool = False) -> None:
    """dst.copy_(src); a list `dst` of alike tensors takes a flat `src` spread over them, in one
    copy to their device and one multi-tensor copy (alike small matrices: HostLayout.back_to_back),
    not a copy each."""
    if not isinstance(dst, list):
        dst.copy_(src, non_blocking=non_blocking)
        return
    if src.device != dst[0].device:   # (on CUDA on the current stream, which the copies follow)
        src = src.to(dst[0].device, non_blocking=non_blocking)
    # (not a view of src per matrix: a few us each, and thousands of objects for Python's
    # collector at an install of an MoE's experts)
    rows = dst[0].shape[0]
    torch.split_with_sizes_copy(src.view(len(dst) * rows, -1), [rows] * len(dst), 0, out=dst)


def _copy_loop(jobs: queue.SimpleQueue, cores: list[int]) -> None:
    """The copy thread's body. It holds only its queue (never its owner, nor a finished job's
    tensors), so a dropped optimizer is collected, and its finalizer's None ends the loop."""
    try:
        os.sched_setaffinity(threading.get_native_id(), cores)
    except (AttributeError, OSError):
        pass  # an optimisation only
    while (job := jobs.get()) is not None:
        pairs, ticket = job
        try:
            for dst, src in pairs:
                copy(dst, src)
        except BaseException as exc:   # handed to whoever waits for the ticket
            ticket.error = exc
        finally:
            ticket.landed.set()
        del job, pairs, ticket


class _CopyThread:
    """The CPU's stand-in for a copy engine: copies queued pairs in order on its own thread,
    pinned to `cores` (the worker's), and completes a ticket per batch."""

    def __init__(self, cores: list[int]):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=_copy_loop, args=(self._jobs, cores), daemon=True,
                                        name="zenflow-copy")
        self._thread.start()
        self._creator_pid = os.getpid()
        # Dropped without close() (its optimizer collected): the thread still ends. Not at
        # interpreter exit, though: a thread woken while the interpreter tears down can abort
        # the process inside torch ("terminate called"); blocked, it just stops with it.
        self._stop = weakref.finalize(self, self._jobs.put, None)
        self._stop.atexit = False

    def submit(self, pairs) -> Ticket:
        ticket = ThreadTicket()
        self._jobs.put((pairs, ticket))
        return ticket

    def close(self) -> None:
        if self._stop.detach() is None or os.getpid() != self._creator_pid:
            return   # closed already, or a forked child's copy (the thread is the parent's)
        self._jobs.put(None)
        self._thread.join()


class _Periods:
    """The device's seconds in spans of work, summed per period (an install's waits, a window's
    own work) and read without blocking. A span is a CPU's seconds, or a pair of CUDA timing
    events read once the later has completed (never synchronized); spans inside it that another
    period counts are taken out of it. A period whose events had not completed when the next
    began is read later, in order. `open_counts`: the period still open is read too (an
    install's waits are over once it is finished; a window's work only once it has ended)."""

    def __init__(self, open_counts: bool):
        self._open_counts = open_counts
        self._spans: list = []             # the current period's (span, spans inside it)
        self._unread: list[list] = []      # earlier periods not yet measured
        self._seconds = 0.0                # the last period measured

    def add(self, span, inside=()) -> None:
        self._spans.append((span, tuple(inside)))

    def next(self) -> None:
        if self._spans:
            self._unread.append(self._spans)
        self._spans = []

    @staticmethod
    def _measured(spans: list, cuda: bool) -> float | None:
        def seconds(span):
            if not cuda:
                return span
            start, end = span
            return start.elapsed_time(end) / 1000.0 if end.query() else None
        total = 0.0
        for span, inside in spans:
            parts = [seconds(span), *map(seconds, inside)]
            if None in parts:
                return None
            total += max(0.0, parts[0] - sum(parts[1:]))
        return total

    def last_seconds(self, cuda: bool) -> float:
        """The latest period measured (with `open_counts`, the open one once it has spans, all
        measured)."""
        while self._unread and (seconds := self._measured(self._unread[0], cuda)) is not None:
            self._seconds = seconds
            self._unread.pop(0)
        if self._open_counts and not self._unread and self._spans:
            seconds = self._measured(self._spans, cuda)
            if seconds is not None:
                self._seconds = seconds
        return self._seconds


class Transfers:
    """Device<->host copies for one optimizer on one device."""

    def __init__(self, device: torch.device, copy_cores: list[int] | None = None):
        self.device = device
        self.cuda = uses_cuda(device)
        self._copy_cores = None if self.cuda else copy_cores
        self._copier = None       # the CPU copy thread, started at the first copy
        self._install_waits = _Periods(open_counts=True)   # the device waits for each install
        self._window_work = _Periods(open_counts=False)    # ... and works at each window
        self._waits_inside: list | None = None   # install waits while window work is timed
        self._locks: PageLocks | None = None
        if self.cuda:
            self._d2h = torch.cuda.Stream(device)
            self._h2d = torch.cuda.Stream(device)
            self._locks = PageLocks(device, (self._d2h, self._h2d))

    @property
    def copies_outlive_step(self) -> bool:
        """Whether a device-to-host copy may still be in flight when step() returns (CUDA: the
        compute stream waits for it, the Python thread does not)."""
        return self.cuda

    @property
    def copies_overlap_compute(self) -> bool:
        """Whether to_host returns before its copies run (a CUDA side stream, or the CPU's copy
        thread), so that a copy queued during backward runs beside it."""
        return self.cuda or bool(self._copy_cores)

    def _current(self):
        return torch.cuda.current_stream(self.device)

    def to_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Ticket:
        """host_dst.copy_(device_src) for each pair, asynchronously on CUDA (and on the CPU's copy
        thread); the sources must not change until fence() (the caller's step keeps them)."""
        if self._copy_cores:
            if self._copier is None:
                self._copier = _CopyThread(self._copy_cores)
            return self._copier.submit(pairs)
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return DONE
        current = self._current()
        self._d2h.wait_stream(current)          # the sources are complete
        with torch.cuda.stream(self._d2h):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                src.record_stream(self._d2h)    # the allocator keeps a freed source alive
        return Ticket(self._d2h.record_event())

    def fence(self, ticket: Ticket) -> None:
        """Order the current stream's later work after `ticket`'s copies, without blocking the
        Python thread: called at the end of step(), so that nothing queued afterwards (an
        in-place zero_grad, the next backward accumulating into a gradient) can overwrite a
        source before the copy has read it, while the step's own device work overlaps it."""
        if self.cuda:
            for event in ticket.events():   # all of them: a step's copies may be several
                self._current().wait_event(event)
        else:
            ticket.wait()

    def to_device(self, pairs: list[tuple[torch.Tensor | list[torch.Tensor], torch.Tensor]],
                  then: Callable[[], None] | None = None) -> Ticket:
        """device_dst.copy_(host_src) for each pair (a list of alike device tensors takes a flat
        source spread over them: `copy`), queued; nothing waits for it until
        order_after(ticket). Without a copy thread on a CPU the copy runs now, and the time it
        takes counts as waited for (the training thread is the device).

        `then`: device work on the copied values, called now on this thread (so collectives it
        issues keep the training thread's order on every rank) and run after the copies, as
        part of the ticket: on CUDA queued on the copy stream (DDP's correction and all-gather
        of an install, which a layer's forward then waits for with its copy; tensors it
        allocates belong to that stream); on a CPU the training thread waits for the copies
        first."""
        if self._copy_cores:
            if self._copier is None:
                self._copier = _CopyThread(self._copy_cores)
            ticket = self._copier.submit(pairs)
            if then is not None:
                self.order_after([ticket])
                then()
            return ticket
        if not self.cuda:
            start = time.perf_counter()
            for dst, src in pairs:
                copy(dst, src)
            self._waited(time.perf_counter() - start)
            if then is not None:
                then()
            return DONE
        self._h2d.wait_stream(self._current())   # earlier work on the destinations is done
        with torch.cuda.stream(self._h2d):
            for dst, src in pairs:
                copy(dst, src, non_blocking=True)
                for t in dst if isinstance(dst, list) else (dst,):
                    t.record_stream(self._h2d)
            if then is not None:
                then()
            installed = self._h2d.record_event()
        return Ticket(installed)

    def order_after(self, tickets: list[Ticket]) -> None:
        """The device's later work waits for `tickets`' copies to the device (an install about to
        be read). On CUDA the current stream waits, between two timing events that measure the
        wait; the Python thread does not. On a CPU the training thread blocks until they land."""
        # (the matrices of one batch of copies share its ticket: one wait each, not one a matrix)
        tickets = list({id(t): t for t in tickets}.values())
        if self.cuda:
            events = [e for t in tickets for e in t.events()]
            if not events:
                return
            current = self._current()
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record(current)
            for event in events:
                current.wait_event(event)
            end.record(current)
            self._waited((start, end))
        else:
            self._waited(sum(t.wait() for t in tickets))

    def _waited(self, span) -> None:
        self._install_waits.add(span)
        if self._waits_inside is not None:
            self._waits_inside.append(span)

    def new_install(self) -> None:
        """An install is queued: the device's waits from now on count towards it."""
        self._install_waits.next()

    @property
    def last_install_wait_seconds(self) -> float:
        """How long the device waited for the last install, all its waits counted (read it once
        the install has been finished, e.g. in the next step()). Never blocks: on CUDA waits not
        yet completed leave the previous install's figure (0 before the first)."""
        return self._install_waits.last_seconds(self.cuda)

    @contextlib.contextmanager
    def window_work(self, ends: bool = False):
        """Time the block as the window's own work at its start or end (the outside writes'
        fingerprints, the installs' queueing and corrections): the device's time in it, less the
        install waits inside it (last_install_wait_seconds counts those). On CUDA two timing
        events on the current stream, so the span also holds any time the device idles while the
        training thread launches it or reads a result; on a CPU the training thread's seconds.
        `ends`: the window's work is all timed with this block; what follows is the next's."""
        outer, self._waits_inside = self._waits_inside, []
        if self.cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record(self._current())
        else:
            began = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                end.record(self._current())
                span = (start, end)
            else:
                span = time.perf_counter() - began
            self._window_work.add(span, self._waits_inside)
            self._waits_inside = outer
            if ends:
                self._window_work.next()

    @property
    def last_window_work_seconds(self) -> float:
        """The device's time in the last window's own work (window_work), as
        last_install_wait_seconds reads its waits: never blocking, 0 before the first."""
        return self._window_work.last_seconds(self.cuda)

    def spare_device_bytes(self, headroom: float = 0.1, activation_growth: float = 1.0) -> int:
        """Device memory left for the window sums (device_sum_budget="auto"), called at the first
        step(), after the first backward: the device's total, less `headroom` of it, less the
        peak reserved so far, less room for the activations to grow by `activation_growth` times
        the first step's (a later, longer batch: dynamic padding is HF's default; 1.0: to twice
        the first). The first step's activations are its peak allocation less what is allocated
        at step() (weights, gradients, optimizer state). A CPU "device" has none to spare: it is
        the host."""
        if not self.cuda:
            return 0
        total = torch.cuda.get_device_properties(self.device).total_memory
        peak = torch.cuda.max_memory_reserved(self.device)
        activations = max(0, torch.cuda.max_memory_allocated(self.device)
                          - torch.cuda.memory_allocated(self.device))
        return max(0, int(total * (1.0 - headroom) - peak - activation_growth * activations))

    def device_memory(self) -> tuple[int, int]:
        """(peak reserved so far, total) of the device's memory, asked of the allocator on the
        host (no device sync); (0, 0) on a CPU "device"."""
        if not self.cuda:
            return 0, 0
        return (torch.cuda.max_memory_reserved(self.device),
                torch.cuda.get_device_properties(self.device).total_memory)

    def pin(self, tensors: list[torch.Tensor]) -> None:
        """Page-lock host buffers in place (zenflow/host/page_locks.py: they live in shared
        memory, which pin_memory=True cannot allocate). Only buffers that copies touch are worth
        it. A buffer the driver refuses to lock stays pageable, with a warning: its copies are
        synchronous and slower, and nothing breaks. Nothing to do on a CPU "device"."""
        if self._locks is not None:
            self._locks.lock(tensors)

    @property
    def pinned_bytes(self) -> int:
        return 0 if self._locks is None else self._locks.nbytes

    def close(self) -> None:
        self._copy_cores = None
        if self._copier is not None:
            self._copier.close()
            self._copier = None
        self.unpin()

    def unpin(self) -> None:
        """Unlock the page-locked buffers, once no copy in flight reads or writes them (an
        optimizer dropped without close() does it when it is collected)."""
        if self._locks is not None:
            self._locks.release()
