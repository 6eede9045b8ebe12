"""deferred_credit="factored": "moments" with the window's squares as row and column sums and the
rates as row x column factors (docs/semantics.md; zenflow/host/credit_factored.py)."""
import os

import pytest
import torch

import zenflow
from zenflow.host.factored import fit_rates_, window_mean_square

from helpers.reference import SHAPES, factored_against_reference, random_case, run_pair

MATRICES = [i for i, s in enumerate(SHAPES) if len(s) >= 2]
ROWS_COLS = [(7, 9), (5, 6), (4, 12), (3, 1)]
SUMS = 4 * sum(r * c for r, c in ROWS_COLS)
FACTORS = [8 * r + 12 * c for r, c in ROWS_COLS]   # alpha, row sums [R]; beta, col sums, mask [C]
ALL = 10 ** 9


@pytest.mark.parametrize("seed", range(16))
def test_factored_matches_the_reference(seed):
    case = {**random_case(seed), "deferred_credit": "factored", "device_sum_budget": ALL}
    if seed % 3 == 0:
        case["install_lookahead"] = 1.0   # does not apply to "factored" matrices
    opt, _ = run_pair(case, seed)
    assert opt.stats()["moments_matrices"] == len(MATRICES)
    assert opt.stats()["device_sum_bytes"] == SUMS + sum(FACTORS)


@pytest.mark.parametrize("seed", range(4))
def test_matrices_without_room_for_the_factors_take_mean_credit(seed):
    case = {**random_case(seed), "deferred_credit": "factored",
            "device_sum_budget": SUMS + FACTORS[0] + FACTORS[1], "mean_credit": set(MATRICES[2:])}
    opt, _ = run_pair(case, seed)
    assert opt.stats()["moments_matrices"] == 2
    assert opt.stats()["device_sum_matrices"] == len(MATRICES)


def test_placement_puts_every_sum_first_then_the_factors_in_order():
    from zenflow.host.credit import FactoredCredit
    rule = FactoredCredit()
    shapes = [(10, 10), (5, 10), (2, 5)]
    numels = [100, 50, 10]
    f = [8 * 10 + 12 * 10, 8 * 5 + 12 * 10, 8 * 2 + 12 * 5]
    # bf16 sums (2 bytes): all three sums, then the factors of the first two
    assert rule.place(numels, 2 * 160 + f[0] + f[1], 2, [torch.bfloat16] * 3, shapes) == (
        [0, 1, 2], [0, 1])
    assert rule.place(numels, 4 * 150, 4, [torch.float32] * 3, shapes) == ([0, 1], [])


def test_a_bf16_model_keeps_about_two_bytes_per_deferred_parameter_on_the_device():
    """bf16 sums: 2 bytes per summed element plus O(rows + cols); "moments" keeps 10."""
    w = torch.nn.Parameter(torch.randn(256, 512, dtype=torch.bfloat16))
    opt = zenflow.ZenFlowAdamW([w], lr=1e-3, topk_ratio=0.1, update_interval=4, worker=False,
                               deferred_credit="factored", device_sum_budget=ALL,
                               device_sum_dtype="bfloat16")
    w.grad = torch.randn_like(w)
    opt.step()
    deferred = 256 * (512 - 52)
    per_param = opt.stats()["device_sum_bytes"] / deferred
    assert opt._pipeline.device_sums.sums[0].dtype == torch.bfloat16
    assert opt.stats()["device_sum_bytes"] == 2 * 256 * 512 + 8 * 256 + 12 * 512
    assert 2.2 < per_param < 2.3   # 2.27: 10% of the columns are the device's; 2.0 at 7B shapes
    opt.close()


