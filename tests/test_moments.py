"""deferred_credit="moments": the host's moments take a window as n AdamW steps would, and the
device steps the deferred columns at the host's rates between installs (docs/semantics.md)."""
import pytest
import torch

import zenflow

from helpers.reference import SHAPES, random_case, run_pair

# The matrices of SHAPES: (7, 9), (5, 3, 2) as (5, 6), (4, 12), (3, 1). Every fp32 sum (4 bytes
# an element) goes on the device first; HALF then fits the squares and fp32 rates (8 bytes) of
# the first two.
HALF = 4 * (7 * 9 + 5 * 6 + 4 * 12 + 3 * 1) + 8 * (7 * 9 + 5 * 6)
ALL = 10 ** 9
MATRICES = [i for i, s in enumerate(SHAPES) if len(s) >= 2]


@pytest.mark.parametrize("seed", range(24))
def test_moments_match_the_reference(seed):
    case = {**random_case(seed), "deferred_credit": "moments", "device_sum_budget": ALL}
    if seed % 3 == 0:
        case["install_lookahead"] = 1.0
    opt, _ = run_pair(case, seed)
    assert opt.stats()["moments_matrices"] == len(MATRICES)


@pytest.mark.parametrize("seed", range(8))
def test_matrices_without_room_for_moments_take_mean_credit(seed):
    case = {**random_case(seed), "deferred_credit": "moments", "device_sum_budget": HALF,
            "mean_credit": set(MATRICES[2:])}
    opt, _ = run_pair(case, seed)
    assert opt.stats()["moments_matrices"] == 2
    assert opt.stats()["device_sum_matrices"] == len(MATRICES)


def test_every_sum_goes_on_the_device_before_any_matrix_takes_moments():
    """A sum on the device saves a gradient's copy every step; "moments" better windows. A tight
    device gets every sum it can hold first, then "moments" for what is left, in order."""
    from zenflow.host.credit import choose_placement
    assert choose_placement([100, 50, 10], 4 * 160 + 8 * 60, 8) == ([0, 1, 2], [1, 2])
    assert choose_placement([100, 50, 10], 4 * 150, 8) == ([0, 1], [])
    assert choose_placement([100, 50, 10], 10 ** 6, 0) == ([0, 1, 2], [])


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 6)).to(dtype)


def _train(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 12, generator=gen).to(next(model.parameters()).dtype)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_one_step_windows_without_overlap_are_adamw():
    """n = 1: the moments of one step are AdamW's, and the install writes the host's values over
    the device's interim step."""
    model, twin = _model(), _model()
    opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.0, update_interval=1,
                               overlap_step=False, deferred_credit="moments",
                               device_sum_budget=ALL, worker=False)
    adamw = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    _train(model, opt, 6)
    _train(twin, adamw, 6)
    assert opt.stats()["moments_matrices"] == 2
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    opt.close()


def test_a_window_of_a_constant_gradient_moves_as_far_as_adamw():
    """With the same gradient every step, n AdamW steps move each value n * lr * m_hat / (sqrt(
    v_hat) + eps) with the moments the window's; "moments" does it in one host step."""
    w = torch.nn.Parameter(torch.randn(5, 8))
    twin = torch.nn.Parameter(w.detach().clone())
    g = torch.randn(5, 8)
    opt = zenflow.ZenFlowAdamW([w], lr=1e-2, weight_decay=0.0, topk_ratio=0.0, update_interval=4,
                               overlap_step=False, deferred_credit="moments",
                               device_sum_budget=ALL, worker=False)
    adamw = torch.optim.AdamW([twin], lr=1e-2, weight_decay=0.0)
    for _ in range(8):
        w.grad, twin.grad = g.clone(), g.clone()
        opt.step()
        adamw.step()
    torch.testing.assert_close(w.detach(), twin.detach(), rtol=1e-5, atol=1e-6)
    opt.close()


