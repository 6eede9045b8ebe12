"""A run resumed from state_dict() continues bit for bit like the uninterrupted run."""
import copy
import json

import pytest
import torch

import zenflow

from helpers.models import MODELS
from helpers.state_dict_runs import KW, run, run_once


@pytest.mark.slow   # seconds on 2 cores, not milliseconds (--durations=0)
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("resume_at", [5, 7, 10])  # mid-window, window boundary, after reselection
@pytest.mark.parametrize("warm_up", [0, 2])
def test_resume_is_bit_exact(overlap, resume_at, warm_up):
    make, loss_fn = MODELS["transformer_block"]
    kwargs = dict(KW, overlap_step=overlap, full_warm_up_rounds=warm_up, max_grad_norm=1.0)
    straight, straight_stats = run_once(make, loss_fn, kwargs, steps=20)
    resumed, resumed_stats = run(make, loss_fn, kwargs, steps=20, resume_at=resume_at)
    assert straight_stats["reselections"] > 0
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    assert resumed_stats["steps"] == straight_stats["steps"]
    assert resumed_stats["reselections"] == straight_stats["reselections"]


@pytest.mark.slow   # seconds on 2 cores, not milliseconds (--durations=0)
@pytest.mark.parametrize("credit", ["mean", "moments"])
@pytest.mark.parametrize("budget", [10 ** 9, "some"], ids=["all-sums-on-device", "some"])
@pytest.mark.parametrize("resume_at", [5, 7])  # mid-window, window boundary
def test_resume_with_window_sums_on_the_device_is_bit_exact(budget, resume_at, credit):
    """Resumes bit for bit; under "mean" the sums' place changes nothing, bit for bit ("moments"
    applies only where they are on the device with room for its squares and rates)."""
    make, loss_fn = MODELS["transformer_block"]
    if budget == "some":   # 4 of its 7 sums; 5 sums and 1 matrix's squares and rates
        budget = 6_000 if credit == "mean" else 9_000
    on_host = dict(KW, overlap_step=True, max_grad_norm=1.0, deferred_credit=credit)
    kwargs = dict(on_host, device_sum_budget=budget)
    straight, stats = run_once(make, loss_fn, kwargs, steps=12)
    resumed, _ = run(make, loss_fn, kwargs, steps=12, resume_at=resume_at)
    host_summed, _ = run_once(make, loss_fn, on_host, steps=12)
    assert stats["device_sum_matrices"] > 0
    assert (stats["host_sum_matrices"] > 0) == (budget < 10 ** 9)
    if credit == "mean":
        assert stats["moments_matrices"] == 0
    elif budget < 10 ** 9:
        assert 0 < stats["moments_matrices"] < stats["device_sum_matrices"]
    else:
        assert stats["moments_matrices"] == stats["device_sum_matrices"]
    for (name, a), b, c in zip(straight.named_parameters(), resumed.parameters(),
                               host_summed.parameters()):
        assert torch.equal(a, b), name
        if credit == "mean":
            assert torch.equal(a, c), name


def test_state_dict_is_a_snapshot():
    """Training on after state_dict() must not change what was saved."""
    make, loss_fn = MODELS["mlp"]
    model = make()
    opt = zenflow.ZenFlowAdamW(model.parameters(), **KW)
    for t in range(4):
        opt.zero_grad()
        loss_fn(model, t).backward()
        opt.step()
    saved = opt.state_dict()
    copies = {k: v.clone() for k, v in saved["state"][0].items() if torch.is_tensor(v)}
    for t in range(4, 8):
        opt.zero_grad()
        loss_fn(model, t).backward()
        opt.step()
    for k, v in copies.items():
        assert torch.equal(saved["state"][0][k], v), k
    opt.close()


def test_load_rejects_mismatched_state():
    make, loss_fn = MODELS["mlp"]
    opt = zenflow.ZenFlowAdamW(make().parameters(), **KW)
    other = zenflow.ZenFlowAdamW(make().parameters(), **dict(KW, topk_ratio=0.5))
    with pytest.raises(ValueError, match="topk_ratio"):
        other.load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="not saved by ZenFlowAdamW"):
        opt.load_state_dict(torch.optim.AdamW(make().parameters()).state_dict())
    opt.close()
    other.close()