def test_the_allocator_sees_at_most_2_5_bytes_per_deferred_parameter_in_that_budget():
    """Issue 36's budget, measured where the memory comes from: the bytes the first step (which
    places the sums and the rule's state) leaves allocated, by the profiler's count of the CPU
    allocator's events, for bf16 matrices given 2.5 bytes per parameter: every matrix under
    "factored" (the defaults: its rule, bf16 sums), within the budget, and what stats() says."""
    from torch.profiler import ProfilerActivity, profile
    shapes = [(512, 1024), (1024, 512), (768, 768)]
    params = [torch.nn.Parameter(torch.randn(*s, dtype=torch.bfloat16)) for s in shapes]
    numel = sum(p.numel() for p in params)
    opt = zenflow.ZenFlowAdamW(params, lr=1e-3, topk_ratio=0.05, update_interval=4, worker=False,
                               device_sum_budget=int(2.5 * numel))
    for p in params:
        p.grad = torch.randn_like(p)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    kept = sum(e.self_cpu_memory_usage for e in prof.events())
    stats = opt.stats()
    opt.close()
    assert stats["moments_matrices"] == len(shapes)
    deferred = sum(r * (c - max(1, round(0.05 * c))) for r, c in shapes)
    assert stats["device_sum_bytes"] <= kept <= 1.01 * stats["device_sum_bytes"]
    assert 2.0 < kept / deferred <= 2.5, kept / deferred


def _run(rows, cols, grads, **kw):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(rows, cols))
    twin = torch.nn.Parameter(w.detach().clone())
    opt = zenflow.ZenFlowAdamW([w], worker=False, device_sum_budget=ALL, **kw)
    return w, twin, opt


def test_one_step_windows_without_overlap_are_adamw():
    """n = 1: the factored estimate of the mean square is exact, and the install writes the
    host's values over the interim step."""
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(6, 10, generator=gen) for _ in range(6)]
    w, twin, opt = _run(6, 10, grads, lr=1e-2, topk_ratio=0.0, update_interval=1,
                        overlap_step=False, deferred_credit="factored")
    adamw = torch.optim.AdamW([twin], lr=1e-2)
    for g in grads:
        w.grad, twin.grad = g.clone(), g.clone()
        opt.step()
        adamw.step()
        torch.testing.assert_close(w.detach(), twin.detach(), rtol=1e-5, atol=1e-6)
    assert opt.stats()["moments_matrices"] == 1
    opt.close()


def test_a_window_of_a_constant_gradient_moves_as_far_as_adamw():
    g = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    w, twin, opt = _run(5, 8, None, lr=1e-2, weight_decay=0.0, topk_ratio=0.0,
                        update_interval=4, overlap_step=False, deferred_credit="factored")
    adamw = torch.optim.AdamW([twin], lr=1e-2, weight_decay=0.0)
    for _ in range(8):
        w.grad, twin.grad = g.clone(), g.clone()
        opt.step()
        adamw.step()
    torch.testing.assert_close(w.detach(), twin.detach(), rtol=1e-5, atol=1e-6)
    opt.close()


def test_the_mean_square_estimate_is_exact_for_equal_gradients_and_keeps_column_sums():
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(4, 6, generator=gen)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    n = 3
    squares = (g * mask) ** 2
    exact = window_mean_square(n * g, n * squares.sum(1), n * squares.sum(0), mask, n)
    torch.testing.assert_close(exact, g * g, rtol=1e-6, atol=0)
    # Unequal gradients: the host's columns' estimated mean squares sum, per column, to the
    # window's true mean square (Adafactor's estimate keeps the column sums).
    grads = [torch.randn(4, 6, generator=gen) for _ in range(n)]
    total = sum(grads)
    true = sum((x * mask) ** 2 for x in grads) / n
    estimate = window_mean_square(total, n * true.sum(1), n * true.sum(0), mask, n)
    keep = mask.bool()
    torch.testing.assert_close(estimate[:, keep].sum(0), true[:, keep].sum(0), rtol=1e-5,
                               atol=1e-6)
    assert (estimate >= (total / n) ** 2 - 1e-7).all()


def test_the_fit_recovers_rates_that_are_a_row_times_a_column():
    gen = torch.Generator().manual_seed(4)
    u, v = torch.rand(5, generator=gen) + 0.5, torch.rand(7, generator=gen) * 100 + 1
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    rate = torch.outer(u, v)
    rate[:, 1] = 1e8   # the device's columns: whatever the host holds there is not fitted
    alpha, beta = torch.zeros(5), torch.zeros(7)
    fit_rates_(rate, mask, alpha, beta)
    keep = mask.bool()
    torch.testing.assert_close(torch.outer(alpha, beta)[:, keep], rate[:, keep], rtol=1e-5,
                               atol=0)
    assert not beta[~keep].any()


