"""The worker link (zenflow/host/worker_link.py): a command reaches the worker as soon as the
copies it reads have landed, in order, from the dispatch thread; not at the next step()."""
from __future__ import annotations

import gc
import queue
import threading
import time
import weakref

import pytest
import torch

import zenflow
from zenflow.host import pipeline as pipeline_module
from zenflow.host.commands import Accumulate
from zenflow.host.telemetry import StepTimer
from zenflow.host.transfers import Ticket, Transfers
from zenflow.host.worker import WorkerDied
from zenflow.host.worker_link import WorkerLink


class ManualTicket(Ticket):
    """Copies that land when the test says so."""

    def __init__(self):
        super().__init__()
        self.landed = threading.Event()

    def done(self) -> bool:
        return self.landed.is_set()

    def wait(self) -> float:
        self.landed.wait(10)
        return 0.0


class FakeRunner:
    """A worker that records what it is sent; `die` makes the next post fail as a dead one's."""

    def __init__(self):
        self.sent, self.threads, self.die, self.closed = [], [], False, False

    def post(self, command):
        if self.die:
            raise WorkerDied("ZenFlow host worker (pid 0) was killed by signal SIGKILL")
        self.sent.append(command)
        self.threads.append(threading.get_ident())
        return len(self.sent)

    def check(self):
        pass

    def done(self, seq):
        return True

    def wait(self, seq=None):
        return 0.0

    def unfinished(self):
        return []

    def close(self):
        self.closed = True


def _link(monkeypatch, runners: list):
    def start(self):
        runners.append(FakeRunner())
        return runners[-1]
    monkeypatch.setattr(WorkerLink, "_start_runner", start)
    return WorkerLink(host=None, cores=[0], timer=StepTimer())


def _eventually(condition, seconds=5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)
    return condition()


def _accumulate(slot: int) -> Accumulate:
    return Accumulate(slot, 0, (), (0,))


def test_commands_are_sent_in_order_as_their_copies_land(monkeypatch):
    runners: list = []
    link = _link(monkeypatch, runners)
    try:
        first, second = ManualTicket(), ManualTicket()
        a = link.submit(first, _accumulate(0))
        b = link.submit(second, _accumulate(1))
        second.landed.set()   # the later copy landed first: still sent after the first
        time.sleep(0.05)
        assert runners[0].sent == [] and not a.sent and not b.sent
        first.landed.set()
        assert _eventually(lambda: b.sent)
        assert runners[0].sent == [a.command, b.command] and (a.seq, b.seq) == (1, 2)
        # by the dispatch thread, with no call of the training thread's in between
        assert threading.get_ident() not in runners[0].threads
    finally:
        link.close()


def test_a_worker_dead_on_the_dispatch_thread_is_replaced_by_the_next_call(monkeypatch):
    runners: list = []
    link = _link(monkeypatch, runners)
    try:
        runners[0].die = True
        ticket = ManualTicket()
        handle = link.submit(ticket, _accumulate(0))
        ticket.landed.set()
        assert _eventually(lambda: link._outbox.error is not None)
        link.check()   # died idle (nothing unfinished): a new worker, which gets the command
        assert len(runners) == 2 and runners[0].closed
        assert _eventually(lambda: handle.sent) and runners[1].sent == [handle.command]
    finally:
        link.close()


def test_the_dispatch_thread_ends_with_close_or_with_its_link(monkeypatch):
    runners: list = []
    link = _link(monkeypatch, runners)
    thread = link._thread
    link.close()
    assert not thread.is_alive() and runners[0].closed
    link = _link(monkeypatch, runners)
    thread, dropped = link._thread, weakref.ref(link)
    del link
    gc.collect()
    assert dropped() is None
    thread.join(5)
    assert not thread.is_alive()


class LateCopies(Transfers):
    """A CUDA stream's copies on a CPU: each lands 20 ms after it is queued (in order), and the
    fence orders nothing on the host (the current stream would wait for them; the Python thread
    does not), so step() returns with its copies in flight, and a command that reads them can
    only go once they land. The test's gradients are new tensors each step, so nothing
    overwrites a source a copy still reads."""

    def __init__(self, device, copy_cores=None):
        super().__init__(device, copy_cores=None)
        self._jobs = queue.SimpleQueue()
        threading.Thread(target=self._copy, daemon=True).start()

    def _copy(self):
        while (job := self._jobs.get()) is not None:
            pairs, ticket = job
            time.sleep(0.02)
            for dst, src in pairs:
                dst.copy_(src)
            ticket.landed.set()

    @property
    def copies_outlive_step(self) -> bool:
        return True

    @property
    def copies_overlap_compute(self) -> bool:
        return True

    def to_host(self, pairs):
        ticket = ManualTicket()
        self._jobs.put((pairs, ticket))
        return ticket

    def fence(self, ticket: Ticket) -> None:
        pass

    def close(self):
        self._jobs.put(None)
        super().close()


@pytest.mark.parametrize("hooks", [False, True], ids=["late-copies", "early-copies"])
def test_a_steps_accumulate_reaches_the_worker_before_the_next_step(monkeypatch, hooks):
    """With copies that outlive the step (CUDA), each step's gradients reach the worker once
    their copy lands, while the next forward and backward run; at the next step() the worker has
    added them, and the backward's hooks found their staging buffer free every step."""
    monkeypatch.setattr(pipeline_module, "Transfers", LateCopies)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 8))
    opt = zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval=4,
                               device_sum_budget=0)
    if not hooks:
        opt._pipeline.early_copies.stop_watching(range(2))
    accumulates = []   # the staging slot of each Accumulate the worker was sent
    conn = opt._runner._conn
    send = conn.send

    def record(message):
        if message is not None and isinstance(message[1], Accumulate):
            accumulates.append(message[1].staging_slot)
        send(message)
    conn.send = record
    with opt:
        for step in range(6):
            model(torch.randn(4, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            assert _eventually(lambda: len(accumulates) == step + 1), (step, accumulates)
        stats = opt.stats()
    if hooks:   # every step but the first copied both matrices in backward
        assert (stats["early_copies"], stats["late_copies"]) == (10, 2)
