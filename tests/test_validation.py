"""Bad input fails before any work with an error naming the argument; bad steps change nothing."""
import copy

import pytest
import torch

import zenflow
from conftest import MODELS


def fresh():
    return MODELS["mlp"][0]()


BAD_ARGUMENTS = [
    (dict(lr=-1.0), ValueError, "lr must be >= 0"),
    (dict(lr="fast"), TypeError, "lr must be a number"),
    (dict(betas=(0.9, 1.0)), ValueError, r"betas\[1\] must be < 1"),
    (dict(betas=0.9), TypeError, "betas must be a pair"),
    (dict(eps=-1e-8), ValueError, "eps must be >= 0"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay must be >= 0"),
    (dict(topk_ratio=1.5), ValueError, "topk_ratio must be between 0.0 and 1.0, got 1.5"),
    (dict(topk_ratio=-0.1), ValueError, "topk_ratio must be between"),
    (dict(update_interval=0), ValueError, "update_interval must be >= 1, got 0"),
    (dict(update_interval=2.5), TypeError, "update_interval must be an integer"),
    (dict(update_interval="sometimes"), ValueError, "update_interval must be an integer >= 1 or \"auto\""),
    (dict(select_interval="often"), ValueError, "select_interval must be an integer >= 1 or \"auto\""),
    (dict(select_interval=0), ValueError, "select_interval must be >= 1"),
    (dict(select_strategy="random"), ValueError, "select_strategy must be one of"),
    (dict(select_strategy="epoch", select_interval=2), ValueError, "needs steps_per_epoch"),
    (dict(full_warm_up_rounds=-1), ValueError, "full_warm_up_rounds must be >= 0"),
    (dict(full_warm_up_rounds=True), TypeError, "full_warm_up_rounds must be an integer"),
    (dict(overlap_step="yes"), TypeError, "overlap_step must be True or False"),
    (dict(max_grad_norm=0.0), ValueError, "max_grad_norm must be > 0"),
    (dict(importance="l3"), ValueError, "importance must be one of 'l2', 'l1'"),
    (dict(pt_reserved_cores_perc=2.0), ValueError, "pt_reserved_cores_perc must be between"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD_ARGUMENTS)
def test_bad_arguments_are_named(kwargs, error, message):
    model = fresh()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(error, match=message):
        zenflow.ZenFlowAdamW(model.parameters(), **kwargs)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])


def test_bad_group_hyperparameters_are_named():
    model = fresh()
    with pytest.raises(ValueError, match="lr must be >= 0"):
        zenflow.ZenFlowAdamW([{"params": model[0].parameters(), "lr": -3.0},
                              {"params": model[2].parameters()}])


@pytest.mark.parametrize("cls", [zenflow.ZenFlowAdamW, zenflow.OffloadAdamW])
def test_bad_parameters_are_named(cls):
    model = fresh()
    model[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"params\[0\] .* does not require grad"):
        cls(model.parameters())
    with pytest.raises(ValueError, match="params is empty"):
        cls([])
    with pytest.raises(TypeError, match="dtype torch.int64"):
        cls([torch.zeros(3, dtype=torch.long)])
    meta = torch.nn.Parameter(torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match="all params must be on one device"):
        cls([torch.nn.Parameter(torch.zeros(3)), meta])


def test_offload_rejects_bad_hyperparameters():
    with pytest.raises(ValueError, match="OffloadAdamW: lr must be >= 0"):
        zenflow.OffloadAdamW(fresh().parameters(), lr=-1)
    with pytest.raises(ValueError, match="OffloadAdamW: max_grad_norm must be > 0"):
        zenflow.OffloadAdamW(fresh().parameters(), max_grad_norm=-1)


def snapshot(model, opt):
    return copy.deepcopy(model.state_dict()), opt.state_dict()


def assert_same_entries(after: dict, before: dict, where=()) -> None:
    """Every tensor equal and every other value equal, through nested dicts."""
    assert after.keys() == before.keys(), where
    for key, value in before.items():
        if isinstance(value, dict):
            assert_same_entries(after[key], value, (*where, key))
        elif torch.is_tensor(value):
            assert torch.equal(after[key], value), (*where, key)
        else:
            assert after[key] == value, (*where, key)


def assert_unchanged(before, model, opt):
    model_before, opt_before = before
    for name, value in model.state_dict().items():
        assert torch.equal(value, model_before[name]), name
    after = opt.state_dict()
    assert_same_entries(after["state"], opt_before["state"])
    skipped_key = "zenflow" if "zenflow" in after else "offload"
    changed = {k for k in after[skipped_key] if after[skipped_key][k] != opt_before[skipped_key][k]}
    assert changed == {"skipped_steps"}


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("make_opt", [
    lambda ps: zenflow.ZenFlowAdamW(ps, topk_ratio=0.3, update_interval=2, overlap_step=True),
    lambda ps: zenflow.ZenFlowAdamW(ps, topk_ratio=0.3, update_interval=1, max_grad_norm=1.0,
                                    full_warm_up_rounds=5),
    lambda ps: zenflow.OffloadAdamW(ps),
])
def test_non_finite_gradient_skips_the_step(bad, make_opt):
    model = fresh()
    opt = make_opt(model.parameters())
    loss_fn = MODELS["mlp"][1]
    for t in range(3):
        opt.zero_grad()
        loss_fn(model, t).backward()
        opt.step()
    opt.zero_grad()
    loss_fn(model, 3).backward()
    model[2].weight.grad[1, 2] = bad
    before = snapshot(model, opt)
    opt.step()
    assert opt.skipped_steps == 1
    assert_unchanged(before, model, opt)
    # and training goes on normally afterwards
    opt.zero_grad()
    loss_fn(model, 4).backward()
    opt.step()
    assert opt.stats()["skipped_steps"] == 1
    opt.close()


def test_step_without_gradients_is_a_no_op():
    model = fresh()
    opt = zenflow.ZenFlowAdamW(model.parameters())
    before = snapshot(model, opt)
    opt.step()
    model_before, _ = before
    for name, value in model.state_dict().items():
        assert torch.equal(value, model_before[name])
    assert opt.stats()["steps"] == 0
    opt.close()


def test_step_after_close_raises():
    model = fresh()
    opt = zenflow.ZenFlowAdamW(model.parameters())
    opt.close()
    opt.close()  # idempotent
    MODELS["mlp"][1](model, 0).backward()
    with pytest.raises(RuntimeError, match="after close"):
        opt.step()