def test_the_device_steps_the_deferred_columns_every_step_between_installs():
    moved = {}
    for credit in ("mean", "factored"):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(8, 12))
        opt = zenflow.ZenFlowAdamW([w], lr=1e-2, topk_ratio=0.25, update_interval=4,
                                   deferred_credit=credit, device_sum_budget=ALL,
                                   install_lookahead=0.0, worker=False)
        gen = torch.Generator().manual_seed(1)
        for _ in range(9):   # two windows ended: an update installed at step 8
            w.grad = torch.randn(8, 12, generator=gen)
            opt.step()
        deferred = torch.ones(12, dtype=torch.bool)
        deferred[opt._host_params[0].selected.column_indices] = False
        before = w.detach()[:, deferred].clone()
        w.grad = torch.randn(8, 12, generator=gen)
        opt.step()    # a step inside the third window
        moved[credit] = (w.detach()[:, deferred] - before).abs().max().item()
        opt.close()
    assert moved["mean"] == 0.0
    assert moved["factored"] > 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overlap", [True, False])
def test_bf16_and_fp32_weights_equal_the_reference(dtype, overlap):
    """The interim steps and the install's correction compute in fp32 and round once to the
    weights' dtype, as the reference: bf16 weights equal it bit for bit here."""
    ours, theirs, stats = factored_against_reference(dtype, "float32", overlap)  # reference: fp32
    for t, (a, b) in enumerate(zip(ours, theirs)):
        for p, r in zip(a, b):
            if dtype == torch.bfloat16:
                assert torch.equal(p, r), f"step {t}"
            else:
                torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    assert stats["reselections"] > 0 and stats["moments_matrices"] == len(MATRICES)


