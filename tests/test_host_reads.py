"""How often step() reads a value back from the device: each read makes the Python thread wait
for every kernel queued before it (on a GPU, for the whole backward). A step that ends no window
reads once: the global gradient norm, the clipping factor and GradScaler's flag and scale come
back together, because whether to skip the step and by how much to scale it are decided in
Python. Drift checks read once per check, not once per matrix."""
from __future__ import annotations

import pytest
import torch

import zenflow

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


@pytest.fixture
def device_reads(monkeypatch):
    count = [0]
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            count[0] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return count


def _model(dtype):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(32, 32) for _ in range(6)]
    return torch.nn.Sequential(*layers).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device_sums", [0, 10 ** 9], ids=["host-sums", "device-sums"])
def test_a_step_that_ends_no_window_reads_the_device_once(dtype, device_sums, device_reads):
    model = _model(dtype)
    opt = zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval=4,
                               overlap_step=True, max_grad_norm=1.0,
                               device_sum_budget=device_sums)
    reads = []
    for step in range(12):
        model(torch.randn(4, 32, dtype=dtype)).float().square().mean().backward()
        windows, inside = opt.num_windows, opt.counters.window_steps > 0
        before = device_reads[0]
        opt.step()
        # neither a window's first step (which may check the selection) nor its last
        if inside and opt.num_windows == windows:
            reads.append(device_reads[0] - before)
        opt.zero_grad()
    opt.close()
    assert reads and all(n == 1 for n in reads), reads


def test_a_drift_check_reads_the_device_once_for_every_matrix(device_reads):
    from zenflow.optim.selector import ColumnSelector
    model = _model(torch.float32)
    opt = zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval=2,
                               select_interval="auto", worker=False)
    for _ in range(3):
        model(torch.randn(4, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    selector = opt._selector
    importances = [torch.rand(m.num_columns) for m in selector.matrices]
    before = device_reads[0]
    ColumnSelector._retained_fraction(selector.matrices, importances)
    opt.close()
    assert len(selector.matrices) == 6 and device_reads[0] - before == 1
