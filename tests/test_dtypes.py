"""Low-precision parameters train with fp32 master values and moments, and integer step counts."""
import pytest
import torch

import zenflow
from zenflow.optim.reference import ReferenceZenFlow

SHAPES = [(8, 10), (6, 4, 2), (10,)]


def full_master(entry):
    """The fp32 master of a matrix, assembled from the host's and the device's columns."""
    full = entry["host"]["master"].clone()
    full[:, entry["device"]["column_indices"]] = entry["device"]["master"].cpu()
    return full


@pytest.mark.slow   # seconds on 2 cores, not milliseconds (--durations=0)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("overlap", [False, True])
def test_low_precision_params_keep_fp32_masters(dtype, overlap):
    gen = torch.Generator().manual_seed(3)
    values = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
    params = [v.clone().requires_grad_() for v in values]
    ref_params = [v.clone() for v in values]
    kw = dict(lr=1e-2, topk_ratio=0.3, update_interval=3, full_warm_up_rounds=1,
              overlap_step=overlap)
    opt = zenflow.ZenFlowAdamW(params, **kw, select_strategy="step", select_interval=6)
    ref = ReferenceZenFlow(ref_params, **kw, select_interval=6)
    for t in range(300):  # far past where a bf16 step counter would stop counting (256)
        grads = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        ref.step([g.clone() for g in grads])
    state = opt.state_dict()
    for i, p in enumerate(params):
        entry = state["state"][i]
        assert p.dtype == dtype
        if p.ndim >= 2:
            assert entry["host"]["master"].dtype == torch.float32
            assert entry["device"]["master"].dtype == torch.float32
            assert entry["device"]["exp_avg_sq"].dtype == torch.float32
            # the device count starts at the host count (1)
            assert isinstance(entry["device"]["step"], int) and entry["device"]["step"] == 300
            assert isinstance(entry["host"]["host_step"], int)
            master = full_master(entry)
        else:
            assert entry["master"].dtype == torch.float32
            assert isinstance(entry["step"], int) and entry["step"] == 300
            master = entry["master"]
        torch.testing.assert_close(master, ref.state[i]["master"].reshape(master.shape),
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p.detach(), ref_params[i], rtol=1e-2, atol=1e-2)
    opt.synchronize()
    state = opt.state_dict()
    for i, p in enumerate(params):  # once installed, every weight is its master rounded
        entry = state["state"][i]
        master = full_master(entry) if p.ndim >= 2 else entry["master"]
        assert torch.equal(p.detach().reshape(master.shape), master.to(dtype))
    opt.close()
