"""A step inside a window runs no Python per matrix (zenflow/optim/step_plan.py), and the
gradients it reads are present_gradients' own.

Counted with sys.settrace: the Python lines a step() executes, at 32 and at 128 alike small
matrices (an MoE's experts). Inside a window every list a step needs is kept from its first
step (a StepPlan, the staging copies' runs, the device sums' launch runs, the fingerprints'
runs), so the count is the same whatever the number of matrices; a per-matrix comprehension
or loop that comes back adds 96 lines or more and fails here; so does a ColumnBlock some of
whose members have no gradient (an MoE's experts no token reached), stepped as a block all the
same. Not counted: a window's end, which works matrix by matrix where an install does.
"""
from __future__ import annotations

import sys

import pytest
import torch

import zenflow
from zenflow.optim.params import present_gradients
from zenflow.optim.step_plan import GradientReader

SETTINGS = {
    "host sums": {"update_interval": 4, "topk_ratio": 0.25},
    "device sums, mean, bf16": {"update_interval": 4, "topk_ratio": 0.25,
                                "device_sum_budget": 10**9, "deferred_credit": "mean",
                                "device_sum_dtype": "bfloat16"},
    "device sums, factored": {"update_interval": 4, "topk_ratio": 0.25,
                              "device_sum_budget": 10**9, "deferred_credit": "factored"},
}


def _lines_inside_a_window(matrices: int, settings: dict, frozen: int = 0,
                           unused: int = 0) -> list[int]:
    """Python lines each step inside the second and third windows ran (not their ends or first
    steps); `frozen` more matrices that do not train, `unused` trainable ones without gradients
    (the plan for a set with gaps)."""
    gen = torch.Generator().manual_seed(0)
    # (the unused ones last, in the same ColumnBlock as the others: an MoE's experts no token
    # reached)
    params = [torch.nn.Parameter(torch.randn(8, 8, generator=gen))
              for _ in range(matrices + frozen + unused)]
    biases = [torch.nn.Parameter(torch.randn(8, generator=gen)) for _ in range(3)]
    for p in params[matrices:matrices + frozen]:
        p.requires_grad_(False)
    trained = params[:matrices] + biases
    opt = zenflow.ZenFlowAdamW(params + biases, lr=1e-3, worker=False, **settings)
    counts = []
    try:
        for t in range(11):
            for p in trained:
                p.grad = torch.randn(p.shape, generator=gen)
            inside = t >= 5 and opt.counters.window_steps not in (0, 3)
            lines = [0]

            def trace(frame, event, arg):
                if event == "line":
                    lines[0] += 1
                return trace
            if inside:
                sys.settrace(trace)
            try:
                opt.step()
            finally:
                sys.settrace(None)
            if inside:
                counts.append(lines[0])
    finally:
        opt.close()
    return counts


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_step_inside_a_window_runs_the_same_python_whatever_the_matrix_count(name):
    settings = SETTINGS[name]
    few = _lines_inside_a_window(32, settings)
    many = _lines_inside_a_window(128, settings)
    assert len(few) == len(many) == 4
    if name == "device sums, factored":
        # its op-by-op path (a CPU's; a GPU compiles it) launches per matrix: the squares' row
        # and column sums and the skip guard, one line each, and nothing else grows
        assert [m - f for f, m in zip(few, many)] == [3 * 96] * 4, (few, many)
    else:
        assert few == many, (few, many)


def test_gaps_and_frozen_matrices_keep_the_step_free_of_python_per_matrix():
    settings = SETTINGS["host sums"]
    few = _lines_inside_a_window(32, settings, frozen=8, unused=3)
    many = _lines_inside_a_window(128, settings, frozen=40, unused=3)
    assert few == many, (few, many)


def _groups():
    gen = torch.Generator().manual_seed(1)
    shapes = [(4, 3), (5,), (4, 3), (2, 6), (3,), (6, 2), (4, 3)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    params[3].requires_grad_(False)
    return [{"params": params[:4], "lr": 1e-3}, {"params": params[4:], "lr": 1e-2}], params


@pytest.mark.parametrize("without", [(), (0,), (1, 5), (0, 1, 2, 4, 5)])
def test_the_gradients_read_are_present_gradients_own_in_its_order(without):
    groups, params = _groups()
    opt = zenflow.ZenFlowAdamW(groups, worker=False)
    try:
        for j, p in enumerate(params):
            if p.requires_grad and j not in without:
                p.grad = torch.randn_like(p)
        reader = GradientReader(opt.param_groups, opt._host_params, opt._vector_params,
                                opt.device, "ZenFlowAdamW", opt._built)
        expected = present_gradients(opt.param_groups, opt.device, "ZenFlowAdamW", opt._built)
        got = reader.read(opt.param_groups, chosen=True)
        # (the norms' order: a global norm summed in another order rounds differently)
        assert [id(g) for g in got.present()] == [id(g) for g in expected.values()]
        assert {id(p): id(g) for p, g in got.by_param.items()} == \
            {id(p): id(g) for p, g in expected.items()}
        staged = got.staged()
        assert sorted(staged) == sorted(m.host_index for m in opt._host_params
                                        if m.param in expected and m.k < m.num_columns)
        assert all(staged[m.host_index] is expected[m.param] for m in opt._host_params
                   if m.host_index in staged)
    finally:
        opt.close()


def test_none_present_is_no_step():
    groups, _ = _groups()
    opt = zenflow.ZenFlowAdamW(groups, worker=False)
    try:
        reader = GradientReader(opt.param_groups, opt._host_params, opt._vector_params,
                                opt.device, "ZenFlowAdamW", opt._built)
        assert reader.read(opt.param_groups, chosen=False) is None
    finally:
        opt.close()


@pytest.mark.parametrize("fault", ["frozen now has a gradient", "dtype changed",
                                   "not contiguous", "sparse gradient", "param replaced",
                                   "param_groups replaced"])
def test_a_fault_the_fast_checks_see_gets_present_gradients_error(fault):
    groups, params = _groups()
    opt = zenflow.ZenFlowAdamW(groups, worker=False)
    try:
        for p in params:
            if p.requires_grad:
                p.grad = torch.randn_like(p)
        if fault == "frozen now has a gradient":
            params[3].requires_grad_(True)
            params[3].grad = torch.randn_like(params[3])
        elif fault == "dtype changed":
            params[0].data = params[0].data.double()
            params[0].grad = torch.randn_like(params[0])
        elif fault == "not contiguous":
            params[2].data = params[2].data.t().contiguous().t()
            params[2].grad = None
            params[2].grad = torch.randn(params[2].shape)
        elif fault == "sparse gradient":
            params[6].grad = torch.randn_like(params[6]).to_sparse()
        elif fault == "param replaced":
            opt.param_groups[1]["params"][0] = torch.nn.Parameter(torch.randn(3))
            opt.param_groups[1]["params"][0].grad = torch.randn(3)
        else:   # new groups, as a wrapper that swaps the list for its own might
            opt.param_groups = [dict(g, params=list(g["params"])) for g in opt.param_groups]
            opt.param_groups[0]["params"][0] = torch.nn.Parameter(torch.randn(4, 3))
            opt.param_groups[0]["params"][0].grad = torch.randn(4, 3)
        with pytest.raises(ValueError) as caught:
            present_gradients(opt.param_groups, opt.device, "ZenFlowAdamW", opt._built)
        with pytest.raises(ValueError) as again:
            opt.step()
        assert str(again.value) == str(caught.value)
    finally:
        opt.close()
