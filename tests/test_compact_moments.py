"""host_moments_dtype="bfloat16": Adam's moments in bf16 on the host, the arithmetic in fp32, the
second moment rounded back stochastically with bits of the new master value
(zenflow/host/compact_moments.py)."""
from __future__ import annotations

import pytest
import torch

import zenflow
from zenflow.host.buffers import HostState, landing_of
from zenflow.host.compact_moments import round_stochastic_
from zenflow.host.layout import HostJob, HostLayout, HostUpdate

from helpers.host_update import JOBS, SHAPES


def _rounded(values: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """The rule, written out: add the low 16 bits of source's to values' bits, keep the high 16
    (as fp32)."""
    draw = source.view(torch.int32) & 0xFFFF
    return ((values.view(torch.int32) + draw) & -0x10000).view(torch.float32)


def test_stochastic_rounding_lands_on_a_neighbour_with_the_source_bits():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(10_000, generator=gen) * 1e-3
    source = torch.randn(10_000, generator=gen)
    out = torch.empty(10_000, dtype=torch.bfloat16)
    noise = torch.empty(10_000, dtype=torch.int32)
    round_stochastic_(out, values.clone(), source, noise)
    assert torch.equal(out.float(), _rounded(values, source))
    down = (values.view(torch.int32) & -0x10000).view(torch.float32)   # toward zero
    up = ((values.view(torch.int32) & -0x10000) + 0x10000).view(torch.float32)
    assert bool(((out.float() == down) | (out.float() == up)).all())
    assert bool((out.float() != down).any()) and bool((out.float() != up).any())
    exact = values.bfloat16()   # bf16 values stay what they are, whatever the bits
    round_stochastic_(out, exact.float(), source, noise)
    assert torch.equal(out, exact)


def test_the_rounded_second_moment_follows_a_slow_decay_that_nearest_rounding_stalls():
    """v <- beta2 v + (1 - beta2) target moves 0.1% a step, under half a bf16 ulp: to nearest it
    never moves; stochastically it tracks the fp32 value."""
    gen = torch.Generator().manual_seed(1)
    n = 4096
    exact = torch.ones(n)
    stochastic = torch.ones(n, dtype=torch.bfloat16)
    nearest = torch.ones(n, dtype=torch.bfloat16)
    noise = torch.empty(n, dtype=torch.int32)
    for _ in range(1500):
        exact = exact * 0.999 + 0.001 * 0.25
        nearest = (nearest.float() * 0.999 + 0.001 * 0.25).bfloat16()
        round_stochastic_(stochastic, stochastic.float() * 0.999 + 0.001 * 0.25,
                          torch.randn(n, generator=gen), noise)
    assert torch.equal(nearest, torch.ones(n, dtype=torch.bfloat16))
    assert abs(stochastic.float().mean().item() / exact[0].item() - 1) < 2e-3


def _factored_job(i: int, step: int = 4, n: int = 3) -> HostJob:
    return HostJob(i, step, n, HostUpdate(2e-3, 0.9, 0.999, 1e-8, 0.01, moments=True,
                                          factored=True))


@pytest.mark.parametrize("rule", ["passes", "factored"])
def test_the_compact_update_is_the_fp32_update_with_its_moments_rounded(rule):
    """From the same (bf16-valued) moments, the update with bf16 moments leaves the master, the
    install values, the rates and the factors bit for bit as with fp32 moments, the first moment
    the fp32 one rounded to nearest and the second rounded by the rule."""
    jobs = JOBS if rule == "passes" else [_factored_job(i) for i in range(len(SHAPES))]
    hosts = [HostState.allocate(HostLayout.build(SHAPES, sum_slots=2, rates=True,
                                                 factors=rule == "factored",
                                                 moments_dtype=dtype))
             for dtype in (torch.float32, torch.bfloat16)]
    gen = torch.Generator().manual_seed(3)
    fills = {"master": torch.randn, "exp_avg": lambda *s, **k: torch.randn(*s, **k) * 1e-2,
             "exp_avg_sq": lambda *s, **k: torch.rand(*s, **k) * 1e-3,
             "grad_sum0": torch.randn, "grad_sum1": lambda *s, **k: torch.rand(*s, **k) * 4,
             "factors": torch.rand}
    for name, fill in fills.items():
        if name not in hosts[0].arena.views:
            continue
        values = fill(hosts[0].arena.views[name].shape, generator=gen)
        if name.startswith("exp_avg"):
            values = values.bfloat16().float()
        for host in hosts:
            host.arena.views[name].copy_(values)
    for job in jobs:
        if job.widen:   # a device's bf16 sum, landed in the first half of the fp32 slot
            values = torch.randn(SHAPES[job.matrix][:2], generator=gen)
            for host in hosts:
                landing_of(host.fp32("grad_sum0", job.matrix), torch.bfloat16).copy_(values)
    if rule == "factored":   # a mask of the host's columns (the device owns every third)
        for host in hosts:
            for i in range(len(SHAPES)):
                host.factors(i)[2].copy_((torch.arange(SHAPES[i][1]) % 3 != 0).float())
    for host in hosts:
        host.update(jobs, 0)
    fp32, compact = (host.arena.views for host in hosts)
    for name in ("master", "install_bfloat16", "install_float32", "rate_bfloat16",
                 "rate_float32", *(["factors"] if rule == "factored" else [])):
        # (exactly; a matrix of no rows has NaN column factors either way)
        assert torch.allclose(fp32[name], compact[name], rtol=0, atol=0, equal_nan=True), name
    updated = torch.cat([torch.arange(m.offset, m.offset + m.numel)
                         for m in (hosts[0].layout.matrices[job.matrix] for job in jobs)])
    master = fp32["master"][updated]
    assert compact["exp_avg"].dtype == compact["exp_avg_sq"].dtype == torch.bfloat16
    assert torch.equal(compact["exp_avg"][updated], fp32["exp_avg"][updated].bfloat16())
    assert torch.equal(compact["exp_avg_sq"][updated].float(),
                       _rounded(fp32["exp_avg_sq"][updated], master))
    for host in hosts:
        host.arena.release()


def _model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 8)).to(dtype)


