"""Installs off the critical path (zenflow/optim/installs.py): with `opt.attach(model)` each
module's forward waits only for its own weights' install, every other reader still sees the
installed values, the results are bit for bit those without attach, and the windows are paced
by the time the device waits for installs, not by the copies' duration."""
from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

import zenflow
from zenflow.host import pipeline
from zenflow.host.transfers import Ticket

# Every backward runs on a thread of its own, as CUDA runs it (tests/helpers/autograd_thread.py).
pytestmark = pytest.mark.usefixtures("autograd_thread")

ALL = 10 ** 9   # a device_sum_budget that puts every sum on the CPU "device" ("moments" needs it)


class TiedModel(torch.nn.Module):
    """Token embedding, two layers, and an output head tied to the embedding."""

    def __init__(self, vocab=10, dim=8, hidden=16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.up, self.down = torch.nn.Linear(dim, hidden), torch.nn.Linear(hidden, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.down(torch.tanh(self.up(self.embed(tokens)))))


def _trained(credit: str, worker: bool):
    """A model (the same one at each call) and its ZenFlowAdamW."""
    torch.manual_seed(0)
    model = TiedModel()
    return model, zenflow.ZenFlowAdamW(
        model.parameters(), lr=0.05, topk_ratio=0.25, update_interval=2, overlap_step=True,
        deferred_credit=credit, device_sum_budget=ALL, worker=worker,
        select_strategy="step", select_interval=10 ** 6)   # no reselection: it installs at once


def _pair(credit: str, worker: bool):
    return (*_trained(credit, worker), *_trained(credit, worker))


def _loss(model, step):
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 10, (4, 5), generator=gen)
    return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())


@pytest.mark.parametrize("credit", ["mean", "moments"])
def test_attached_training_is_bit_for_bit_the_unattached(credit, monkeypatch):
    """The worker is on, so the copy thread lands installs, one matrix per copy, while the next
    forward runs."""
    monkeypatch.setattr(pipeline, "INSTALL_BATCH_BYTES", 0)
    a, opt_a, b, opt_b = _pair(credit, worker=True)
    handle = opt_a.attach(a)
    assert opt_a.attach(a) is handle   # once per model
    for step in range(8):
        for model, opt in ((a, opt_a), (b, opt_b)):
            loss = _loss(model, step)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if model is a:
                loss_a = loss
        assert torch.equal(loss_a, loss), f"step {step}"
    assert opt_a.num_windows == opt_b.num_windows == 4
    if credit == "moments":
        assert opt_a.stats()["moments_matrices"] == 3   # the tied head is the embedding
    opt_a.wait_for_install()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    handle.remove()
    opt_a.close()
    opt_b.close()


class LateCopies:
    """A copy engine whose copies land as late as they can: in the order queued, and only when
    someone waits for one (every earlier one lands first)."""

    def __init__(self):
        self.queued: list = []

    def submit(self, pairs) -> Ticket:
        ticket = _LateTicket(self)
        self.queued.append((pairs, ticket))
        return ticket

    def land_until(self, ticket) -> None:
        while not ticket.landed:
            pairs, queued = self.queued.pop(0)
            for dst, src in pairs:
                dst.copy_(src)
            queued.landed = True

    def close(self) -> None:
        while self.queued:
            self.land_until(self.queued[-1][1])


class _LateTicket(Ticket):
    def __init__(self, copies: LateCopies):
        super().__init__()
        self.copies, self.landed = copies, False

    def done(self) -> bool:
        return self.landed

    def wait(self) -> float:
        self.copies.land_until(self)
        return 0.0


def _copies_land_late(opt) -> None:
    transfers = opt._pipeline.transfers
    transfers._copy_cores, transfers._copier = [0], LateCopies()


def _record_weights_seen(model, seen: list) -> None:
    """Each forward of a module records the weights it reads (after the optimizer's hooks)."""
    for module in (model.embed, model.up, model.down, model.head):
        module.register_forward_pre_hook(
            lambda module, args: seen.append([p.detach().clone() for p in
                                              module.parameters(recurse=False)]))


