"""Host-summed gradients copied during backward (zenflow/host/early_copies.py).

With the worker, the CPU's copy thread plays the copy engine: a hook's copy runs beside the rest
of the backward and lands late, as on a GPU. Without it copies are synchronous and never start
early, so the same optimizer with worker=False is the reference: whatever the script does to the
gradients between backward and step(), the two must agree bit for bit, and the counts in stats()
say which copies the hooks could keep.
"""
from __future__ import annotations

import pytest
import torch

import zenflow

# Every backward runs on a thread of its own, as CUDA runs it (tests/helpers/autograd_thread.py).
pytestmark = pytest.mark.usefixtures("autograd_thread")

STEPS = 5
MATRICES = 3   # the model's weights; its biases are vectors, updated on the device


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10),
                               torch.nn.Tanh(), torch.nn.Linear(10, 6))


def _backward(model, gen, scale=1.0):
    x = torch.randn(8, 12, generator=gen)
    (model(x).pow(2).mean() * scale).backward()


def _train(script, worker, settle=True, **settings):
    """STEPS steps of `script(model, opt, gen)` (it runs the backward(s) and whatever the user does
    before step()), then step() and zero_grad(). With `settle`, the worker finishes adding each
    step before the next backward, so that the hooks always find their staging buffer free and
    the counts do not depend on timing."""
    model = _model()
    opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2,
                               overlap_step=True, device_sum_budget=0, worker=worker, **settings)
    gen = torch.Generator().manual_seed(1)
    with opt:
        for _ in range(STEPS):
            script(model, opt, gen)
            opt.step()
            opt.zero_grad()
            if settle:
                opt._pipeline.drain()
        stats = opt.stats()
    return [p.detach().clone() for p in model.parameters()], stats


def _plain(model, opt, gen):
    _backward(model, gen)


def _user_clips(model, opt, gen):
    _backward(model, gen)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


def _unscales_in_place(model, opt, gen):
    _backward(model, gen, scale=1024.0)
    for p in model.parameters():   # what GradScaler.unscale_ does
        p.grad.mul_(1 / 1024.0)


def _micro_batches(model, opt, gen):
    for _ in range(3):
        _backward(model, gen)


def _micro_batches_zeroed_between(model, opt, gen):
    for _ in range(2):
        opt.zero_grad()
        _backward(model, gen)


def _micro_batches_zeroed_in_place_between(model, opt, gen):
    for _ in range(2):
        opt.zero_grad(set_to_none=False)
        _backward(model, gen)


def _zeroed_in_place_before(model, opt, gen):
    opt.zero_grad(set_to_none=False)
    _backward(model, gen)


def _evaluation_backward_at_step_2(model, opt, gen):
    if opt.stats()["steps"] == 2:   # a backward no step follows, then a fresh one
        _backward(model, gen)
        opt.zero_grad()
    _backward(model, gen)


def _replaces_gradients(model, opt, gen):
    _backward(model, gen)
    for p in model.parameters():
        p.grad = p.grad.clone()


# (script, early copies expected with the worker settled; the first step never copies early)
SCRIPTS = {
    "plain": (_plain, MATRICES * (STEPS - 1)),
    "clip_grad_norm_": (_user_clips, 0),
    "unscale in place": (_unscales_in_place, 0),
    "3 micro-batches": (_micro_batches, MATRICES * (STEPS - 1)),
    "zero_grad between micro-batches": (_micro_batches_zeroed_between, MATRICES * (STEPS - 1)),
    "zero_grad in place between micro-batches": (_micro_batches_zeroed_in_place_between,
                                                 MATRICES * (STEPS - 1)),
    "zero_grad in place": (_zeroed_in_place_before, MATRICES * (STEPS - 1)),
    # step 2 sees two backwards (late); step 3 expects two and gets one (late); step 4 is early
    "a backward with no step": (_evaluation_backward_at_step_2, MATRICES * (STEPS - 3)),
    "p.grad replaced": (_replaces_gradients, 0),
}


@pytest.mark.parametrize("name", SCRIPTS)
def test_early_copies_give_the_late_copies_result_bit_for_bit(name):
    script, early = SCRIPTS[name]
    expected, reference = _train(script, worker=False)
    got, stats = _train(script, worker=True)
    assert reference["early_copies"] == 0
    assert (stats["early_copies"], stats["late_copies"]) == (early, MATRICES * STEPS - early)
    for p, q in zip(got, expected):
        assert torch.equal(p, q)


