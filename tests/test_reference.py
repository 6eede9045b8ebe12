"""ZenFlowAdamW against zenflow.optim.reference on random settings and random gradient sequences."""

import pytest
import torch

import zenflow
from zenflow.optim.reference import ReferenceZenFlow

from helpers.reference import random_case, run_pair, run_pair_once


@pytest.mark.parametrize("seed", range(60))
def test_matches_reference(seed):
    run_pair(random_case(seed), seed)


@pytest.mark.slow   # a sweep of seeds
def test_sweep_covers_reselection_and_overlap():
    """The sweep is only worth something if its cases exercise the interesting paths."""
    cases = [random_case(s) for s in range(60)]
    assert sum(c["overlap_step"] for c in cases) >= 15
    assert sum(c["select_interval"] is not None for c in cases) >= 15
    assert sum(c["max_grad_norm"] is not None for c in cases) >= 15
    assert sum(c["full_warm_up_rounds"] > 0 for c in cases) >= 15
    reselected = sum(run_pair(c, s)[0].num_reselections > 0 for s, c in enumerate(cases[:20]))
    assert reselected >= 4


def test_auto_reselection_matches_reference_given_its_decisions():
    """'auto' decides at run time; the reference replays the decisions it made."""
    gen = torch.Generator().manual_seed(7)
    shape = (6, 10)
    value = torch.randn(shape, generator=gen)
    p, r = value.clone().requires_grad_(), value.clone()
    opt = zenflow.ZenFlowAdamW([p], lr=0.05, topk_ratio=0.2, update_interval=2,
                               overlap_step=True, select_interval="auto")
    ref = ReferenceZenFlow([r], lr=0.05, topk_ratio=0.2, update_interval=2, overlap_step=True)
    for t in range(30):
        g = torch.randn(shape, generator=gen)
        g[:, (t // 6) % 5 * 2] *= 20  # the important column moves every 6 steps
        p.grad = g.clone()
        before = len(opt.decisions)
        opt.step()
        reselected = any(kind == "reselect" for _, kind in opt.decisions[before:])
        ref.step([g.clone()], reselect=reselected)
        torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)
    assert opt.num_reselections >= 2
    opt.close()


# The matrices of SHAPES are (7, 9), (5, 3, 2) as (5, 6), (4, 12) and (3, 1): 4 bytes per element
# of a sum. HALF fits the first two.
HALF = 4 * (7 * 9 + 5 * 6)
ALL = 10 ** 9


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("budget", [HALF, ALL], ids=["half-on-device", "all-on-device"])
def test_window_sums_on_the_device_match_the_reference_and_the_host_sums_bit_for_bit(seed, budget):
    case = random_case(seed)
    opt, on_device = run_pair({**case, "device_sum_budget": budget}, seed)
    stats = opt.stats()
    summed = len([m for m in opt._host_params if m.param.ndim >= 2])
    assert stats["device_sum_matrices"] == (min(2, summed) if budget == HALF else summed)
    assert stats["host_sum_matrices"] == len(opt._host_params) - stats["device_sum_matrices"]
    _, on_host = run_pair_once({**case, "device_sum_budget": 0}, seed)
    for a, b in zip(on_device, on_host):
        assert torch.equal(a.detach(), b.detach())