def _differ(a, b) -> bool:
    return any(not torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


READERS = {
    "model.state_dict()": lambda model, opt: model.state_dict(),
    "wait_for_install()": lambda model, opt: opt.wait_for_install(),
    "optimizer.state_dict()": lambda model, opt: opt.state_dict(),
}


@pytest.mark.parametrize("credit", ["mean", "moments"])
def test_with_late_copies_every_reader_sees_the_installed_weights(credit, monkeypatch):
    """Copies land only when waited for, one matrix per copy (as a GPU copies a large model's).
    The unattached optimizer waits for all of them in step(); the attached one leaves them in
    flight, and each module's forward (for its own weights only), the model's state_dict(),
    wait_for_install(), the optimizer's state_dict() and synchronize() wait."""
    monkeypatch.setattr(pipeline, "INSTALL_BATCH_BYTES", 0)
    a, opt_a, b, opt_b = _pair(credit, worker=False)
    _copies_land_late(opt_a)
    _copies_land_late(opt_b)
    opt_a.attach(a)
    seen_a, seen_b = [], []
    _record_weights_seen(a, seen_a)
    _record_weights_seen(b, seen_b)
    later_layer_in_flight = []   # at A's up layer: is the down layer's install still landing?
    a.up.register_forward_pre_hook(lambda module, args: later_layer_in_flight.append(
        not torch.equal(a.down.weight, b.down.weight)))
    late_at_forward = late_at_read = 0
    readers = list(READERS.items())
    for step in range(14):
        late_at_forward += _differ(a, b)   # A's installs land in its forward; B's have landed
        for model, opt in ((a, opt_a), (b, opt_b)):
            _loss(model, step).backward()
            opt.step()
            opt.zero_grad()
        if step % 4 == 3:   # every other window end, a reader before the next forward
            late_at_read += _differ(a, b)
            what, read = readers[(step // 4) % len(readers)]
            read(a, opt_a)
            assert not _differ(a, b), f"{what} at step {step} read weights not yet installed"
    assert late_at_forward >= 2 and late_at_read >= 3, "the copies did not land late"
    assert sum(later_layer_in_flight) == late_at_forward, "a layer waited for a later one's"
    assert len(seen_a) == len(seen_b)
    for n, (x, y) in enumerate(zip(seen_a, seen_b)):
        assert all(torch.equal(p, q) for p, q in zip(x, y)), f"forward {n} read stale weights"
    assert _differ(a, b)   # the last window's install is in flight in A
    opt_a.synchronize()
    opt_b.synchronize()
    assert not _differ(a, b)
    opt_a.close()
    opt_b.close()


def test_a_removed_attachment_leaves_the_step_waiting_for_every_install():
    a, opt_a, b, opt_b = _pair("mean", worker=False)
    _copies_land_late(opt_a)
    opt_a.attach(a).remove()
    for step in range(6):
        for model, opt in ((a, opt_a), (b, opt_b)):
            _loss(model, step).backward()
            opt.step()
            opt.zero_grad()
        assert not _differ(a, b)
    opt_a.close()
    opt_b.close()


class SlowCopies:
    """A copy thread that takes `delay` seconds per batch, in order (a slow bus)."""

    def __init__(self, delay: float):
        self.delay, self.jobs = delay, queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while (job := self.jobs.get()) is not None:
            pairs, ticket = job
            time.sleep(self.delay)
            for dst, src in pairs:
                dst.copy_(src)
            ticket.landed.set()

    def submit(self, pairs) -> Ticket:
        from zenflow.host.transfers import _ThreadTicket
        ticket = _ThreadTicket()
        self.jobs.put((pairs, ticket))
        return ticket

    def close(self):
        self.jobs.put(None)
        self.thread.join()


@pytest.mark.parametrize("attach", [False, True], ids=["unattached", "attached"])
def test_the_windows_are_paced_by_the_measured_install_wait(attach):
    """Each copy takes 20 ms. Unattached, step() waits for the install's copies; attached, the
    copies land while the training thread is busy elsewhere (a 0.15 s pause before the next
    forward), and the forward waits for nothing. What the window rule is given is that wait."""
    delay = 0.02
    a, opt = _trained("mean", worker=True)
    opt._pipeline.transfers._copier = SlowCopies(delay)
    if attach:
        opt.attach(a)
    given = []
    should_end = opt._window.should_end
    opt._window.should_end = lambda *args: (given.append(args[4]), should_end(*args))[1]
    for step in range(5):   # installs at the window end of step 3, read at step 4
        if attach:
            time.sleep(0.15)
        _loss(a, step).backward()
        opt.step()
        opt.zero_grad()
    waited = opt._pipeline.transfers.last_install_wait_seconds
    assert given[-1] == waited == opt.stats()["last_install_wait_s"]
    if attach:
        assert waited < delay / 2
    else:
        assert waited >= delay    # at least one matrix's copy
    opt.close()


def test_the_engine_attaches_its_model_until_it_is_closed():
    from helpers.engine_toys import config, make_model, train
    model = make_model()
    engine, opt, _, _ = zenflow.initialize(model=model, config=config("zenflow"))
    assert model in opt._installs._attached
    train(engine, range(3))
    engine.close()
    assert model not in opt._installs._attached


def test_attach_refuses_what_is_not_a_module_by_name():
    model = torch.nn.Linear(8, 8)
    with zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.25, worker=False) as opt:
        with pytest.raises(TypeError, match=r"attach: model must be a torch.nn.Module.*got list"):
            opt.attach(list(model.parameters()))


def _train_compiled(compiled: bool, steps: int = 8, compile_at: int = 0):
    """Weights after `steps` steps, and (compiled) torch.compile's account of one more forward
    of the trained model, taken with a window's install pending: (graphs, graph breaks)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])
    opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2,
                               worker=False)
    opt.attach(model)
    gen = torch.Generator().manual_seed(1)
    account = None
    with opt:
        for step in range(steps):
            forward = (torch.compile(model, backend="eager") if compiled and step >= compile_at
                       else model)
            forward(torch.randn(4, 16, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        if compiled:
            explained = torch._dynamo.explain(model)(torch.randn(4, 16))
            account = explained.graph_count, explained.graph_break_count
        opt.synchronize()
    return [p.detach().clone() for p in model.parameters()], account


@pytest.mark.slow   # torch.compile
def test_a_compiled_attached_model_is_one_graph_and_trains_as_eager():
    """torch.compile traces the layers' pre-hooks: there they do nothing (a hook that finished
    installs broke the graph at every layer, so the model ran eagerly between the breaks), and
    the optimizer finishes a compiled model's installs in the step that queues them. The
    weights are the eager run's, bit for bit."""
    torch._dynamo.reset()
    compiled, account = _train_compiled(True)
    assert account == (1, 0)
    eager, _ = _train_compiled(False)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)
    torch._dynamo.reset()


def test_a_model_compiled_mid_training_reads_its_pending_installs_first():
    """Compiled after three steps, with a window's install pending: the first trace finishes it
    before the compiled forward reads the weights (one graph break, once)."""
    torch._dynamo.reset()
    compiled, _ = _train_compiled(True, compile_at=3)
    eager, _ = _train_compiled(False)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)
    torch._dynamo.reset()