def _train(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(16, 24, generator=gen).bfloat16()).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


SETTINGS = dict(lr=3e-3, topk_ratio=0.25, update_interval=3, device_sum_budget=1 << 30,
                host_moments_dtype="bfloat16", worker=False)


@pytest.mark.parametrize("credit", ["factored", "mean"])
def test_training_with_compact_moments_follows_fp32_moments(credit):
    """The host keeps 4 bytes less per parameter, and a bf16 model trains as with fp32 moments
    (the same reselections and selections: rounding aside, the same run)."""
    runs = {}
    for dtype in ("float32", "bfloat16"):
        model = _model()
        opt = zenflow.ZenFlowAdamW(model.parameters(), **dict(
            SETTINGS, deferred_credit=credit, host_moments_dtype=dtype))
        losses = _train(model, opt, 30)
        opt.synchronize()
        runs[dtype] = (losses, [p.float() for p in model.parameters()],
                       opt._pipeline.host.nbytes(), opt._pipeline.layout.numel)
        opt.close()
    (loss32, w32, bytes32, numel), (loss16, w16, bytes16, _) = runs.values()
    assert bytes32 - bytes16 == 4 * numel
    assert abs(loss16[-1] / loss32[-1] - 1) < 0.02 and loss16[-1] < 0.5 * loss16[0]
    for a, b in zip(w32, w16):
        assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_the_worker_rounds_as_the_training_process_does_and_a_resume_is_exact():
    """The rounding's bits come from the state alone: the worker process and the in-process
    runner give the same weights, and a state saved mid-window (fp32 moments, bf16 values)
    resumes bit for bit."""
    weights = []
    for worker in (False, True):
        model = _model()
        opt = zenflow.ZenFlowAdamW(model.parameters(), **dict(SETTINGS, worker=worker))
        _train(model, opt, 8)
        if not worker:
            saved = opt.state_dict()
            kept = {k: v.clone() for k, v in model.state_dict().items()}
            host = saved["state"][0]["host"]
            assert host["exp_avg_sq"].dtype == torch.float32
            assert torch.equal(host["exp_avg_sq"], host["exp_avg_sq"].bfloat16().float())
        _train(model, opt, 7, seed=2)
        weights.append([p.clone() for p in model.parameters()])
        opt.close()
    assert all(torch.equal(a, b) for a, b in zip(*weights))
    resumed = _model()
    again = zenflow.ZenFlowAdamW(resumed.parameters(), **SETTINGS)
    resumed.load_state_dict(kept)
    again.load_state_dict(saved)
    _train(resumed, again, 7, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(weights[0], resumed.parameters()))
    again.close()


def test_a_state_saved_with_fp32_moments_loads_into_compact_ones():
    model = _model()
    opt = zenflow.ZenFlowAdamW(model.parameters(), **dict(SETTINGS, host_moments_dtype="float32"))
    _train(model, opt, 5)
    saved = opt.state_dict()
    opt.close()
    again = zenflow.ZenFlowAdamW(_model().parameters(), **SETTINGS)
    again.load_state_dict(saved)
    host = again.state_dict()["state"][0]["host"]
    assert torch.equal(host["exp_avg"], saved["state"][0]["host"]["exp_avg"].bfloat16().float())
    again.close()


def test_host_moments_dtype_is_checked():
    with pytest.raises(ValueError, match="host_moments_dtype.*float16"):
        zenflow.ZenFlowAdamW(torch.nn.Linear(4, 4).parameters(), host_moments_dtype="float16")