def test_a_busy_worker_leaves_the_copy_to_step_and_the_result_stays():
    """Unsettled, a hook may find the worker still adding the previous step into the one CPU
    staging buffer: it must skip its copy without waiting, and step() copies late."""
    expected, _ = _train(_micro_batches, worker=False)
    got, stats = _train(_micro_batches, worker=True, settle=False)
    assert stats["early_copies"] + stats["late_copies"] == MATRICES * STEPS
    for p, q in zip(got, expected):
        assert torch.equal(p, q)


def test_gradscaler_unscale_makes_the_copy_late_and_right():
    def run(worker):
        model = _model()
        opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25,
                                   update_interval=2, device_sum_budget=0, worker=worker)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        gen = torch.Generator().manual_seed(1)
        with opt:
            for _ in range(STEPS):
                scaler.scale(model(torch.randn(8, 12, generator=gen)).pow(2).mean()).backward()
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                opt._pipeline.drain()
            return [p.detach().clone() for p in model.parameters()], opt.stats()
    (expected, _), (got, stats) = run(False), run(True)
    assert stats["early_copies"] == 0 and stats["late_copies"] == MATRICES * STEPS
    for p, q in zip(got, expected):
        assert torch.equal(p, q)


def hooks(model):
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def test_hooks_only_on_host_summed_matrices_and_gone_after_close():
    model = _model()
    opt = zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.25, device_sum_budget=0)
    assert hooks(model) == MATRICES
    opt.close()
    assert hooks(model) == 0
    _backward(model, torch.Generator().manual_seed(0))   # a closed optimizer's hooks do nothing

    # Summed on the device: nothing crosses per step, so no hook stays after the first step.
    opt = zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.25, device_sum_budget=10 ** 6)
    with opt:
        _backward(model, torch.Generator().manual_seed(0))
        opt.step()
        assert hooks(model) == 0 and opt.stats()["device_sum_matrices"] == MATRICES


def test_no_early_copy_of_a_matrix_whose_columns_are_all_on_the_device():
    """topk_ratio=1: after the first selection the host gets no rows of any matrix, so the
    hooks have nothing to copy (they learn it from what step() staged) and the bus stays idle."""
    model = _model()
    with zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=1.0, device_sum_budget=0) as opt:
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            _backward(model, gen)
            opt.step()
            opt.zero_grad()
        stats = opt.stats()
    assert stats["early_copies"] == stats["late_copies"] == stats["d2h_bytes_total"] == 0


def _grad_scaled_through_data(model, opt, gen):
    _backward(model, gen)
    for p in model.parameters():   # older code's habit: no version bump
        p.grad.data.mul_(0.5)


def test_a_gradient_written_through_data_after_its_copy_is_found_and_copies_go_late(caplog):
    """Issue 39 item 7: the first window that copies early looks (fingerprints on the device,
    read at its end); what it finds is said, and every copy is late from then on, so the
    steps after it are the late copies' exactly."""
    with caplog.at_level("WARNING", logger="zenflow"):
        _, stats = _train(_grad_scaled_through_data, worker=True)
    assert caplog.text.count("changed after backward without a version bump") == 1
    assert "shape (16, 12)" in caplog.text
    # step 0 copies nothing early; step 1 (the first window's end) copies early and finds it
    assert (stats["early_copies"], stats["late_copies"]) == (MATRICES, MATRICES * (STEPS - 1))


def test_the_look_for_writes_through_data_comes_back_every_check_every_windows(caplog):
    from zenflow.host.early_copies import CHECK_EVERY
    model = _model()
    opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2,
                               overlap_step=True, device_sum_budget=0, worker=True)
    gen = torch.Generator().manual_seed(1)
    starts = 2 * (CHECK_EVERY - 2)   # well after the first, clean, look
    steps = starts + 2 * (CHECK_EVERY + 2)
    with opt, caplog.at_level("WARNING", logger="zenflow"):
        for t in range(steps):
            (_grad_scaled_through_data if t >= starts else _plain)(model, opt, gen)
            opt.step()
            opt.zero_grad()
            opt._pipeline.drain()
        assert "changed after backward" in caplog.text
        assert hooks(model) == 0