def test_bf16_sums_stay_close_to_fp32_sums():
    """device_sum_dtype="bfloat16" rounds the running sum (as under "mean"); the host widens it
    exactly, and the install's correction reads it widened."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(16, 24))
        opt = zenflow.ZenFlowAdamW([w], lr=1e-3, topk_ratio=0.25, update_interval=4,
                                   deferred_credit="factored", device_sum_budget=ALL,
                                   device_sum_dtype=dtype, worker=False)
        gen = torch.Generator().manual_seed(1)
        for _ in range(12):
            w.grad = torch.randn(16, 24, generator=gen)
            opt.step()
        assert opt._pipeline.device_sums.sums[0].dtype == getattr(torch, dtype)
        out[dtype] = w.detach().clone()
        opt.close()
    assert not torch.equal(out["float32"], out["bfloat16"])
    torch.testing.assert_close(out["bfloat16"], out["float32"], rtol=0, atol=3e-4)


def test_fsdp2_shards_and_ddp_replicas_take_factored_credit():
    """FSDP2's ranks hold whole rows (their shards) and each fits the factors of its own rows;
    DDP's ranks each fit their row block of the replicas (tests/test_ddp_factored.py): "factored"
    stays on both. Only where no sum can be on the device does every matrix take "mean"."""
    from zenflow.distributed import Partition
    from zenflow.host.credit import Credit, FactoredCredit, credit_for
    fsdp2 = Partition(rank=0, world_size=2, rows_are_local=True)
    ddp = Partition(rank=0, world_size=2)
    for cuda in (False, True):
        for partition in (Partition(), fsdp2, ddp):
            rule = credit_for("factored", ALL, cuda, partition.splits_rows)
            assert type(rule) is FactoredCredit and rule.host_factors
    for args in ((0, True, ddp.splits_rows), ("auto", False, ddp.splits_rows),
                 (0, True, fsdp2.splits_rows), ("auto", False, fsdp2.splits_rows)):
        rule = credit_for("factored", *args)
        assert type(rule) is Credit and not rule.host_factors


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


SETTINGS = dict(lr=1e-2, topk_ratio=0.25, update_interval=3, device_sum_budget=ALL,
                install_lookahead=0.0, worker=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("load_before_first_step", [True, False])
def test_a_state_saved_mid_window_resumes_exactly(load_before_first_step, dtype):
    """Mid-window, with an update in flight: the window's row and column sums, the device's
    factors and the in-flight update's factors are all in the state."""
    settings = dict(SETTINGS, deferred_credit="factored",
                    device_sum_dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    model = _model(dtype=dtype)
    opt = zenflow.ZenFlowAdamW(model.parameters(), **settings)
    _train(model, opt, 8)    # mid-window, an update in flight
    saved, weights = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    assert saved["zenflow"]["in_flight_jobs"][0][-1] is True
    host = saved["state"][0]["host"]
    assert host["row_factors"].shape == (3, 16) and host["col_factors"].shape == (3, 12)
    assert host["row_factors"].abs().min() > 0   # sums of 2 gradients, both factors set
    _train(model, opt, 7, seed=2)
    resumed = _model(seed=3, dtype=dtype)
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


def test_a_factored_state_loads_under_moments_with_its_rates_and_back():
    """Across the two rules: "moments" takes alpha_i * beta_j as its rates and estimates the
    window's squares from its sum; "factored" takes no rates until the next install (as a state
    older than the rates) and the row and column sums of the squares each gradient would have if
    it were the window's mean (the columns the loaded selection leaves the host); "mean" takes
    the values. All train on."""
    model = _model()
    opt = zenflow.ZenFlowAdamW(model.parameters(), **SETTINGS, deferred_credit="factored")
    _train(model, opt, 8)
    saved = opt.state_dict()
    credit = opt._pipeline.credit
    rates = torch.outer(credit.alpha[0], credit.beta[0])
    moments = zenflow.ZenFlowAdamW(model.parameters(), **SETTINGS, deferred_credit="moments")
    moments.load_state_dict(saved)
    assert torch.equal(moments.state_dict()["state"][0]["host"]["rate"], rates)
    _train(model, moments, 2)
    back = moments.state_dict()
    host = back["state"][0]["host"]
    assert "row_factors" not in host and host["num_grads"] == 1
    factored = zenflow.ZenFlowAdamW(model.parameters(), **SETTINGS, deferred_credit="factored")
    factored.load_state_dict(back)
    factored._pipeline.place()    # as the first step does
    fc = factored._pipeline.credit
    mask = torch.ones(12)
    mask[factored._host_params[0].selected.column_indices] = 0.0
    squares = host["grad_sum"].square() / host["num_grads"] * mask
    assert not fc.alpha[0].any() and not fc.beta[0].any()
    torch.testing.assert_close(fc.col_sq[0], squares.sum(0), rtol=1e-6, atol=0)
    torch.testing.assert_close(fc.row_sq[0], squares.sum(1), rtol=1e-6, atol=0)
    _train(model, factored, 6)
    assert fc.alpha[0].all()
    mean = zenflow.ZenFlowAdamW(model.parameters(), **SETTINGS, deferred_credit="mean")
    mean.load_state_dict(saved)
    _train(model, mean, 4)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for o in (opt, moments, factored, mean):
        o.close()


def test_a_version_5_state_loads():
    """Format 5 had no "factored" flag in its in-flight jobs."""
    model = _model()
    opt = zenflow.ZenFlowAdamW(model.parameters(), **SETTINGS, deferred_credit="moments")
    _train(model, opt, 8)
    saved = opt.state_dict()
    jobs = saved["zenflow"]["in_flight_jobs"]
    old = {**saved, "zenflow": {**saved["zenflow"], "format_version": 5,
                                "in_flight_jobs": [j[:10] for j in jobs]}}
    again = zenflow.ZenFlowAdamW(model.parameters(), **SETTINGS, deferred_credit="moments")
    again.load_state_dict(old)
    assert again.state_dict()["zenflow"]["in_flight_jobs"] == jobs
    opt.close()
    again.close()


@pytest.mark.parametrize("widen", [False, True])
@pytest.mark.parametrize("teams", [None, "nodes", "cores"])
def test_the_host_update_in_row_blocks_equals_the_whole_matrix_arithmetic(monkeypatch, widen,
                                                                          teams):
    """The worker's "factored" update goes in blocks of rows (zenflow/host/factored.py): each
    block's row sums whole, its column sums added in block order, on the NUMA teams, on a
    thread per core, or in the calling thread; the same values as the whole-matrix functions,
    block size and threads aside."""
    from zenflow.host import factored
    from zenflow.host.buffers import HostState
    from zenflow.host.factored import update_whole_
    from zenflow.host.layout import HostJob, HostLayout, HostUpdate
    from zenflow.host.teams import NodeTeams
    rows, cols, n, step = 37, 23, 3, 5
    monkeypatch.setattr(factored, "ROW_BLOCK", 4 * cols)   # 10 blocks, the last of one row
    monkeypatch.setattr(factored, "_SMALL", 0)             # each in the threads' scratch
    host = HostState.allocate(HostLayout.build([(rows, cols, torch.bfloat16)], sum_slots=2,
                                               factors=True), "test")
    gen = torch.Generator().manual_seed(9)
    x, m, v = (host.fp32(k, 0) for k in ("master", "exp_avg", "exp_avg_sq"))
    x.copy_(torch.randn(rows, cols, generator=gen))
    m.copy_(torch.randn(rows, cols, generator=gen) * 1e-2)
    v.copy_(torch.rand(rows, cols, generator=gen) * 1e-3)
    grad_sum = torch.randn(rows, cols, generator=gen)
    if widen:   # a bf16 sum from the device, landed in the first half of its fp32 slot
        grad_sum = grad_sum.bfloat16().float()
        host.fp32("grad_sum0", 0).view(-1).view(torch.bfloat16)[:rows * cols].copy_(
            grad_sum.view(-1))
    else:
        host.fp32("grad_sum0", 0).copy_(grad_sum)
    row_sq, col_sq, deferred, alpha, beta = host.factors(0)
    squares = torch.rand(rows, cols, generator=gen) * n
    deferred.fill_(1.0)
    deferred[[2, 7, 8]] = 0.0
    row_sq.copy_((squares * deferred).sum(1))
    col_sq.copy_(squares.sum(0))
    u = HostUpdate(3e-3, 0.9, 0.999, 1e-8, 0.01, moments=True, factored=True)
    # the whole-matrix arithmetic, on copies
    want = [t.clone() for t in (x, m, v)]
    want_alpha, want_beta = torch.zeros(rows), torch.zeros(cols)
    update_whole_(*want, grad_sum, row_sq, col_sq, deferred, want_alpha, want_beta, step, n,
                  lr=u.lr, beta1=u.beta1, beta2=u.beta2, eps=u.eps, weight_decay=u.weight_decay)
    pool = None
    cpus = sorted(os.sched_getaffinity(0))
    if teams == "nodes":   # as if the arena were shared out over two nodes, each with a team
        host.arena.nodes, pool = [0, 1], NodeTeams([cpus[:1], cpus[1:2] or cpus[:1]])
        host.teams = pool
    elif teams == "cores":   # the worker's lanes: a thread per core
        pool = host.lanes = NodeTeams([cpus], per_core=True)
    if pool is not None:
        ran = pool.run
        handed = []
        pool.run = lambda shares: handed.append(shares) or ran(shares)
    try:
        host.update([HostJob(0, step, n, u, widen=widen)], 0)
    finally:
        if pool is not None:
            pool.close()
    if teams == "nodes":   # both passes shared out: the blocks alternate between the teams
        assert [[len(share) for share in shares] for shares in handed] == [[5, 5], [5, 5]]
    elif teams == "cores":   # ... or go to the one node's cores
        assert [[len(share) for share in shares] for shares in handed] == [[10], [10]]
    for got, expected in zip((x, m, v, alpha, beta), (*want, want_alpha, want_beta)):
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-9)
    assert torch.equal(host.install(0), x.bfloat16())
    assert not beta[deferred == 0].any()
    host.arena.release()