@pytest.mark.parametrize("cls", [zenflow.ZenFlowAdamW, zenflow.OffloadAdamW])
def test_torch_state_dict_hooks_run_around_saving_and_loading(cls):
    make, loss_fn = MODELS["mlp"]
    model = make()
    opt = cls(model.parameters(), worker=False)
    for t in range(3):
        opt.zero_grad()
        loss_fn(model, t).backward()
        opt.step()
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("save: pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": o.counters.step})

    def drop_extra(o, sd):   # edits the dict it is given in place
        calls.append("load: pre")
        del sd["extra"]
    opt.register_load_state_dict_pre_hook(drop_extra)
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load: post"))
    saved = opt.state_dict()
    assert saved["extra"] == 3 and saved["zenflow"]["optimizer"] == cls.__name__
    opt.load_state_dict(saved)
    assert calls == ["save: pre", "load: pre", "load: post"]
    assert "extra" in saved   # loading works on a copy, as torch's does
    opt.close()


def test_a_state_of_other_shapes_is_refused_naming_the_parameter_and_the_part():
    small = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3))
    wide = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 5))
    with zenflow.ZenFlowAdamW(small.parameters(), worker=False) as opt, \
            zenflow.ZenFlowAdamW(wide.parameters(), worker=False) as other:
        saved = other.state_dict()
        before = opt.state_dict()
        with pytest.raises(ValueError, match=r"ZenFlowAdamW: load_state_dict: the selected "
                                             r"columns of the parameter of shape \(3, 8\): "
                                             r"saved master is \(5, 1\), expected \(3, 1\)"):
            opt.load_state_dict(saved)
        after = opt.state_dict()
        assert all(torch.equal(a, b) for a, b in zip(after["state"][2]["host"].values(),
                                                      before["state"][2]["host"].values())
                   if torch.is_tensor(a))


def _trained(steps: int = 5):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2,
                               worker=False)
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_the_state_carries_its_format_version_and_an_unversioned_one_still_loads():
    from zenflow.optim.state_versions import FORMAT_VERSION
    model, opt = _trained()
    saved = opt.state_dict()
    assert saved["zenflow"]["format_version"] == FORMAT_VERSION == 6
    # Version 4: no window_spoiled (a skip inside a window was not counted in it then).
    v4 = {**saved, "zenflow": {**{k: v for k, v in saved["zenflow"].items()
                                  if k != "window_spoiled"}, "format_version": 4}}
    again = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2,
                                 worker=False)
    again.load_state_dict(v4)
    assert again.counters == opt.counters and again.counters.window_spoiled is False
    again.close()
    # Version 1: the format before the version was written down.
    old = {**saved, "zenflow": {k: v for k, v in saved["zenflow"].items()
                                if k != "format_version"}}
    fresh = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2,
                                 worker=False)
    fresh.load_state_dict(old)
    assert fresh.state_dict()["zenflow"]["format_version"] == FORMAT_VERSION
    assert fresh.counters == opt.counters
    opt.close()
    fresh.close()


def test_a_version_2_state_still_loads_and_version_3_carries_the_section_in_param_groups():
    """Version 3 also keeps the "zenflow" section in param_groups[0] (torch.distributed.checkpoint
    keeps only "state" and "param_groups") and says whether the state reshards."""
    model, opt = _trained()
    saved = opt.state_dict()
    assert json.loads(saved["param_groups"][0]["zenflow"]) == saved["zenflow"]
    assert saved["zenflow"]["reshardable"] is True   # one process: whole tensors
    assert "zenflow" not in opt.param_groups[0]
    # As version 2 wrote it: no "reshardable", no copy in param_groups, no squares nor rates.
    v2 = {**saved, "param_groups": [{k: v for k, v in g.items() if k != "zenflow"}
                                     for g in saved["param_groups"]],
          "zenflow": {**{k: v for k, v in saved["zenflow"].items() if k != "reshardable"},
                      "format_version": 2},
          "state": {k: {**v, "host": {n: t for n, t in v["host"].items()
                                      if n not in ("grad_sq_sum", "rate")}}
                    if v["kind"] == "host" else v for k, v in saved["state"].items()}}
    fresh = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2,
                                 worker=False)
    fresh.load_state_dict(v2)
    again = fresh.state_dict()
    assert again["zenflow"] == saved["zenflow"]
    assert "zenflow" not in fresh.param_groups[0]   # loading never adds it to the live groups
    for a, b in zip(again["state"].values(), saved["state"].values()):
        for name in ("host", "device"):
            for k, t in a.get(name, {}).items():
                if k in ("grad_sq_sum", "rate"):   # format 4's: migrated (tests/test_moments.py)
                    continue
                assert torch.equal(t, b[name][k]) if torch.is_tensor(t) else t == b[name][k]
    opt.close()
    fresh.close()


