"""The default windows: as short as the host keeps up with, installed with the lookahead.

ZenFlowAdamW's defaults are update_interval="auto" with auto_ratio=None (no importance threshold:
a window ends once the host has finished the previous one's update) and install_lookahead=1.0,
which applies only to updates installed one window later. Checked on the Llama-shaped model
(226 matrices) against the reference, given the optimizer's decisions.
"""
from __future__ import annotations

import pytest
import torch

import zenflow
from zenflow.config.deepspeed_json import parse_config
from zenflow.optim.reference import ReferenceZenFlow
from zenflow.optim.windows import AutoWindow

from helpers.decisions import window_lengths
from helpers.llama import batch, llama


def test_without_a_threshold_a_window_ends_when_the_host_is_ready():
    w = AutoWindow(None, min_steps=1, max_steps=16, overlap=True)
    assert w.should_end(1, host_ready=True, host_seconds=0.0, step_seconds=0.1)
    assert "host ready" in w.reason
    assert not w.should_end(1, host_ready=False, host_seconds=0.0, step_seconds=0.1)
    assert w.should_end(16, host_ready=False, host_seconds=0.0, step_seconds=0.1)  # max_steps
    # the host needs 2.5 steps: never end before 3 steps, even if it reports ready
    assert not w.should_end(2, host_ready=True, host_seconds=0.25, step_seconds=0.1)
    assert w.should_end(3, host_ready=True, host_seconds=0.25, step_seconds=0.1)
    # without overlap every step ends a window (nothing to hide: ZeRO-Offload's schedule)
    sync = AutoWindow(None, min_steps=1, max_steps=16, overlap=False)
    assert sync.should_end(1, host_ready=False, host_seconds=5.0, step_seconds=0.1)


def test_the_defaults_are_host_paced_windows_with_the_lookahead():
    settings = zenflow.ZenFlowAdamW([torch.nn.Parameter(torch.zeros(2, 2))], worker=False).settings
    assert (settings.update_interval, settings.auto_ratio) == ("auto", None)
    assert settings.install_lookahead == 1.0 and settings.overlap_step
    # a DeepSpeed config keeps DeepSpeed's importance threshold; null asks for ours
    def zenflow_block(block):
        config = {"train_batch_size": 8, "zero_optimization": {"stage": 2, "zenflow": block}}
        return parse_config(config, world_size=1).zero_optimization.zenflow

    assert zenflow_block({}).auto_ratio == 0.99
    assert zenflow_block({"auto_ratio": None}).auto_ratio is None


def replay(opt, model, ref, steps, ready=None):
    """Train `model` with `opt`; feed the reference the same gradients and the optimizer's
    decisions; the weights must agree after every step."""
    ref_params = ref.params
    for t in range(steps):
        x, y = batch(t)
        model(x, y).backward()
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        before = len(opt.decisions)
        opt.step()
        opt.zero_grad()
        kinds = {kind for _, kind in opt.decisions[before:]}
        ref.step(grads, flush="flush" in kinds, reselect="reselect" in kinds)
        for p, r in zip(model.parameters(), ref_params):
            torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)
    opt.synchronize()
    ref.synchronize()
    for p, r in zip(model.parameters(), ref_params):
        torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)


@pytest.mark.slow   # the Llama-shaped model against the reference
def test_an_inline_host_gives_one_step_windows_equal_to_the_reference():
    """In process the host is always ready: every window is one step, installed one step late
    with the lookahead (deterministic)."""
    model = llama()
    ref = ReferenceZenFlow([p.detach().clone() for p in model.parameters()], lr=3e-3,
                           update_interval=10 ** 6, overlap_step=True, install_lookahead=1.0)
    with zenflow.ZenFlowAdamW(model.parameters(), lr=3e-3, worker=False) as opt:
        replay(opt, model, ref, steps=8)
        assert window_lengths(opt.decisions) == [1] * 8


