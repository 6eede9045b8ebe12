"""The host pipeline's ordering, with copies that land late as they do on a GPU.

On a CPU "device" every copy is synchronous, so the queue that holds a worker command back until
the copy it reads has landed would never be exercised. Here the device-to-host copies are
deferred: their bytes arrive only when the pipeline waits for them, or when the step's fence
orders later device work after them (what the compute stream's event wait does on CUDA). A
pipeline that sent a command before its copy landed would sum stale staging bytes and drift
from the reference.
"""
from __future__ import annotations

import random
import threading

import pytest
import torch

import zenflow
from zenflow.host.transfers import Ticket, Transfers
from zenflow.optim.reference import ReferenceZenFlow


class LateTicket(Ticket):
    def __init__(self, pairs, log):
        super().__init__()
        self.pairs, self.log = pairs, log
        self.landed = False
        # A copy lands once, as a CUDA copy does: the dispatch thread's wait() and the training
        # thread's fence() may both land it, and without the lock the one that lost the race
        # could still be writing this step's bytes into a staging slot reused steps later.
        self._landing = threading.Lock()

    def land(self):
        with self._landing:
            if not self.landed:
                for dst, src in self.pairs:
                    dst.copy_(src)
                self.landed = True

    def done(self) -> bool:
        return self.landed

    def wait(self) -> float:
        if not self.landed:
            self.log["waited"] += 1
        self.land()
        return 0.0


class LateCopies(Transfers):
    """Device->host copies that land late; everything else as on the CPU."""

    def __init__(self, device):
        super().__init__(device)
        self.log = {"copies": 0, "waited": 0}

    def to_host(self, pairs):
        self.log["copies"] += 1
        # The source must stay readable until the copy lands: keep it (record_stream's job).
        return LateTicket([(dst, src.clone()) for dst, src in pairs], self.log)

    def fence(self, ticket):
        if isinstance(ticket, LateTicket):
            ticket.land()


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10),
                               torch.nn.Linear(10, 6))


def _grads(model, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen) * (1 + 3 * torch.rand(p.shape[-1:], generator=gen))
             for p in model.parameters()] for _ in range(steps)]


def _random_settings(seed: int) -> dict:
    rng = random.Random(seed)
    return dict(lr=rng.choice([1e-2, 3e-3]), topk_ratio=rng.choice([0.0, 0.25, 0.5]),
                update_interval=rng.choice([1, 2, 3]), overlap_step=rng.choice([False, True]),
                full_warm_up_rounds=rng.choice([0, 2]), max_grad_norm=rng.choice([None, 4.0]))


def _train_beside_reference(opt, fast, slow, settings, seed, before_step=lambda: None):
    """12 steps of `opt` on `fast` and of the reference on `slow`; equal after every step."""
    ref = ReferenceZenFlow(list(slow.parameters()), select_interval=4, **settings)
    for t, grads in enumerate(_grads(fast, 12, seed)):
        before_step()
        for p, g in zip(fast.parameters(), grads):
            p.grad = g.clone()
        opt.step()
        ref.step(grads, reselect=(t, "reselect") in opt.decisions)
        for p, q in zip(fast.parameters(), slow.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"step {t}")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("worker", [False, True])
def test_late_copies_give_the_reference_result(seed, worker):
    settings = _random_settings(seed)
    fast, slow = _model(seed), _model(seed)
    opt = zenflow.ZenFlowAdamW(fast.parameters(), select_strategy="step", select_interval=4,
                               worker=worker, **settings)
    late = LateCopies(opt.device)
    opt._pipeline.transfers.close()
    opt._pipeline.use_transfers(late)
    try:
        _train_beside_reference(opt, fast, slow, settings, seed)
        state = opt.state_dict()   # drains: every late copy lands, every command is sent
        assert state["zenflow"]["step"] == 12
    finally:
        opt.close()
    assert late.log["copies"] == 12


def test_install_does_not_wait_for_this_steps_copy():
    """At a window end with overlap, installing the previous window must not wait for the copy of
    the gradients just staged (on a GPU that would stall for a whole device-to-host transfer)."""
    model = _model(0)
    opt = zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval=2,
                               overlap_step=True, worker=False)
    late = LateCopies(opt.device)
    opt._pipeline.transfers.close()
    opt._pipeline.use_transfers(late)

    def no_fence(ticket):   # let copies stay in flight across steps, as a busy GPU would
        pass
    late.fence = no_fence
    with opt:
        for grads in _grads(model, 6, 0):
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            opt.step()
        waited = late.log["waited"]   # (close() then installs, and waits for everything)
    # Each step's own copy was outstanding while its window's install ran; the pipeline only
    # ever waited for copies that the host was about to read (the previous step's).
    assert waited <= 5


