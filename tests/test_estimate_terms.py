"""`zenflow estimate`'s named costs against the code they model: the bus bytes the optimizer
itself counts; the device passes of "moments" by hand."""
import pytest
import torch

import zenflow
from zenflow.tools import estimate_terms as cost
from zenflow.tools.bench.model import GPT, GPTConfig
from zenflow.tools.estimate import estimate

SMALL = dict(arch="llama", n_layer=2, n_embd=64, n_head=4, ffn=160, vocab_size=256, seq_len=8)


@pytest.mark.parametrize("budget, credit, sum_dtype, dtype", [
    (0, "mean", "float32", torch.float32),               # every sum on the host
    (10 ** 9, "mean", "float32", torch.float32),         # every sum on the device
    (10 ** 9, "mean", "bfloat16", torch.float32),        # bf16 device sums
    (10 ** 9, "moments", "float32", torch.float32),      # squares down, rates up
    (10 ** 9, "moments", "float32", torch.bfloat16),     # bf16 rows and rates
    (250_000, "mean", "float32", torch.float32),         # some sums on the device, some not
])
def test_the_bus_bytes_are_what_the_optimizer_counts(budget, credit, sum_dtype, dtype):
    """Windows of 3 steps without overlap, on the CPU: the optimizer's own count of the bytes it
    copied each way over 4 windows is 4 windows of the estimate's bus terms."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL)).to(dtype)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    settings = dict(topk_ratio=0.1, overlap_step=False, update_interval=3,
                    device_sum_budget=budget, deferred_credit=credit, device_sum_dtype=sum_dtype)
    r = estimate(shapes, dtype, target="cpu", overlap=False, topk_ratio=0.1, update_interval=3,
                 device_sum_budget=budget, deferred_credit=credit, device_sum_dtype=sum_dtype)
    x = torch.randint(0, 256, (2, 8))
    with zenflow.ZenFlowAdamW(model.parameters(), worker=False, **settings) as opt:
        for _ in range(12):
            model(x, x).float().backward()
            opt.step()
            opt.zero_grad()
        stats = opt.stats()
    bus, g = r["bus"]["zenflow"], r["per_gpu"]
    assert stats["windows"] == 4
    assert stats["d2h_bytes_total"] == 4 * bus["d2h_bytes_per_window"]
    assert stats["h2d_bytes_total"] == 4 * bus["h2d_bytes_per_window"]
    assert stats["device_sum_bytes"] == g["device_sum_bytes"]
    assert (stats["device_sum_matrices"], stats["moments_matrices"]) == (
        g["device_sum_matrices"], g["moments_matrices"])
    if budget == 250_000:
        assert 0 < g["device_sum_matrices"] < g["device_sum_matrices"] + g["host_sum_matrices"]


def test_the_moments_bytes_per_step_by_hand():
    """The "moments" add in bf16: the sum (2 + 8), the squares (2 + 4 widened, 4 + 4 scaled,
    4 + 4 + 4 added) and the bounded interim step (2 + 2 zeroed, 2 + 2 + 2 by the rate, 3 x 4
    scaled and clamped, 2 + 2 + 2 added): 64 bytes a parameter, as tests/test_estimate.py has it."""
    c = cost.Counts(item=2, rate_item=2, sum_item=4, world=1, params=10, vector_params=0,
                    selected_params=0, touched_bytes=0, rank_matrix_params=10,
                    deferred_params_all=10, host_summed=0, device_plain=0, device_moments=10,
                    offload_params=10)
    assert cost.squares_bytes(c) == 6 + 8 + 12
    assert cost.interim_step_bytes(c) == 4 + 6 + 12 + 6
    assert cost.sum_add_bytes(c) == 10 * 64
    # fp32 weights and rates: every pass 4 bytes a value
    wide = cost.Counts(**{**c.__dict__, "item": 4, "rate_item": 4})
    assert cost.interim_step_bytes(wide) == 8 + 12 + 24 + 12
    assert cost.correction_bytes(c) == 10 * ((4 + 2 + 4) + 16 + (4 + 2 + 2))