@pytest.mark.slow   # the Llama-shaped model against the reference
def test_a_busy_host_lengthens_the_window_and_the_update_lands_whole():
    """While the host is busy the window keeps accumulating; when it ends, the previous update is
    installed whole (the reference, given the same decisions, agrees)."""
    model = llama()
    ref = ReferenceZenFlow([p.detach().clone() for p in model.parameters()], lr=3e-3,
                           update_interval=10 ** 6, overlap_step=True, install_lookahead=1.0)
    with zenflow.ZenFlowAdamW(model.parameters(), lr=3e-3, worker=False,
                              auto_update_bounds=(1, 5), select_strategy="step",
                              select_interval=10 ** 6) as opt:
        busy_at = {2, 4, 5}   # steps at whose end the host is still working
        opt._pipeline.ready = lambda: (opt.counters.step not in busy_at
                                       or opt._pipeline.in_flight is None)
        replay(opt, model, ref, steps=10)
        lengths = window_lengths(opt.decisions)
    assert lengths == [1, 1, 2, 3, 1, 1, 1]


@pytest.mark.slow   # the Llama-shaped model against the reference
@pytest.mark.parametrize("worker", [True, False])
def test_with_the_worker_the_decisions_replay_exactly(worker):
    """The worker's timing decides the windows; whatever it decides, the weights are the
    reference's for those decisions."""
    model = llama(seed=1)
    ref = ReferenceZenFlow([p.detach().clone() for p in model.parameters()], lr=3e-3,
                           update_interval=10 ** 6, overlap_step=True, install_lookahead=1.0)
    with zenflow.ZenFlowAdamW(model.parameters(), lr=3e-3, worker=worker) as opt:
        replay(opt, model, ref, steps=6)
        assert all(1 <= n <= 16 for n in window_lengths(opt.decisions))


@pytest.mark.slow   # the Llama-shaped model
def test_the_lookahead_leaves_synchronous_installs_exact():
    """Nothing is stale without overlap: with the default lookahead, k=0 and U=1 is AdamW."""
    model, reference = llama(), llama()
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    with zenflow.ZenFlowAdamW(model.parameters(), lr=1e-3, topk_ratio=0.0, update_interval=1,
                              overlap_step=False, worker=False) as opt:
        assert opt.settings.install_lookahead == 1.0
        for t in range(4):
            for m, o in ((model, opt), (reference, adamw)):
                x, y = batch(t)
                m(x, y).backward()
                o.step()
                o.zero_grad()
            for p, q in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_slow_install_lengthens_the_window():
    """Installing a window's update is a copy the device waits for: windows grow until it takes
    at most WINDOW_BUDGET of their time."""
    from zenflow.optim.windows import WINDOW_BUDGET
    w = AutoWindow(None, min_steps=1, max_steps=16, overlap=True)
    install = 4 * WINDOW_BUDGET * 0.1      # four steps' budget
    assert w.hide_steps(0.0, 0.1, install) == 4
    assert not w.should_end(3, True, 0.0, 0.1, install)
    assert w.should_end(4, True, 0.0, 0.1, install)
    assert w.hide_steps(0.35, 0.1, install) == 4 and w.hide_steps(0.45, 0.1, install) == 5


def test_a_windows_own_work_counts_with_its_install_but_not_under_emulation():
    """What a window costs whatever its length is its install and its own work (fingerprints,
    queueing): together they stay within WINDOW_BUDGET. An emulated GPU's host counts no
    window work (this CPU's passes are not a GPU's)."""
    from zenflow.optim.windows import WINDOW_BUDGET
    w = AutoWindow(None, min_steps=1, max_steps=16, overlap=True)
    budget = WINDOW_BUDGET * 0.1      # a step's share
    assert w.hide_steps(0.0, 0.1, 2 * budget, 3 * budget) == 5
    assert not w.should_end(4, True, 0.0, 0.1, 2 * budget, 3 * budget)
    assert w.should_end(5, True, 0.0, 0.1, 2 * budget, 3 * budget)
    w.emulated_host_steps = 2
    assert w.hide_steps(0.0, 0.1, 3 * budget, 9 * budget) == 3