def test_waiting_for_everything_waits_for_an_update_that_finishes_last():
    """The worker runs an update beside later accumulates, so "done" replies arrive out of
    order; waiting for everything must not return when only the last command is done."""
    from zenflow.host.buffers import HostState
    from zenflow.host.commands import Accumulate, Update
    from zenflow.host.layout import HostJob, HostLayout, HostUpdate
    from zenflow.host.worker import WorkerHostRunner
    host = HostState.allocate(HostLayout.build([(2048, 4096, torch.float32), (4, 4, torch.float32)],
                                               sum_slots=2))
    runner = WorkerHostRunner(host, cores=None)
    try:
        for _ in range(3):
            runner.send(Update(0, (HostJob(0, 1, 1, HostUpdate(1e-3, 0.9, 0.999, 1e-8, 0.0)),)))
            runner.send(Accumulate(0, 1, (), (1,)))   # tiny: done long before the update
            runner.wait()
            assert runner.unfinished() == []
    finally:
        runner.close()


def test_the_cpu_copy_thread_lands_copies_in_order_and_fence_waits_for_them():
    transfers = Transfers(torch.device("cpu"), copy_cores=[0])
    try:
        sources = [torch.randn(1000, 1000) for _ in range(3)]
        targets = [torch.zeros(1000, 1000) for _ in range(3)]
        tickets = [transfers.to_host([(t, s)]) for t, s in zip(targets, sources)]
        transfers.fence(tickets[-1])             # later tickets land after earlier ones
        assert all(t.done() for t in tickets)
        for t, s in zip(targets, sources):
            assert torch.equal(t, s)
        bad = transfers.to_host([(torch.zeros(2), torch.zeros(3))])   # shapes do not match
        with pytest.raises(RuntimeError, match="copy between host and device failed"):
            bad.wait()
    finally:
        transfers.close()


class OutlivingCopies(LateCopies):
    """The CUDA configuration: copies still in flight when step() returns (fence only orders later
    device work), landing some time during the next forward and backward."""

    copies_outlive_step = True

    def __init__(self, device, copy_cores=None):
        super().__init__(device)
        self.pending = []

    def to_host(self, pairs):
        ticket = super().to_host(pairs)
        self.pending.append(ticket)
        return ticket

    def fence(self, ticket):
        pass

    def land_pending(self):
        for ticket in self.pending:
            ticket.land()
        self.pending = []


@pytest.mark.parametrize("seed", range(6))
def test_copies_landing_after_the_step_use_two_staging_buffers_and_match_the_reference(
        seed, monkeypatch):
    import zenflow.host.pipeline
    made = []
    monkeypatch.setattr(zenflow.host.pipeline, "Transfers",
                        lambda device, copy_cores=None: made.append(OutlivingCopies(device))
                        or made[-1])
    settings = _random_settings(100 + seed)
    fast, slow = _model(seed), _model(seed)
    opt = zenflow.ZenFlowAdamW(fast.parameters(), select_strategy="step", select_interval=4,
                               **settings)
    late = made[0]
    assert opt._pipeline.layout.staging_slots == 2
    try:
        # the copies finish during each step's forward and backward
        _train_beside_reference(opt, fast, slow, settings, seed, before_step=late.land_pending)
    finally:
        opt.close()
    assert late.log["copies"] == 12


def test_auto_device_sum_budget_on_a_cpu_device_keeps_every_sum_on_the_host():
    layer = torch.nn.Linear(8, 8)
    opt = zenflow.ZenFlowAdamW(layer.parameters(), update_interval=2, worker=False)
    layer(torch.randn(2, 8)).sum().backward()
    opt.step()
    stats = opt.stats()
    opt.close()
    assert stats["device_sum_matrices"] == 0 and stats["host_sum_matrices"] == 1
    assert stats["device_sum_bytes"] == 0


@pytest.mark.parametrize("credit", ["mean", "moments"])
def test_device_summed_matrices_send_no_gradient_to_the_host_until_the_window_ends(credit):
    layer = torch.nn.Linear(16, 8, bias=False)
    opt = zenflow.ZenFlowAdamW(layer.parameters(), topk_ratio=0.25, update_interval=4,
                               overlap_step=True, worker=False, device_sum_budget=10 ** 6,
                               deferred_credit=credit, select_strategy="step",
                               select_interval=10 ** 6)   # no reselection's install
    moved, installed = [], []
    for _ in range(12):
        layer(torch.randn(2, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        moved.append(opt.timeline()["steps"][-1]["d2h_bytes"])
        installed.append(opt.timeline()["steps"][-1]["h2d_bytes"])
    opt.close()
    # Once per window, the fp32 sum of the 8 x 16 matrix: 4 bytes a parameter; "moments" also
    # sends its squares, and an install brings the fp32 rates with the values.
    per_param = 4 if credit == "mean" else 8
    assert moved == [0, 0, 0, 8 * 16 * per_param] * 3
    values = 8 * 16 * 4
    install = values + (credit == "moments") * values   # at the ends of windows 2 and 3
    assert installed == [0] * 7 + [install] + [0] * 3 + [install]
