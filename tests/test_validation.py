"""Bad input fails before any work with an error naming the argument; bad steps change nothing."""
import copy

import pytest
import torch

import zenflow

from helpers.models import MODELS


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
    (dict(select_strategy="drift", select_interval=4), ValueError,
     r"select_interval must be 'auto' with select_strategy=\"drift\" .*got 4; for every 4 steps "
     r"use select_strategy=\"step\""),
    (dict(select_interval=4), ValueError, r"select_interval must be 'auto' with select_strategy="),
    (dict(select_strategy="auto", select_interval=4), ValueError,
     r"select_interval must be 'auto' with select_strategy=\"auto\" \(it reselects once per "
     r"epoch, as DeepSpeed's\), got 4"),
    (dict(select_strategy="step"), ValueError,
     r"select_interval must be an integer >= 1 \(steps between reselections\) with "
     r"select_strategy=\"step\", got 'auto'"),
    (dict(select_strategy="epoch", select_interval="auto"), ValueError,
     r"select_interval must be an integer >= 1 \(epochs between reselections\) with "
     r"select_strategy=\"epoch\""),
    (dict(full_warm_up_rounds=-1), ValueError, "full_warm_up_rounds must be >= 0"),
    (dict(full_warm_up_rounds=True), TypeError, "full_warm_up_rounds must be an integer"),
    (dict(overlap_step="yes"), TypeError, "overlap_step must be True or False"),
    (dict(max_grad_norm=0.0), ValueError, "max_grad_norm must be > 0"),
    (dict(importance="l3"), ValueError, "importance must be one of 'l2', 'l1'"),
    (dict(pt_reserved_cores_perc=2.0), ValueError, "pt_reserved_cores_perc must be between"),
    # finite and sane: inf and absurd magnitudes are refused, naming the bound
    (dict(lr=float("inf")), ValueError, r"lr must be <= 10.0, got inf"),
    (dict(lr=1e30), ValueError, r"lr must be <= 10.0, got 1e\+30"),
    (dict(eps=float("inf")), ValueError, r"eps must be <= 1.0, got inf"),
    (dict(eps=1e308), ValueError, r"eps must be <= 1.0"),
    (dict(weight_decay=1e30), ValueError, r"weight_decay must be <= 10.0, got 1e\+30"),
    (dict(weight_decay=float("-inf")), ValueError, r"weight_decay must be >= 0"),
    (dict(betas=(float("-inf"), 0.9)), ValueError, r"betas\[0\] must be >= 0"),
    (dict(update_interval=10**30), ValueError, r"update_interval must be <= 100000, got 10{30}"),
    (dict(select_interval=10**10), ValueError,
     r"select_interval must be <= 1000000000, got 10000000000"),
    (dict(full_warm_up_rounds=10**30), ValueError, r"full_warm_up_rounds must be <= 1000000000"),
    (dict(update_interval="auto", auto_update_bounds=(1, 10**30)), ValueError,
     r"auto_update_bounds\[1\] must be <= 100000"),
    (dict(auto_ratio=float("inf")), ValueError, r"auto_ratio must be between 0.0 and 1.0, got inf"),
    (dict(auto_ratio=-0.5), ValueError, r"auto_ratio must be between 0.0 and 1.0, got -0.5"),
    (dict(max_grad_norm=float("inf")), ValueError, r"max_grad_norm must be finite, got inf"),
    (dict(lr=torch.tensor(0.1)), TypeError, r"lr must be a number, got tensor\(0.1"),
    (dict(select_strategy=["step"]), ValueError, r"select_strategy must be one of .* got \['step'\]"),
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
def test_frozen_parameters_are_accepted_and_left_alone(cls):
    # As torch.optim does: a parameter that does not require grad is accepted and never changes.
    model = fresh()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    opt = cls(model.parameters(), lr=1e-2, **({"worker": False, "topk_ratio": 0.3}
                                              if cls is zenflow.ZenFlowAdamW else {}))
    for t in range(4):
        opt.zero_grad()
        MODELS["mlp"][1](model, t).backward()
        opt.step()
    assert torch.equal(model[0].weight, frozen)
    assert not torch.equal(model[2].weight, fresh()[2].weight)  # the others did train
    opt.close()