def test_slow_window_work_lengthens_the_windows_with_the_worker():
    """A window end that takes the device 60 ms (here its fingerprints, slowed) beside steps of
    a few milliseconds: the auto windows grow to their longest, and the rule is given that
    time, less no install wait (`stats()["last_window_work_s"]`). Before the window's work
    counted, these windows stayed one or two steps long."""
    import time
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, auto_update_bounds=(1, 6),
                               select_strategy="step", select_interval=10 ** 6)
    fingerprint = opt._outside_writes.fingerprint
    opt._outside_writes.fingerprint = lambda *a, **k: (time.sleep(0.06), fingerprint(*a, **k))[1]
    given = []
    should_end = opt._window.should_end
    opt._window.should_end = lambda *args: (given.append(args[5]), should_end(*args))[1]
    try:
        for _ in range(20):
            model(torch.randn(8, 32)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        work = opt.stats()["last_window_work_s"]
        assert work >= 0.06 and given[-1] == work
        assert window_lengths(opt.decisions)[-2:] == [6, 6]
    finally:
        opt.close()


def test_without_a_copy_thread_an_install_copy_counts_as_waited_for():
    """A CPU "device" without worker cores copies at once: the training thread waits for it."""
    from zenflow.host.transfers import Transfers
    transfers = Transfers(torch.device("cpu"))
    assert transfers.last_install_wait_seconds == 0.0
    dst, src = torch.zeros(1 << 22), torch.ones(1 << 22)
    transfers.new_install()
    transfers.to_device([(dst, src)])
    assert transfers.last_install_wait_seconds > 0.0 and torch.equal(dst, src)
    transfers.close()


def test_a_windows_own_work_is_timed_less_the_install_waits_inside_it():
    """On a CPU "device" the window's work is the training thread's seconds in it, less the
    install copies it waited for (those count as the install's), and it is read only once the
    window has ended."""
    import time

    from zenflow.host.transfers import Transfers
    transfers = Transfers(torch.device("cpu"))
    dst, src = torch.zeros(1 << 23), torch.ones(1 << 23)
    began = time.perf_counter()
    with transfers.window_work():
        time.sleep(0.05)
        transfers.new_install()
        transfers.to_device([(dst, src)])
    waited = transfers.last_install_wait_seconds
    assert waited > 0.0 and transfers.last_window_work_seconds == 0.0   # not ended yet
    with transfers.window_work(ends=True):   # the window's end: nothing more
        pass
    work = transfers.last_window_work_seconds
    assert 0.05 <= work and work + waited <= time.perf_counter() - began
    with transfers.window_work():   # the next window's, not read until it ends
        time.sleep(0.01)
    assert transfers.last_window_work_seconds == work
    transfers.close()


def test_an_emulated_slow_host_gives_the_windows_a_gpu_runs():
    """Benchmarks emulate a GPU's speed ratio (the host several device steps behind) on a CPU
    machine, whose host keeps up after one step: the auto windows then cover that many steps."""
    from zenflow.tools.finetune.optim import make_optimizer
    w = AutoWindow(None, min_steps=1, max_steps=16, overlap=True)
    w.emulated_host_steps = 5
    assert w.hide_steps(0.0, 0.1) == 5 and w.hide_steps(0.0, 0.0) == 5
    assert w.hide_steps(0.9, 0.1) == 9            # a host slower than emulated still counts
    assert not w.should_end(4, True, 0.0, 0.1) and w.should_end(5, True, 0.0, 0.1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    # In process (worker=False) the real host takes no time that windows must hide, so a loaded
    # machine cannot lengthen them: the windows are the emulation's alone.
    opt = make_optimizer("zenflow", model.parameters(), lr=1e-2, emulated_host_steps=3,
                         worker=False)
    try:
        for _ in range(12):
            model(torch.randn(8, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            assert opt.stats()["last_window_steps"] in (None, 3)
        assert opt.stats()["windows"] == 4
    finally:
        opt.close()
    with pytest.raises(ValueError, match="update_interval='auto'"):
        make_optimizer("zenflow", model.parameters(), lr=1e-2, update_interval=4,
                       emulated_host_steps=3)
    with pytest.raises(ValueError, match="only ZenFlow's auto windows"):
        make_optimizer("adamw", model.parameters(), lr=1e-2, emulated_host_steps=3)
