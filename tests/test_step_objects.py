"""What a step costs Python beside its work: gradient norms and the objects it leaves for
Python's collector, at many matrices (an MoE's experts)."""
from __future__ import annotations

import collections
import gc

import pytest
import torch

import zenflow
from zenflow.optim.step_scale import gradient_norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gradient_norms_are_foreach_norms_bit_for_bit(dtype):
    """On a CPU alike small gradients are stacked for their norms: the values, in the given
    order, must be torch._foreach_norm's (which clip_grad_norm_ uses), and so must the total."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(8, 8), (8, 16), (300, 300), (8, 8), (5,), (8, 16), (8, 8), (4, 2, 3), (1, 1)]
    grads = [(torch.randn(*s, generator=gen) * 10 ** float(j % 3)).to(dtype)
             for j, s in enumerate(shapes * 3)]
    norms = gradient_norms(grads)
    expected = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
    assert norms.dtype == torch.float32 and torch.equal(norms, expected)
    params = [torch.nn.Parameter(torch.zeros_like(g, dtype=torch.float32)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.float().clone()   # (clip_grad_norm_ scales it in place)
    ours = torch.linalg.vector_norm(gradient_norms([p.grad for p in params]))
    assert torch.equal(ours, torch.nn.utils.clip_grad_norm_(params, 1.0))
    assert torch.equal(gradient_norms(grads[:1]), expected[:1])


@pytest.mark.slow   # a worker process and 2,000 matrices
def test_a_step_leaves_no_object_per_matrix_for_the_collector():
    """Objects made per matrix that outlive a step (a HostJob, a queued install, a tuple of a
    matrix's tensors held through the step) are promoted to the collector's oldest generation,
    and Python scans every object of the process each time enough of those piled up: at 5,000
    matrices a full scan every few steps, 30 ms a step. The steps here, windows ended included,
    must promote far fewer than one object per matrix."""
    n = 2000
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 8, generator=gen)) for _ in range(n)]
    grads = [[torch.randn(8, 8, generator=gen) for _ in range(n)] for _ in range(2)]
    opt = zenflow.ZenFlowAdamW(params, lr=1e-3, update_interval=2, topk_ratio=0.25,
                               select_strategy="step", select_interval=1000)
    promoted = []
    young: list[int] = []

    def watch(phase, info):
        if info["generation"] != 1:
            return
        if phase == "start":
            young[:] = [id(o) for o in (*gc.get_objects(0), *gc.get_objects(1))]
        else:
            ids = set(young)
            promoted.extend(type(o).__name__ for o in gc.get_objects(2) if id(o) in ids)

    threshold = gc.get_threshold()
    try:
        for t in range(4):   # the first selection and windows
            for p, g in zip(params, grads[t % 2]):
                p.grad = g
            opt.step()
        gc.collect()
        gc.set_threshold(700, 2, 1_000_000)   # gen1 often, never a full collection
        gc.callbacks.append(watch)
        ends = opt.num_windows
        for t in range(4, 10):
            for p, g in zip(params, grads[t % 2]):
                p.grad = g
            opt.step()
        ends = opt.num_windows - ends
    finally:
        if watch in gc.callbacks:
            gc.callbacks.remove(watch)
        gc.set_threshold(*threshold)
        opt.close()
    assert ends >= 2
    assert len(promoted) < n // 10, collections.Counter(promoted).most_common(10)