def test_the_device_steps_the_deferred_columns_every_step_between_installs():
    """With overlap, "moments" moves the deferred columns at every step of a window (after the
    first install brought the host's rates); "mean" leaves them until the next install."""
    moved = {}
    for credit in ("mean", "moments"):
        model = _model()
        opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25,
                                   update_interval=4, deferred_credit=credit,
                                   device_sum_budget=ALL, install_lookahead=0.0, worker=False)
        _train(model, opt, 9)   # two windows ended: an update was installed at step 8
        weight = model[0].weight
        deferred = torch.ones(weight.shape[1], dtype=torch.bool)
        deferred[opt._host_params[0].selected.column_indices] = False
        before = weight.detach()[:, deferred].clone()
        _train(model, opt, 1, seed=5)   # a step inside the third window
        moved[credit] = (weight.detach()[:, deferred] - before).abs().max().item()
        opt.close()
    assert moved["mean"] == 0.0
    assert moved["moments"] > 1e-4


@pytest.mark.parametrize("load_before_first_step", [True, False])
def test_a_state_saved_mid_window_resumes_exactly(load_before_first_step):
    settings = dict(lr=1e-2, topk_ratio=0.25, update_interval=3, deferred_credit="moments",
                    device_sum_budget=ALL, install_lookahead=0.0, worker=False)
    model = _model()
    opt = zenflow.ZenFlowAdamW(model.parameters(), **settings)
    _train(model, opt, 8)    # mid-window, an update in flight
    saved, weights = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, 7, seed=2)
    resumed = _model(seed=3)
    again = zenflow.ZenFlowAdamW(resumed.parameters(), **settings)
    if not load_before_first_step:   # the sums already placed on the device
        _train(resumed, again, 1, seed=4)
    resumed.load_state_dict(weights)
    again.load_state_dict(saved)
    _train(resumed, again, 7, seed=2)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert again.stats()["moments_matrices"] == 2
    opt.close()
    again.close()


def test_a_version_3_state_loads_with_the_squares_of_its_mean():
    """Format 3 saved no squares nor rates: a window in progress gets n * mean^2 (as if every
    gradient had been the mean), and no rates until the next install; a state loaded and saved
    again before any step keeps what it loaded."""
    settings = dict(lr=1e-2, topk_ratio=0.25, update_interval=3, deferred_credit="moments",
                    device_sum_budget=ALL, worker=False)
    model = _model()
    opt = zenflow.ZenFlowAdamW(model.parameters(), **settings)
    _train(model, opt, 8)
    saved = opt.state_dict()
    host = saved["state"][0]["host"]
    assert host["num_grads"] == 2 and host["rate"].abs().sum() > 0
    again = zenflow.ZenFlowAdamW(model.parameters(), **settings)
    again.load_state_dict(saved)
    kept = again.state_dict()["state"][0]["host"]
    assert torch.equal(kept["grad_sq_sum"], host["grad_sq_sum"])
    assert torch.equal(kept["rate"], host["rate"])
    old = {**saved, "zenflow": {**saved["zenflow"], "format_version": 3},
           "state": {k: {**v, "host": {n: t for n, t in v["host"].items()
                                       if n not in ("grad_sq_sum", "rate")}}
                     if v["kind"] == "host" else v for k, v in saved["state"].items()}}
    again.load_state_dict(old)
    migrated = again.state_dict()["state"][0]["host"]
    torch.testing.assert_close(migrated["grad_sq_sum"], host["grad_sum"].square() / 2)
    assert not migrated["rate"].any()
    _train(model, again, 2)   # and it trains on
    again.close()
    opt.close()


def test_synchronize_shows_the_host_values_as_the_reference_does():
    from zenflow.optim.reference import ReferenceZenFlow
    gen = torch.Generator().manual_seed(0)
    shape = (6, 10)
    value = torch.randn(shape, generator=gen)
    p, r = value.clone().requires_grad_(), value.clone()
    settings = dict(lr=0.05, topk_ratio=0.2, update_interval=3, overlap_step=True,
                    deferred_credit="moments", install_lookahead=0.0)
    opt = zenflow.ZenFlowAdamW([p], **settings, device_sum_budget=ALL,
                               select_strategy="step", select_interval=10 ** 6)
    ref = ReferenceZenFlow([r], **settings)
    for t in range(11):
        g = torch.randn(shape, generator=gen)
        p.grad = g.clone()
        opt.step()
        ref.step([g.clone()])
        if t in (4, 8):
            opt.synchronize()
            ref.synchronize()
        torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6, msg=f"step {t}")
    opt.close()


