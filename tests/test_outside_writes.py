"""Weights written outside the optimizer stick, however they are written, and a parameter set
that changed since the optimizer was built is refused by name (issue: nothing lost, nothing
silent). torch.optim.AdamW at lr 0 keeps every such write; so must ZenFlowAdamW."""
from __future__ import annotations

import contextlib
import logging
from unittest import mock

import pytest
import torch

import zenflow
from zenflow.host import factored_kernels
from zenflow.optim import outside_writes


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _train(model, opt, steps, write=None, at=None):
    for t in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if t == at:
            write(model)


def _zenflow(model, **kw):
    kw = {"lr": 0.0, "weight_decay": 0.0, "topk_ratio": 0.25, "update_interval": 2,
          "worker": False, **kw}
    return zenflow.ZenFlowAdamW(model.parameters(), **kw)


def _replace(model):
    for p in model.parameters():
        p.data = torch.full_like(p, 0.5)


def _vector_to_parameters(model):
    n = sum(p.numel() for p in model.parameters())
    torch.nn.utils.vector_to_parameters(torch.full((n,), 0.25), model.parameters())


@pytest.mark.parametrize("write, value", [(_replace, 0.5), (_vector_to_parameters, 0.25)],
                         ids=["p.data = t", "vector_to_parameters"])
@pytest.mark.parametrize("at", [3, 4], ids=["window-boundary", "mid-window"])
def test_new_storage_for_a_parameter_is_adopted_at_the_next_step(write, value, at):
    model = _model()
    opt = _zenflow(model, overlap_step=True)
    _train(model, opt, 10, write, at)
    opt.synchronize()
    opt.close()
    for p in model.parameters():
        assert torch.equal(p.detach(), torch.full_like(p, value))


@pytest.mark.parametrize("overlap", [False, True])
def test_in_place_writes_through_data_at_a_window_boundary_stick_and_are_reported(overlap,
                                                                                     caplog):
    def clamp(model):
        for p in model.parameters():
            p.data.clamp_(-0.05, 0.05)
    model = _model()
    opt = _zenflow(model, overlap_step=overlap)
    with caplog.at_level(logging.WARNING, logger="zenflow"):
        _train(model, opt, 10, clamp, at=3)    # windows of 2 steps: 3 ends one
    opt.synchronize()
    opt.close()
    for p in model.parameters():
        assert p.detach().abs().max() <= 0.05
    assert caplog.text.count("written through .data") == 1


# Where a matrix's values are updated: the columns the device owns (and every column at
# topk_ratio=1), and "moments" and "factored" matrices, which the device moves every step.
_PLACEMENTS = {"device-columns": {"topk_ratio": 0.25},
               "topk-1": {"topk_ratio": 1.0},
               "moments": {"topk_ratio": 0.25, "deferred_credit": "moments",
                           "device_sum_budget": 1 << 22},
               "factored": {"topk_ratio": 0.25, "deferred_credit": "factored",
                            "device_sum_budget": 1 << 22},
               # its step as on a GPU (one fused function a matrix, run eagerly here), which
               # takes the moved columns' fingerprints itself
               "factored-fused": {"topk_ratio": 0.25, "deferred_credit": "factored",
                                  "device_sum_budget": 1 << 22}}


def _as_placed(placement):
    """The placement's code path: "factored-fused" takes the fused step."""
    if placement != "factored-fused":
        return contextlib.nullcontext()
    return mock.patch.object(factored_kernels, "compiled_for", lambda fn, device, batch=False: (
        (lambda *args, signature: fn(*args)) if batch else fn))


def _clamp_through_data(model):
    for p in model.parameters():
        p.data.clamp_(-0.05, 0.05)


