"""The README's quick start as a user saves it: no __main__ guard, no close(). tests/test_real_scale.py
runs it as a file, from stdin and with -c; it prints the pids of the worker and the fork server,
which must be gone once it exits."""
import torch

import zenflow

model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
opt = zenflow.ZenFlowAdamW(model.parameters(), lr=2e-3, weight_decay=0.01,
                           topk_ratio=0.1, update_interval=4, overlap_step=True)
for step in range(12):
    loss = model(torch.randn(8, 16)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
opt.synchronize()
from zenflow.host.worker import _ForkServer  # noqa: E402

print("pids", opt._runner.pid, _ForkServer.get().process.pid, flush=True)