def test_data_parallel_replicas_take_mean_credit():
    """Under DDP each rank sums only its rows, and every replica must move alike: "moments"
    would need every rank's rates and sums, so the pipeline takes "mean" there (FSDP2's shards,
    whose rows are local, keep "moments")."""
    from zenflow.distributed import Partition
    from zenflow.host.credit import MomentsCredit, credit_for
    from zenflow.host.pipeline import HostPipeline
    from zenflow.host.telemetry import StepTimer
    w = torch.nn.Parameter(torch.randn(4, 6))
    for partition, budget, moves in (
            (Partition(rank=0, world_size=2), ALL, False),
            (Partition(rank=0, world_size=2, rows_are_local=True), ALL, True),
            (Partition(), ALL, True),
            # nor where no sum can be on the device: no rates in host memory then
            (Partition(), 0, False), (Partition(), "auto", False)):   # "auto" on a CPU: 0
        credit = credit_for("moments", budget, cuda=False, splits_rows=partition.splits_rows)
        pipe = HostPipeline([w], partition, torch.device("cpu"), overlap=True, worker_cores=None,
                            timer=StepTimer(), owner="test", credit=credit,
                            device_sum_budget=budget)
        assert isinstance(pipe.credit, MomentsCredit) is moves and pipe.layout.rates is moves
        pipe.close()


def test_a_row_that_saw_no_gradient_moves_at_most_lr_per_step():
    """An embedding's rare token: its row's v is 0, so its rate is 1 / eps. When a gradient
    arrives, the interim step and the install's correction stay within AdamW's own bound on a
    step, (1 - beta1) / sqrt(1 - beta2) = 3.16 times lr per gradient with the default betas,
    instead of moving it by lr * g / eps."""
    from zenflow.adamw import step_bound
    lr = 0.1 / step_bound(0.9, 0.999)   # the most AdamW moves a value per step: 0.1
    w = torch.nn.Parameter(torch.zeros(6, 4))
    opt = zenflow.ZenFlowAdamW([w], lr=lr, weight_decay=0.0, topk_ratio=0.0, update_interval=2,
                               deferred_credit="moments", device_sum_budget=ALL,
                               install_lookahead=0.0, worker=False)
    only_row_0 = torch.zeros(6, 4)
    only_row_0[0] = 1.0
    for _ in range(8):
        w.grad = only_row_0.clone()
        opt.step()
    assert not w.detach()[3].any()
    rare = torch.zeros(6, 4)
    rare[3] = 1.0
    w.grad = rare.clone()
    opt.step()    # the window's first step: an interim step only
    assert 0 < w.detach()[3].abs().max() <= 0.1 * (1 + 1e-6)
    w.grad = rare.clone()
    opt.step()    # the window's last: an install corrected for its 2 gradients, then handed off
    assert w.detach()[3].abs().max() <= 0.2 * (1 + 1e-6)
    opt.close()


def test_a_window_summed_on_the_host_resumes_under_moments_with_sane_steps():
    """A state saved mid-window where the matrix's sums were on the host (no squares summed),
    loaded where it takes "moments" (another device budget, another world size): the window's
    second moment is estimated from its sum (each gradient taken as the window's mean), not read
    as zero squares, so its steps stay within twice the uninterrupted run's largest (zero
    squares made its window-end step 2.4 times it here, 60 times in the field)."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(16, 12, generator=gen) * 0.1
    grads = [torch.randn(16, 12, generator=gen) for _ in range(16)]
    kw = dict(lr=1e-3, topk_ratio=0.25, update_interval=4, overlap_step=True, worker=False,
              deferred_credit="moments", select_strategy="step", select_interval=1000)

    def largest_steps(resumed: bool) -> float:
        w = torch.nn.Parameter(start.clone())
        opt = zenflow.ZenFlowAdamW([w], device_sum_budget=0 if resumed else ALL, **kw)
        for g in grads[:2]:   # mid-window: 2 gradients summed (on the host, if resumed)
            w.grad = g.clone()
            opt.step()
        if resumed:
            state = opt.state_dict()
            opt.close()
            w = torch.nn.Parameter(w.detach().clone())
            opt = zenflow.ZenFlowAdamW([w], device_sum_budget=ALL, **kw)
            opt.load_state_dict(state)
        largest = 0.0
        for g in grads[2:]:
            before = w.detach().clone()
            w.grad = g.clone()
            opt.step()
            opt.wait_for_install()
            largest = max(largest, float((w.detach() - before).abs().max()))
        opt.close()
        return largest

    assert largest_steps(resumed=True) < 2 * largest_steps(resumed=False)
