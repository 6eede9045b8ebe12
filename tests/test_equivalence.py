"""docs/semantics.md's equivalences against torch.optim.AdamW, on real models and data."""
import copy

import pytest
import torch

import zenflow

from helpers.equivalence import HP, STEPS, assert_models_close, matrices, train, train_accumulating, vectors
from helpers.models import MODELS


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("overlap", [False, True])
def test_topk_one_is_adamw(model_name, overlap):
    make, loss_fn = MODELS[model_name]
    model, twin = make(), make()
    with zenflow.ZenFlowAdamW(model.parameters(), **HP, topk_ratio=1.0, update_interval=3,
                              overlap_step=overlap, select_strategy="step",
                              select_interval=5) as opt:
        train(model, loss_fn, opt)
    train(twin, loss_fn, torch.optim.AdamW(twin.parameters(), **HP))
    assert_models_close(model, twin)


@pytest.mark.slow   # seconds on 2 cores, not milliseconds (--durations=0)
@pytest.mark.parametrize("model_name", MODELS)
def test_topk_zero_interval_one_is_adamw(model_name):
    make, loss_fn = MODELS[model_name]
    model, twin = make(), make()
    with zenflow.ZenFlowAdamW(model.parameters(), **HP, topk_ratio=0.0, update_interval=1,
                              overlap_step=False) as opt:
        train(model, loss_fn, opt)
    train(twin, loss_fn, torch.optim.AdamW(twin.parameters(), **HP))
    assert_models_close(model, twin)


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("interval", [2, 5])
def test_topk_zero_is_gradient_accumulation(model_name, interval):
    """Matrices: AdamW every `interval` steps on the mean gradient. Vectors: AdamW every step."""
    make, loss_fn = MODELS[model_name]
    model, twin = make(), make()
    with zenflow.ZenFlowAdamW(model.parameters(), **HP, topk_ratio=0.0,
                              update_interval=interval, overlap_step=False) as opt:
        train(model, loss_fn, opt)

    train_accumulating(twin, loss_fn, interval)
    assert_models_close(model, twin)


@pytest.mark.parametrize("model_name", MODELS)
def test_topk_zero_overlap_is_delayed_adamw(model_name):
    """Each step's matrix update becomes visible one step later (ZeRO-Offload's DPU)."""
    make, loss_fn = MODELS[model_name]
    model, twin = make(), make()
    with zenflow.ZenFlowAdamW(model.parameters(), **HP, topk_ratio=0.0, update_interval=1,
                              overlap_step=True, install_lookahead=0.0) as opt:
        train(model, loss_fn, opt)
        delayed = copy.deepcopy(model)   # before close() installs the last step's update

    shadow = [p.detach().clone().requires_grad_() for p in matrices(twin)]
    vec_opt = torch.optim.AdamW(vectors(twin), **HP)
    shadow_opt = torch.optim.AdamW(shadow, **HP)
    for t in range(STEPS):
        twin.zero_grad()
        loss_fn(twin, t).backward()
        vec_opt.step()
        previous = [s.detach().clone() for s in shadow]
        for s, p in zip(shadow, matrices(twin)):
            s.grad = p.grad.clone()
        shadow_opt.step()
        if t > 0:  # the first step's update is installed at the end of the second
            with torch.no_grad():
                for p, prev in zip(matrices(twin), previous):
                    p.copy_(prev)
    assert_models_close(delayed, twin)
    # close() installed the update in flight: the matrices are AdamW's own, undelayed
    for p, s in zip(matrices(model), shadow):
        torch.testing.assert_close(p, s, rtol=1e-5, atol=1e-6)


def test_lr_scheduler_drives_both_sides():
    """The host reads lr from param_groups when a window ends, so schedulers work."""
    make, loss_fn = MODELS["mlp"]
    model, twin = make(), make()
    opt = zenflow.ZenFlowAdamW(model.parameters(), **HP, topk_ratio=0.0, update_interval=1,
                               overlap_step=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.3)
    ref = torch.optim.AdamW(twin.parameters(), **HP)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=5, gamma=0.3)
    for t in range(STEPS):
        for o, m, s in ((opt, model, sched), (ref, twin, ref_sched)):
            o.zero_grad()
            loss_fn(m, t).backward()
            o.step()
            s.step()
    opt.close()
    assert_models_close(model, twin)


@pytest.mark.slow   # seconds on 2 cores, not milliseconds (--durations=0)
def test_clipping_matches_clip_grad_norm():
    make, loss_fn = MODELS["transformer_block"]
    model, twin = make(), make()
    opt = zenflow.ZenFlowAdamW(model.parameters(), **HP, topk_ratio=1.0, max_grad_norm=0.05)
    ref = torch.optim.AdamW(twin.parameters(), **HP)
    for t in range(STEPS):
        opt.zero_grad()
        loss_fn(model, t).backward()
        opt.step()
        ref.zero_grad()
        loss_fn(twin, t).backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.05)
        ref.step()
    opt.close()
    assert_models_close(model, twin)


@pytest.mark.slow   # seconds on 2 cores, not milliseconds (--durations=0)
def test_offload_adamw_is_adamw():
    make, loss_fn = MODELS["transformer_block"]
    model, twin = make(), make()
    train(model, loss_fn, zenflow.OffloadAdamW(model.parameters(), **HP))
    train(twin, loss_fn, torch.optim.AdamW(twin.parameters(), **HP))
    assert_models_close(model, twin)


def test_weights_are_never_rewritten_at_construction():
    make, _ = MODELS["transformer_block"]
    model = make()
    before = copy.deepcopy(model.state_dict())
    with zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.3):
        pass
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