@pytest.mark.parametrize("version, message", [
    (7, "format version 7, newer than this zenflow reads (1 to 6)"),
    ("2", "'format_version' must be a positive integer, got '2'"),
    (0, "'format_version' must be a positive integer, got 0"),
])
def test_a_state_of_an_unknown_version_is_refused_by_name_and_changes_nothing(version, message):
    model, opt = _trained()
    saved = opt.state_dict()
    before = opt.state_dict()
    bad = {**saved, "zenflow": {**saved["zenflow"], "format_version": version}}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert after["zenflow"] == before["zenflow"]
    opt.close()


def _overlapped(worker=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2,
                               overlap_step=True, worker=worker)
    return model, opt


def _steps(model, opt, start, stop):
    for t in range(start, stop):
        g = torch.Generator().manual_seed(t)
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_the_states_own_weights_loaded_after_it_keep_the_update_in_flight():
    """torch.distributed.checkpoint's set_state_dict loads the optimizer's state first and the
    model's after it. Those weights are the state's own (its weight_bits say so): the host update
    in flight stays and the run resumes exactly. Other weights loaded then are adopted."""
    model, opt = _overlapped()
    _steps(model, opt, 0, 5)          # windows of 2, overlapped: an update is in flight
    saved_opt, saved_model = opt.state_dict(), copy.deepcopy(model.state_dict())
    assert saved_opt["zenflow"]["in_flight"]
    _steps(model, opt, 5, 10)
    straight = copy.deepcopy(model.state_dict())
    opt.close()

    model, opt = _overlapped()
    opt.load_state_dict(saved_opt)
    model.load_state_dict(saved_model)
    _steps(model, opt, 5, 10)
    for name, value in model.state_dict().items():
        assert torch.equal(value, straight[name]), name
    opt.close()

    model, opt = _overlapped()
    opt.load_state_dict(saved_opt)
    other = {k: torch.randn_like(v) for k, v in saved_model.items()}
    model.load_state_dict(other)
    for group in opt.param_groups:
        group["lr"] = 0.0
    _steps(model, opt, 5, 8)
    opt.synchronize()
    for name, value in model.state_dict().items():
        assert torch.equal(value, other[name]), name   # not overwritten by the state's update
    opt.close()


def test_a_ddp_ranks_state_that_came_through_dcp_is_refused_by_name():
    """A DDP rank's state holds its share of the rows as plain tensors; through
    torch.distributed.checkpoint (which drops the top-level section and keeps one rank's copy of
    a plain tensor) it is unusable, and loading it says so, changing nothing."""
    model, opt = _trained()
    saved = opt.state_dict()
    section = {**saved["zenflow"], "world_size": 2, "rank": 1, "reshardable": False}
    through_dcp = {"state": saved["state"],
                   "param_groups": [{**saved["param_groups"][0], "zenflow": json.dumps(section)},
                                    *saved["param_groups"][1:]]}
    before = opt.state_dict()
    with pytest.raises(ValueError, match=r"saved by 2 data-parallel \(DDP\) ranks.*"
                                         r"torch.distributed.checkpoint"):
        opt.load_state_dict(through_dcp)
    assert opt.state_dict()["zenflow"] == before["zenflow"]
    # The same state with its section where it belongs is refused as before: another world size.
    with pytest.raises(ValueError, match="saved by rank 1 of 2, but this run has 1 rank"):
        opt.load_state_dict({**saved, "zenflow": section})
    opt.close()


def test_a_resume_right_before_a_reselection_under_moments_is_bit_exact():
    """Cut where the next step reselects: that step installs the update in flight before the
    loaded optimizer has placed its sums, and the install must bring the update's rates (the
    restored ones are the window's before: off by 1e3 in the rates, 6e-5 in the weights)."""
    make, loss_fn = MODELS["transformer_block"]
    kwargs = dict(KW, overlap_step=True, max_grad_norm=1.0, deferred_credit="moments",
                  device_sum_budget=10 ** 9, select_interval=7)
    straight, stats = run(make, loss_fn, kwargs, steps=10)
    resumed, _ = run(make, loss_fn, kwargs, steps=10, resume_at=7)
    assert stats["reselections"] >= 1 and stats["moments_matrices"] > 0
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