@pytest.mark.parametrize("at", [3, 4], ids=["window-boundary", "mid-window"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("placement", list(_PLACEMENTS))
def test_a_write_through_data_mid_window_sticks_wherever_the_columns_are_updated(placement,
                                                                                 dtype, at):
    """torch.optim.AdamW at lr 0 keeps the write bit for bit; so must every placement (issue 39
    item 5: the device's columns, topk_ratio=1 and "moments" matrices reverted it), whether the
    window's start finds it (written after a window's last step) or its end does (after its
    first: the step that ends it moves the matrices first)."""
    model = _model().to(dtype)
    written = []
    with _as_placed(placement):
        opt = _zenflow(model, overlap_step=True, **_PLACEMENTS[placement])
        for t in range(10):
            model(torch.randn(4, 8, dtype=dtype)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if t == at:   # windows of 2 steps: 3 ends one, 4 starts one
                _clamp_through_data(model)
                written = [p.detach().clone() for p in model.parameters()]
        opt.synchronize()
        opt.close()
    if placement == "factored-fused":
        assert opt.stats()["fused_steps"] > 0
    for p, w in zip(model.parameters(), written):
        assert torch.equal(p.detach(), w)


@pytest.mark.parametrize("placement, first, last", [("factored", 2.0, 3.0),
                                                     ("factored-fused", 1.0, 0.0)])
def test_a_window_reads_each_moving_matrix_no_more_often_than_its_checks_need(placement, first,
                                                                             last):
    """The fingerprints of the matrices a credit rule moves every step ("factored"), in passes
    over all their values outside the rule's own kernels: a window's first step looks for
    writes through .data (one pass; the interim move's own check before it would read the same
    bits) and fingerprints the moved values (one); its last checks before the move and
    fingerprints after it (two; the window's end reads none again, no code having run since)
    and fingerprints the installed values (one). 3 and 4 passes before the window's end and
    start stopped reading them again. The fused kernels (a GPU's) take the fingerprints around
    the move and after the install's correction in their own passes: one pass a window is
    left, the start's look."""
    model = _model()
    with _as_placed(placement):
        opt = _zenflow(model, lr=1e-3, overlap_step=True, select_strategy="step",
                       select_interval=1000, **_PLACEMENTS[placement])
    total = sum(p.numel() for p in model.parameters() if p.ndim == 2)
    summed = []
    real = outside_writes.column_sums_of_bits

    def counted(matrix_bits):
        summed.append(matrix_bits.numel())
        return real(matrix_bits)
    passes = []
    with _as_placed(placement), mock.patch.object(outside_writes, "column_sums_of_bits", counted):
        for _ in range(8):
            model(torch.randn(4, 8)).square().mean().backward()
            summed.clear()
            opt.step()
            opt.zero_grad()
            passes.append(sum(summed) / total)
    opt.close()
    assert opt.stats()["windows"] == 4
    # step 0 selects (one more fingerprint) and ends a window with nothing to install (one less)
    assert passes[2:] == [first, last] * 3


@pytest.mark.parametrize("placement", list(_PLACEMENTS))
def test_a_wgan_clamp_through_data_after_every_step_holds(placement):
    """A WGAN critic clamps its weights after every step with p.data.clamp_(): each step moves a
    weight at most a few lr from the clamp, never back to where the optimizer's masters were."""
    model = _model()
    with _as_placed(placement):
        opt = _zenflow(model, lr=1e-3, overlap_step=True, **_PLACEMENTS[placement])
        for _ in range(9):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            _clamp_through_data(model)
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.synchronize()
        opt.close()
    for p in model.parameters():
        assert p.detach().abs().max() <= 0.05 + 0.02


def test_host_owned_columns_written_through_data_mid_window_stick():
    def zero(model):
        model[0].weight.data.zero_()
    model = _model()
    opt = _zenflow(model, topk_ratio=0.0, overlap_step=True)   # every column on the host
    _train(model, opt, 10, zero, at=4)
    opt.synchronize()
    opt.close()
    assert torch.count_nonzero(model[0].weight) == 0


def test_a_parameter_unfrozen_after_construction_is_refused_by_name_and_nothing_changes():
    model = _model()
    model[0].weight.requires_grad_(False)
    opt = _zenflow(model, lr=1e-2)
    model[0].weight.requires_grad_(True)
    model(torch.randn(4, 8)).square().mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"shape \(16, 8\) did not require grad when the "
                                         r"optimizer was built"):
        opt.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    assert opt.counters.step == 0
    opt.close()


def test_a_dtype_change_after_construction_is_refused_by_name():
    model = _model()
    opt = _zenflow(model, lr=1e-2)
    model.double()
    model(torch.randn(4, 8, dtype=torch.float64)).square().mean().backward()
    with pytest.raises(ValueError, match=r"is torch.float64 but was torch.float32 when the "
                                         r"optimizer was built"):
        opt.step()
    opt.close()


def test_a_memory_format_change_after_construction_is_refused_by_name():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3)
    opt = zenflow.ZenFlowAdamW(conv.parameters(), lr=1e-2, worker=False)
    conv.to(memory_format=torch.channels_last)
    conv(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)).sum().backward()
    with pytest.raises(ValueError, match="no longer contiguous"):
        opt.step()
    opt.close()
