"""update_interval="auto" and select_interval="auto": they fire, stay in bounds, and replay exactly."""
import logging
import random

import pytest
import torch

import zenflow
from zenflow.optim.reference import ReferenceZenFlow
from zenflow.optim.windows import AutoWindow

from helpers.decisions import window_lengths
from helpers.models import MODELS


def train(opt, model, loss_fn, steps):
    for t in range(steps):
        opt.zero_grad()
        loss_fn(model, t).backward()
        opt.step()


@pytest.mark.slow   # seconds on 2 cores, not milliseconds (--durations=0)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_auto_interval_flushes_sometimes_and_stays_in_bounds(model_name):
    make, loss_fn = MODELS[model_name]
    model = make()
    opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-3, topk_ratio=0.1,
                               update_interval="auto", auto_ratio=0.99,
                               auto_update_bounds=(2, 6), overlap_step=False)
    train(opt, model, loss_fn, 60)
    lengths = window_lengths(opt.decisions)
    assert 0 < opt.num_windows < 60
    assert all(2 <= n <= 6 for n in lengths), lengths
    assert opt.stats()["last_window_steps"] in range(2, 7)
    opt.close()


def test_auto_interval_follows_the_deferred_share():
    """The more gradient sits in the deferred columns, the shorter the windows."""
    def mean_window(deferred_scale):
        gen = torch.Generator().manual_seed(0)
        p = torch.zeros(16, 40, requires_grad=True)
        opt = zenflow.ZenFlowAdamW([p], lr=1e-3, topk_ratio=0.1, update_interval="auto",
                                   auto_ratio=0.99, auto_update_bounds=(1, 32), overlap_step=False,
                                   select_strategy="step", select_interval=10 ** 6)
        for t in range(96):
            g = torch.randn(16, 40, generator=gen) * deferred_scale
            g[:, :4] = torch.randn(16, 4, generator=gen) * 10  # the selected columns
            p.grad = g
            opt.step()
        opt.close()
        lengths = window_lengths(opt.decisions)
        return sum(lengths) / len(lengths)

    quiet, loud = mean_window(0.5), mean_window(4.0)
    assert loud < quiet
    assert 1 <= loud < 4 and 10 <= quiet <= 32, (loud, quiet)


def test_auto_window_prefers_a_longer_window_to_a_stall():
    w = AutoWindow(threshold=1.0, min_steps=1, max_steps=8, overlap=True)
    w.observe(deferred_sq=100.0, deferred_cols=1, selected_sq=1.0, selected_cols=1)  # r = 10
    # criterion met, but the host update takes 3 steps to hide: not before step 3
    assert not w.should_end(2, host_ready=True, host_seconds=0.3, step_seconds=0.1)
    assert w.should_end(3, host_ready=True, host_seconds=0.3, step_seconds=0.1)
    # host still busy: keep accumulating rather than stall, until the bound
    assert not w.should_end(5, host_ready=False, host_seconds=0.0, step_seconds=0.1)
    assert w.should_end(8, host_ready=False, host_seconds=0.0, step_seconds=0.1)
    # without overlap there is nothing to hide
    w2 = AutoWindow(threshold=1.0, min_steps=1, max_steps=8, overlap=False)
    w2.observe(100.0, 1, 1.0, 1)
    assert w2.should_end(1, host_ready=False, host_seconds=5.0, step_seconds=0.1)


