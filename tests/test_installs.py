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
from zenflow.host.transfers import Ticket
from zenflow.optim import installs

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
    monkeypatch.setattr(installs, "INSTALL_BATCH_BYTES", 0)
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
    monkeypatch.setattr(installs, "INSTALL_BATCH_BYTES", 0)
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
        from zenflow.host.tickets import ThreadTicket
        ticket = ThreadTicket()
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


def test_reads_right_after_the_engines_step_see_the_installed_weights():
    """An EMA of the weights right after engine.step() (also parameters_to_vector, a copy, a
    .data clamp): the engine finishes its installs in step(), so the EMA equals the one of the
    same training with a bare optimizer (it differed by 0.013 when the engine attached its model
    and the installs landed in the next forward). Attaching stays the script's choice, undone by
    close()."""
    from helpers.engine_toys import batch, config, make_model

    def ema_after(engine_or_none):
        model = make_model()
        if engine_or_none:
            engine, opt, _, _ = zenflow.initialize(model=model, config=config("zenflow"))
            assert model not in opt._installs._attached
        else:
            opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, weight_decay=0.01,
                                       topk_ratio=0.05, update_interval=4, overlap_step=True,
                                       select_strategy="auto", select_interval="auto")
        ema = [p.detach().clone() for p in model.parameters()]
        for step in range(9):
            x, y = batch(step, 8)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if engine_or_none:
                engine.backward(loss)
                engine.step()
            else:
                loss.backward()
                opt.step()
                opt.zero_grad()
            for e, p in zip(ema, model.parameters()):
                e.mul_(0.9).add_(p.detach(), alpha=0.1)
        if engine_or_none:
            opt.attach(model)
            assert model in opt._installs._attached
            engine.close()
            assert model not in opt._installs._attached
        else:
            opt.close()
        return ema

    for a, b in zip(ema_after(True), ema_after(False)):
        assert torch.equal(a, b)


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


def _encoder():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0,
                                             batch_first=True)
    return torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                               torch.nn.Linear(16, 4))


def _train_encoder(attach: bool, steps: int = 12, credit: str = "mean"):
    model = _encoder()
    opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2,
                               worker=False, deferred_credit=credit, device_sum_budget=ALL)
    if attach:
        opt.attach(model)
    gen = torch.Generator().manual_seed(1)
    with opt:
        for _ in range(steps):
            model(torch.randn(3, 5, 16, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("credit", ["mean", "moments"])
def test_weights_read_inside_their_block_but_not_by_their_owner_see_the_install(credit):
    """nn.MultiheadAttention reads out_proj.weight without calling out_proj: attached by block
    (each encoder layer finishes every install inside it), training equals the unattached run bit
    for bit (it differed by 0.041 when each weight's own module waited)."""
    for a, b in zip(_train_encoder(True, credit=credit), _train_encoder(False, credit=credit)):
        assert torch.equal(a, b)


def test_install_units_are_the_repeated_blocks_and_the_other_children():
    from zenflow.optim.model_hooks import install_units
    model = _encoder()
    params = [p for p in model.parameters() if p.ndim >= 2]
    units = install_units(model, {p: i for i, p in enumerate(params)}, sharded=False)
    encoder_layers = list(model[0].layers)
    assert set(units) == {*encoder_layers, model[1]}
    for layer in encoder_layers:   # out_proj's weight goes with the layer, not with out_proj
        assert {params[i] for i in units[layer]} == {p for p in layer.parameters() if p.ndim >= 2}


def test_a_forward_that_read_an_unfinished_install_is_found_and_stops_happening(caplog):
    """The model compiled after attach(): its graph has no hooks, so the forward after a window
    end reads the previous values. The next step() finds it (the matrices have gradients, their
    installs are still pending), warns, and finishes that model's installs in the step from then
    on: from the next window on, training matches the unattached run's updates again."""
    import logging

    def train(attach: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
        opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25,
                                   update_interval=2, worker=False)
        if attach:
            opt.attach(model)
        gen = torch.Generator().manual_seed(1)
        with opt:
            for _ in range(8):
                out = torch.randn(4, 16, generator=gen)
                for layer in model:   # a forward that runs no module hook, as a compiled one
                    out = torch.nn.functional.linear(out, layer.weight, layer.bias)
                out.square().mean().backward()
                opt.step()
                opt.zero_grad()
            hooks = opt._installs._attached.get(model)
            return (hooks.finishes_in_step if hooks is not None else None)

    with caplog.at_level(logging.WARNING, logger="zenflow"):
        assert train(True) is True
    warnings = [r.getMessage() for r in caplog.records if "before their install" in r.getMessage()]
    assert len(warnings) == 1
