"""device_sum_dtype="bfloat16": the window sums kept on the device in bf16, half the memory and
half the bytes over the bus, widened to fp32 exactly by the host at the window's end."""
from __future__ import annotations

import pytest
import torch

import zenflow
from zenflow.host.buffers import _CHUNK, landing_of, widen_


@pytest.mark.parametrize("numel", [1, 7, _CHUNK - 1, 2 * _CHUNK + 5])
def test_widening_in_place_gives_every_bf16_value_exactly(numel):
    """The bf16 sum lands in the first half of its fp32 buffer; widening it in place, from the
    end, never overwrites a value before it is read (a chunk's writes reach past its reads for
    the first chunks)."""
    gen = torch.Generator().manual_seed(numel)
    values = (torch.randn(numel, generator=gen) * 10.0 ** torch.randint(
        -30, 30, (numel,), generator=gen)).to(torch.bfloat16)
    values[0] = float("-inf") if numel > 1 else values[0]
    fp32_sum = torch.full((numel, 1), float("nan"))
    landing_of(fp32_sum, torch.bfloat16).copy_(values.view(numel, 1))
    widen_(fp32_sum)
    assert torch.equal(fp32_sum.view(-1), values.float())


def _train(dtype: str, credit: str, steps: int = 12):
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8, bias=False)
    opt = zenflow.ZenFlowAdamW(layer.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=4,
                               overlap_step=True, worker=False, device_sum_budget=10 ** 6,
                               device_sum_dtype=dtype, deferred_credit=credit,
                               select_strategy="step", select_interval=10 ** 6)
    moved, weights = [], []
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        layer(torch.randn(2, 16, generator=gen)).sum().backward()
        opt.step()
        opt.zero_grad()
        moved.append(opt.timeline()["steps"][-1]["d2h_bytes"])
        weights.append(layer.weight.detach().clone())
    stats = opt.stats()
    opt.close()
    return moved, weights, stats


def test_bf16_sums_take_half_the_memory_and_bus_and_stay_close_to_fp32_sums():
    moved, weights, stats = _train("bfloat16", "mean")
    moved32, weights32, stats32 = _train("float32", "mean")
    assert stats["device_sum_bytes"] == 8 * 16 * 2 and stats32["device_sum_bytes"] == 8 * 16 * 4
    assert moved == [0, 0, 0, 8 * 16 * 2] * 3 and moved32 == [0, 0, 0, 8 * 16 * 4] * 3
    # The same trajectory up to the sum's rounding: AdamW's step is about lr = 1e-2 per value and
    # a bf16 sum is off by about 2**-9 relative per add, which moves a step by less than 1e-4.
    assert not torch.equal(weights[-1], weights32[-1])   # the sums were bf16
    for step, (w, w32) in enumerate(zip(weights, weights32)):
        torch.testing.assert_close(w, w32, rtol=0, atol=3e-4, msg=f"step {step}")


def test_moments_matrices_keep_fp32_sums_whatever_the_dtype():
    moved, weights, stats = _train("bfloat16", "moments", steps=8)
    moved32, weights32, _ = _train("float32", "moments", steps=8)
    assert stats["moments_matrices"] == 1 and moved == moved32
    assert all(torch.equal(w, w32) for w, w32 in zip(weights, weights32))


def test_a_state_saved_with_bf16_sums_holds_them_as_fp32_and_resumes():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 8, bias=False) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    opts = [zenflow.ZenFlowAdamW(layer.parameters(), topk_ratio=0.25, update_interval=4,
                                 worker=False, device_sum_budget=10 ** 6, deferred_credit="mean",
                                 device_sum_dtype="bfloat16") for layer in layers]
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(2, 16, generator=gen) for _ in range(7)]
    for x in batches[:2]:
        layers[0](x).sum().backward()
        opts[0].step()
        opts[0].zero_grad()
    state = opts[0].state_dict()   # mid-window: the bf16 sums of two steps
    layers[1].load_state_dict(layers[0].state_dict())
    opts[1].load_state_dict(state)
    assert state["state"][0]["host"]["grad_sum"].dtype == torch.float32
    for x in batches[2:]:
        for layer, opt in zip(layers, opts):
            layer(x).sum().backward()
            opt.step()
            opt.zero_grad()
    assert torch.equal(layers[0].weight, layers[1].weight)
    for opt in opts:
        opt.close()


def test_an_unknown_sum_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="device_sum_dtype"):
        zenflow.ZenFlowAdamW(torch.nn.Linear(4, 4).parameters(), device_sum_dtype="float16")


def test_a_bf16_window_sum_adds_the_scaled_gradient_in_fp32_rounded_once():
    """sum += coef * g is computed in fp32 and rounded once to the sum's dtype: the step's fp32
    factor (1 / loss scale times the clipping factor) is not rounded to bf16 first, which would
    scale every step's contribution by up to 2^-9."""
    from zenflow.host.buffers import add_scaled_
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(64, 32, generator=gen).bfloat16() for _ in range(3)]
    sums = [torch.randn(64, 32, generator=gen).bfloat16() for _ in range(3)]
    coef = torch.tensor(0.8437652587890625 + 2 ** -20)   # not a bf16 value
    expected = [(s.float() + g.float() * coef).bfloat16() for s, g in zip(sums, grads)]
    add_scaled_(sums, grads, coef)
    for s, e in zip(sums, expected):
        assert torch.equal(s, e)
