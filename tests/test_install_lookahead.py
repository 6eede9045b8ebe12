"""install_lookahead: installed weights lead the host's values by a fraction of the next step;
the host's values stay exact (docs/semantics.md, "Window end")."""
import pytest
import torch

import zenflow
from zenflow.optim.reference import ReferenceZenFlow

from helpers.models import MODELS
from helpers.reference import SHAPES, random_case, run_pair
from helpers.state_dict_runs import KW, run, run_once


@pytest.mark.parametrize("seed", range(200, 216))
def test_lookahead_matches_reference(seed):
    """Random settings (reselection, warm-up, clipping, overlap, missing gradients, a decaying
    learning rate, either credit), the fast optimizer against the reference."""
    case = random_case(seed)
    case.update(install_lookahead=[0.5, 1.0][seed % 2],
                deferred_credit=["mean", "window"][(seed // 2) % 2])
    run_pair(case, seed)


@pytest.mark.parametrize("overlap", [False, True])
def test_synchronize_installs_the_exact_values(overlap):
    """After synchronize() the weights are the host's values (the reference's masters), not the
    lookahead; training then goes on as the reference does."""
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen) for s in SHAPES]
    params = [v.clone().requires_grad_() for v in values]
    ref_params = [v.clone() for v in values]
    kw = dict(lr=0.02, topk_ratio=0.3, update_interval=3, overlap_step=overlap,
              install_lookahead=1.0, deferred_credit="window")
    opt = zenflow.ZenFlowAdamW(params, **kw, select_strategy="step", select_interval=10 ** 6)
    ref = ReferenceZenFlow(ref_params, **kw)
    for t in range(11):
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        ref.step([g.clone() for g in grads])
        if t in (4, 8):
            before = [p.detach().clone() for p in params]
            opt.synchronize()
            ref.synchronize()
            changed = any(not torch.equal(a, p) for a, p in zip(before, params))
            # With overlap the installed weights led the host's values; without, nothing is
            # stale, nothing leads, and synchronize() has nothing to change.
            assert changed == overlap, f"synchronize() changed the weights: {changed}"
        for i, (p, r) in enumerate(zip(params, ref_params)):
            torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {t}, param {i}: {m}")
    opt.close()


@pytest.mark.parametrize("credit", ["mean", "moments"])
def test_close_leaves_the_trained_weights_as_synchronize_does(credit):
    """Issue 40 item 8: torch's optimizers leave trained weights after the last step(); a bare
    ZenFlowAdamW closed (or left through its `with` block) installs the update in flight and the
    host's values first, exactly what synchronize() installs."""
    def run(finish):
        gen = torch.Generator().manual_seed(0)
        params = [torch.randn(s, generator=gen).requires_grad_() for s in SHAPES]
        with zenflow.ZenFlowAdamW(params, lr=0.02, topk_ratio=0.3, update_interval=3,
                                  overlap_step=True, deferred_credit=credit,
                                  device_sum_budget=10 ** 6, worker=False) as opt:
            for _ in range(8):   # the window that ended at step 5 is in flight
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen)
                opt.step()
            finish(opt)
        return [p.detach().clone() for p in params]
    stale = run(lambda opt: None)
    synchronized = run(lambda opt: opt.synchronize())

    def left_open(opt):   # what the weights were before close() ran
        left_open.weights = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    run(left_open)
    assert all(torch.equal(a, b) for a, b in zip(stale, synchronized))
    assert not all(torch.equal(a, b) for a, b in zip(left_open.weights, synchronized))


def steady(overlap: bool):
    """One matrix, U=2, no device columns, lookahead 1, and a step() that feeds it a gradient of
    ones (each AdamW step then moves it by exactly -lr = -0.01)."""
    w = torch.nn.Parameter(torch.zeros(4, 8))
    opt = zenflow.ZenFlowAdamW([w], lr=1e-2, weight_decay=0.0, topk_ratio=0.0, update_interval=2,
                               overlap_step=overlap, install_lookahead=1.0, worker=False)

    def step(n: int = 1) -> None:
        for _ in range(n):
            w.grad = torch.ones_like(w)
            opt.step()
    return w, opt, step


def test_lookahead_leads_along_the_step():
    """A steady gradient: an update installed one window late is one step ahead of the host's
    value it came from; synchronize() shows the host's values themselves."""
    w, opt, step = steady(overlap=True)
    with opt:
        step(4)
        # window 1's host value is -0.01; installed at the end of window 2, leading by a step
        torch.testing.assert_close(w.detach(), torch.full_like(w, -2e-2))
        step()
        opt.synchronize()   # window 2's host value, -0.02, without a lead
        torch.testing.assert_close(w.detach(), torch.full_like(w, -2e-2))
        step()              # window 3 ends: window 2's update was installed, now in flight: 3
        opt.synchronize()
        torch.testing.assert_close(w.detach(), torch.full_like(w, -3e-2))


def test_lookahead_leaves_a_synchronous_install_alone():
    """Without overlap nothing is stale, so nothing leads: the installed weights are the host's."""
    w, opt, step = steady(overlap=False)
    with opt:
        step(2)
        torch.testing.assert_close(w.detach(), torch.full_like(w, -1e-2))


@pytest.mark.slow   # 12 s a case under load on 2 cores, as test_state_dict's resumes
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("resume_at", [5, 7, 10])
def test_resume_with_lookahead_is_bit_exact(overlap, resume_at):
    make, loss_fn = MODELS["transformer_block"]
    kwargs = dict(KW, overlap_step=overlap, install_lookahead=0.5, deferred_credit="window")
    straight, straight_stats = run_once(make, loss_fn, kwargs, steps=16)
    resumed, _ = run(make, loss_fn, kwargs, steps=16, resume_at=resume_at)
    assert straight_stats["reselections"] > 0
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("value", [-0.5, float("nan"), 5.0, "1"])
def test_bad_lookahead_is_refused_by_name(value):
    w = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises((ValueError, TypeError), match="install_lookahead"):
        zenflow.ZenFlowAdamW([w], install_lookahead=value)
