"""tests/test_lifecycle_faults.py's script, without a __main__ guard: an MoE-shaped model (5,000
tiny experts) starts its worker and trains (the start-up data does not travel in the size-limited
control message). Prints OK."""
import torch

import zenflow

torch.manual_seed(0)
experts = torch.nn.ModuleList(torch.nn.Linear(4, 4, bias=False) for _ in range(5000))
opt = zenflow.ZenFlowAdamW(experts.parameters(), lr=1e-2, topk_ratio=0.25,
                           update_interval=2)
x = torch.randn(2, 4)
for step in range(4):
    opt.zero_grad()
    sum(e(x).sum() for e in experts[step::7]).backward()
    opt.step()
opt.synchronize()
assert all(torch.isfinite(p).all() for p in experts.parameters())
assert opt.stats()["worker"]
opt.close()
print("OK")
