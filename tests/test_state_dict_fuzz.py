"""A refused load_state_dict changes nothing; an accepted one trains on to finite weights.

Seeded fuzz: each case mutates one entry of a real state dict (deleted, None, a string, negative,
NaN, infinite, huge, a tensor of another shape or dtype, indices out of range, ...) and loads it
into an optimizer holding a good state. The only allowed outcomes are a ValueError naming
load_state_dict, after which the optimizer's state and the weights are exactly as before, or an
accepted state from which a few more steps give finite weights.
"""
import copy
import math
import random

import pytest
import torch

import zenflow

from helpers.models import make_mlp, mlp_loss

KW = dict(lr=2e-3, topk_ratio=0.25, update_interval=3, select_strategy="step", select_interval=5,
          overlap_step=True, max_grad_norm=1.0, worker=False)
CASES = 300


def _paths(obj, path=()):
    """Every entry of a nested state dict, as key paths (containers included)."""
    yield path
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _paths(value, (*path, key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from _paths(value, (*path, i))


def _mutations(value):
    """Broken or odd replacements of `value` (None: delete the entry)."""
    out = [None, "x", [], {}]
    if isinstance(value, bool):
        out += [not value, 1, 0.5]
    elif isinstance(value, (int, float)):
        out += [-1, -value, value + 0.5, math.nan, math.inf, -math.inf, 10 ** 6, True, 0, str(value)]
    elif isinstance(value, torch.Tensor):
        if value.numel():
            out += [value.flatten()[:-1], value * math.nan, -value - 1, value.to(torch.int32),
                    value.unsqueeze(0), value + 1000, value.flip(-1), torch.zeros_like(value)]
            if not value.is_floating_point():
                out += [value - 1, value * 0, value.to(torch.float32)]
        out += [value.to(torch.float64)]
    elif isinstance(value, list):
        out += [value[:-1], value + value[-1:], value[::-1], [None] * len(value), tuple(value)]
    elif isinstance(value, dict):
        out += [{k: v for i, (k, v) in enumerate(value.items()) if i}]
    return out


def _mutated(state: dict, rng: random.Random):
    state = copy.deepcopy(state)
    path = rng.choice(list(_paths(state))[1:])
    parent = state
    for key in path[:-1]:
        parent = parent[key]
    replacement = rng.choice(["delete", *_mutations(parent[path[-1]])])
    if replacement == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = replacement
    return state, f"{path} := {'deleted' if replacement == 'delete' else type(replacement).__name__}"


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@pytest.fixture
def one_thread():
    """Tiny tensors: torch's thread pool only adds overhead on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow   # seconds on 2 cores, not milliseconds (--durations=0)
def test_state_dict_fuzz_refuses_by_name_or_trains_finite(one_thread):
    model = make_mlp()
    opt = zenflow.ZenFlowAdamW(model.parameters(), **KW)
    # windows end at steps 2, 4 (cut short by the reselection at 5) and 7: after step 8 the run
    # is past a reselection, mid-window, with an update in flight
    for t in range(9):
        opt.zero_grad()
        mlp_loss(model, t).backward()
        opt.step()
    good, weights = opt.state_dict(), copy.deepcopy(model.state_dict())
    opt.close()
    assert good["zenflow"]["in_flight"] and good["zenflow"]["window_steps"] > 0

    rng = random.Random(24)
    outcomes = {"refused": 0, "accepted": 0}
    for case in range(CASES):
        mutated, what = _mutated(good, rng)
        model.load_state_dict(weights)
        with zenflow.ZenFlowAdamW(model.parameters(), **KW) as opt:
            opt.load_state_dict(good)
            before, before_weights = opt.state_dict(), copy.deepcopy(model.state_dict())
            try:
                opt.load_state_dict(mutated)
            except ValueError as exc:
                assert "ZenFlowAdamW: load_state_dict:" in str(exc), (case, what, exc)
                assert _same(opt.state_dict(), before), (case, what, "changed by a refused load")
                assert _same(model.state_dict(), before_weights), (case, what)
                outcomes["refused"] += 1
                continue
            for t in range(10, 14):
                opt.zero_grad()
                mlp_loss(model, t).backward()
                opt.step()
            opt.synchronize()
            for name, p in model.named_parameters():
                assert torch.isfinite(p).all(), (case, what, name)
            outcomes["accepted"] += 1
    print("state-dict fuzz outcomes:", outcomes)
    assert outcomes["refused"] > CASES // 4 and outcomes["accepted"] > CASES // 10


def test_a_state_saved_before_any_window_loads_into_a_trained_optimizer(one_thread):
    """Values that start as None (the auto window's last length) load over a run that has them."""
    model = make_mlp()
    kw = dict(KW, update_interval="auto")
    with zenflow.ZenFlowAdamW(model.parameters(), **kw) as fresh:
        early = fresh.state_dict()
    assert early["zenflow"]["window"]["last_interval"] is None
    with zenflow.ZenFlowAdamW(model.parameters(), **kw) as opt:
        for t in range(4):
            opt.zero_grad()
            mlp_loss(model, t).backward()
            opt.step()
        assert opt.state_dict()["zenflow"]["window"]["last_interval"] is not None
        opt.load_state_dict(early)
        assert opt.state_dict()["zenflow"]["window"]["last_interval"] is None
