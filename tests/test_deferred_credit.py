"""deferred_credit="window": the host step on the mean gradient, with the learning rate times the
number of gradients in the window (docs/semantics.md, "Window end")."""
import pytest
import torch

import zenflow

from helpers.equivalence import HP, assert_models_close, train, train_accumulating
from helpers.models import MODELS
from helpers.reference import random_case, run_pair


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("interval", [2, 5])
def test_topk_zero_window_credit_is_accumulation_at_scaled_lr(model_name, interval):
    """Matrices: AdamW every `interval` steps on the mean gradient at lr * interval (the decoupled
    weight decay scales with it). Vectors: AdamW every step at lr."""
    make, loss_fn = MODELS[model_name]
    model, twin = make(), make()
    with zenflow.ZenFlowAdamW(model.parameters(), **HP, topk_ratio=0.0, update_interval=interval,
                              overlap_step=False, deferred_credit="window") as opt:
        train(model, loss_fn, opt)

    train_accumulating(twin, loss_fn, interval, matrix_lr=HP["lr"] * interval)
    assert_models_close(model, twin)


@pytest.mark.parametrize("overlap", [False, True])
def test_window_credit_changes_nothing_at_interval_one(overlap):
    make, loss_fn = MODELS["mlp"]
    models = [make(), make()]
    for model, credit in zip(models, ("mean", "window")):
        with zenflow.ZenFlowAdamW(model.parameters(), **HP, topk_ratio=0.25, update_interval=1,
                                  overlap_step=overlap, deferred_credit=credit) as opt:
            train(model, loss_fn, opt)
    for a, b in zip(*(m.parameters() for m in models)):
        assert torch.equal(a, b)


def test_window_credit_moves_deferred_columns_further():
    """With a steady gradient, the window's deferred step is `interval` times the mean one."""
    moved = {}
    for credit in ("mean", "window"):
        w = torch.nn.Parameter(torch.zeros(4, 8))
        with zenflow.ZenFlowAdamW([w], lr=1e-2, weight_decay=0.0, topk_ratio=0.0,
                                  update_interval=4, overlap_step=False,
                                  deferred_credit=credit) as opt:
            for _ in range(4):
                w.grad = torch.ones_like(w)
                opt.step()
        moved[credit] = float(w.detach().abs().mean())
    assert moved["mean"] == pytest.approx(1e-2, rel=1e-4)
    assert moved["window"] == pytest.approx(4e-2, rel=1e-4)


@pytest.mark.parametrize("seed", range(100, 116))
def test_window_credit_matches_reference(seed):
    """Random settings (reselection, warm-up, clipping, overlap, missing gradients, a decaying
    learning rate), the fast optimizer against the reference."""
    run_pair({**random_case(seed), "deferred_credit": "window"}, seed)


def test_bad_deferred_credit_is_refused_by_name():
    w = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="deferred_credit.*'mean', 'window'.*'sum'"):
        zenflow.ZenFlowAdamW([w], deferred_credit="sum")