def synthetic_run(switch_at, steps=80, seed=0):
    """A matrix whose important columns are 0-3 until `switch_at`, then 20-23."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.zeros(12, 40, requires_grad=True)
    opt = zenflow.ZenFlowAdamW([p], lr=1e-3, topk_ratio=0.1, update_interval=2,
                               select_interval="auto", overlap_step=True)
    for t in range(steps):
        g = torch.randn(12, 40, generator=gen)
        hot = slice(0, 4) if t < switch_at else slice(20, 24)
        g[:, hot] *= 8
        p.grad = g
        opt.step()
    opt.close()
    return opt


def test_auto_reselection_reacts_to_drift_only():
    stable = synthetic_run(switch_at=10 ** 6)
    assert stable.num_reselections == 0
    assert stable.stats()["retained_importance"] > 0.9
    moved = synthetic_run(switch_at=40)
    reselections = [s for s, kind in moved.decisions if kind == "reselect"]
    assert len(reselections) >= 1 and all(s >= 40 for s in reselections)
    # checks back off while stable, so the reaction comes within the longest check gap
    assert reselections[0] <= 40 + 2 * 8 + 2


def test_auto_decisions_are_logged(caplog):
    with caplog.at_level(logging.DEBUG, logger="zenflow"):
        synthetic_run(switch_at=20, steps=40)
    text = caplog.text
    assert "end window" in text and "reselect (retained importance" in text
    assert "keep selection" in text


@pytest.mark.parametrize("seed", range(12))
def test_all_auto_matches_reference_given_decisions(seed):
    rng = random.Random(seed)
    shapes = [(6, 10), (4, 3, 3), (8,)]
    warm_up = rng.randint(0, 2)
    kw = dict(lr=0.02, topk_ratio=rng.choice([0.1, 0.3, 0.5]), full_warm_up_rounds=warm_up,
              overlap_step=rng.random() < 0.5,
              max_grad_norm=rng.choice([None, 2.0]))
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(s, generator=gen) for s in shapes]
    params = [v.clone().requires_grad_() for v in values]
    ref_params = [v.clone() for v in values]
    opt = zenflow.ZenFlowAdamW(params, **kw, update_interval="auto", select_interval="auto",
                               auto_update_bounds=(1, 5))
    ref = ReferenceZenFlow(ref_params, **kw, update_interval=10 ** 6)
    for t in range(30):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        grads[0][:, (t // 10) * 3] *= 10  # drifting importance
        for p, g in zip(params, grads):
            p.grad = g.clone()
        before = len(opt.decisions)
        opt.step()
        kinds = {kind for _, kind in opt.decisions[before:]}
        ref.step([g.clone() for g in grads], flush="flush" in kinds,
                 reselect="reselect" in kinds)
        for p, r in zip(params, ref_params):
            torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)
    assert opt.num_windows > 2
    opt.close()


@pytest.mark.slow   # seconds on 2 cores, not milliseconds (--durations=0)
def test_warm_up_works_with_every_strategy():
    for kwargs in (dict(select_strategy="step", select_interval=3),
                   dict(select_strategy="epoch", select_interval=1, steps_per_epoch=4),
                   dict(select_strategy="auto", select_interval="auto"),
                   dict(select_strategy="drift", select_interval="auto"),
                   dict(update_interval="auto")):
        make, loss_fn = MODELS["mlp"]
        model = make()
        opt = zenflow.ZenFlowAdamW(model.parameters(), full_warm_up_rounds=3, **kwargs)
        train(opt, model, loss_fn, 12)
        flushes = [s for s, k in opt.decisions if k == "flush"]
        assert flushes[:3] == [0, 1, 2], kwargs       # warm-up: every step is a full update
        assert ("select" in {k for _, k in opt.decisions}) and \
            [s for s, k in opt.decisions if k == "select"] == [3], kwargs
        opt.close()


def test_bad_auto_settings_are_named():
    params = MODELS["mlp"][0]().parameters()
    with pytest.raises(ValueError, match="auto_update_bounds must have min <= max"):
        zenflow.ZenFlowAdamW(params, update_interval="auto", auto_update_bounds=(5, 2))
    # DeepSpeed's bounds, [0, 1]: 0 is allowed (issue 26), above 1 is not.
    with pytest.raises(ValueError, match="auto_ratio must be between 0.0 and 1.0, got 1.5"):
        zenflow.ZenFlowAdamW(MODELS["mlp"][0]().parameters(), auto_ratio=1.5)


def test_auto_ratio_zero_ends_each_window_as_soon_as_the_bounds_allow():
    """auto_ratio 0, which DeepSpeed's [0, 1] allows: no importance needs to gather, so each
    window is min_steps long (without overlap nothing else holds it back)."""
    make, loss_fn = MODELS["mlp"]
    model = make()
    with zenflow.ZenFlowAdamW(model.parameters(), lr=1e-3, topk_ratio=0.1, update_interval="auto",
                              auto_ratio=0.0, auto_update_bounds=(2, 16), overlap_step=False,
                              worker=False) as opt:
        train(opt, model, loss_fn, 12)
    assert window_lengths(opt.decisions) == [2] * 6


def test_retained_masses_are_each_matrixs_held_and_best_importance_summed():
    """The drift check's batched sums (matrices grouped by columns and k) against each matrix's
    own: the importance its selected columns hold, and its best k columns', summed in double."""
    from zenflow.optim.importance import retained_masses
    gen = torch.Generator().manual_seed(3)
    shapes = [(8, 2), (8, 2), (5, 1), (8, 3), (8, 2), (4, 0)]   # (columns, k): groups and a k=0
    importances = [torch.rand(c, generator=gen) for c, _ in shapes]
    selected = [torch.randperm(c, generator=gen)[:k].sort().values for c, k in shapes]
    held = sum(float(imp[sel].double().sum()) for imp, sel in zip(importances, selected))
    best = sum(float(imp.double().topk(k).values.sum()) if k else 0.0
               for imp, (_, k) in zip(importances, shapes))
    got = retained_masses(importances, selected, [k for _, k in shapes])
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx([held, best], rel=1e-6)
    assert retained_masses([torch.rand(3)], [torch.zeros(0, dtype=torch.long)], [0]).tolist() == \
        [0.0, 0.0]


def _reselecting_run(monkeypatch, caplog, move_s: float, other_s: float) -> dict:
    """A matrix reselected every other step, each reselection's moves taking `move_s` and each
    step's forward and backward `other_s` (sleeps); returns stats()."""
    import time

    from zenflow.optim import handoff
    move = handoff.move_columns
    monkeypatch.setattr(handoff, "move_columns", lambda *a: (time.sleep(move_s), move(*a))[1])
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(8, 16, generator=gen))
    with caplog.at_level(logging.WARNING, logger="zenflow"), \
            zenflow.ZenFlowAdamW([param], lr=1e-3, worker=False, topk_ratio=0.25, update_interval=1,
                                 select_strategy="step", select_interval=2) as opt:
        for _ in range(8):
            time.sleep(other_s)
            param.grad = torch.randn(8, 16, generator=gen)
            opt.step()
        return opt.stats()


def test_costly_reselections_are_timed_and_reported_once_with_an_interval(monkeypatch, caplog):
    stats = _reselecting_run(monkeypatch, caplog, move_s=0.05, other_s=0.0)
    assert stats["reselections"] == 3
    assert stats["last_reselect_s"] >= 0.05 and stats["reselect_s_total"] >= 0.15
    said = [r.getMessage() for r in caplog.records if "reselections took" in r.getMessage()]
    assert len(said) == 1 and "select_interval=" in said[0]
    interval = int(said[0].split("select_interval=")[1].split(",")[0])
    assert interval > 2   # longer than the run's own interval: the cost needs fewer of them


def test_cheap_reselections_are_timed_and_not_reported(monkeypatch, caplog):
    stats = _reselecting_run(monkeypatch, caplog, move_s=0.0, other_s=0.05)
    assert stats["reselections"] == 3 and 0 < stats["reselect_s_total"] < 0.1
    assert not [r for r in caplog.records if "reselections took" in r.getMessage()]