@pytest.mark.parametrize("cls", [zenflow.ZenFlowAdamW, zenflow.OffloadAdamW])
def test_bad_parameters_are_named(cls):
    model = fresh()
    with pytest.raises(ValueError, match="params is empty"):
        cls([])
    with pytest.raises(TypeError, match="dtype torch.int64"):
        cls([torch.zeros(3, dtype=torch.long)])
    meta = torch.nn.Parameter(torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match="all params must be on one device"):
        cls([torch.nn.Parameter(torch.zeros(3)), meta])
    with pytest.raises(ValueError, match=r"params\[1\] \(shape \(0, 4\)\) has no elements"):
        cls([torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(0, 4))])
    with pytest.raises(ValueError, match=r"param group 1 has no 'params' key.*got keys \['lr'\]"):
        cls([{"params": model[0].parameters()}, {"lr": 0.1}])
    with pytest.raises(TypeError, match=r"param group 0 'params'\[1\] must be a torch.Tensor, "
                                        r"got str"):
        cls([{"params": [model[0].weight, "bias"]}])
    with pytest.raises(TypeError, match="params mixes param groups .* and Parameter"):
        cls([{"params": model[0].parameters()}, model[2].weight])
    with pytest.raises(TypeError, match="got a dict; pass one group as"):
        cls({"params": model[0].parameters()})
    with pytest.raises(TypeError, match="params must be an iterable .* got int"):
        cls(3)
    with pytest.raises(ValueError, match=r"params\[1\] .* is not a leaf tensor"):
        cls([model[0].weight, model[0].weight * 2])
    with pytest.raises(ValueError, match=r"params\[2\] .* is the same tensor as params\[0\]"):
        cls([model[0].weight, model[0].bias, model[0].weight])
    with pytest.raises(ValueError, match="every param group has an empty 'params' list"):
        cls([{"params": []}])


@pytest.mark.parametrize("cls", [zenflow.ZenFlowAdamW, zenflow.OffloadAdamW])
def test_bad_group_bounds_are_named(cls):
    model = fresh()
    with pytest.raises(ValueError, match=r"lr must be <= 10.0, got inf"):
        cls([{"params": model[0].parameters(), "lr": float("inf")},
             {"params": model[2].parameters()}])
    with pytest.raises(ValueError, match=r"weight_decay must be <= 10.0, got 1e\+30"):
        cls([{"params": model[0].parameters()},
             {"params": model[2].parameters(), "weight_decay": 1e30}])


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
    # The skip lands on a window's first step (or in warm-up), where it is undone entirely; one
    # inside a window is a step of it that adds nothing (tests/test_host_reads.py).
    lambda ps: zenflow.ZenFlowAdamW(ps, topk_ratio=0.3, update_interval=3, overlap_step=True),
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_saved_state_tensor_with_one_bad_value_is_refused_by_name(dtype):
    """One inf, -inf or NaN among finite values (and, in a second moment, one negative value) is
    enough: the check reads every value (a min and a max in one pass)."""
    from zenflow.saved_state import check_saved_tensors
    like = {"master": torch.zeros(4, 5), "exp_avg_sq": torch.zeros(4, 5)}
    good = {name: torch.rand(4, 5).to(dtype) for name in like}
    check_saved_tensors(good, like)
    for name, value, said in [("master", float("inf"), "non-finite"),
                              ("master", -float("inf"), "non-finite"),
                              ("exp_avg_sq", float("nan"), "non-finite"),
                              ("exp_avg_sq", -1e-3, "negative")]:
        bad = {k: v.clone() for k, v in good.items()}
        bad[name][2, 3] = value
        with pytest.raises(ValueError, match=f"saved {name} holds {said}"):
            check_saved_tensors(bad, like)
    good["master"][0, 0] = -1.0   # a negative master value is fine
    check_saved_tensors(good, like)
