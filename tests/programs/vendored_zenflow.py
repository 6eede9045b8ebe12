"""tests/test_lifecycle_faults.py's script for a virtualenv without zenflow: the copy in VENDOR,
found only through sys.path.append, starts its worker and trains. Prints OK.

    VENV/bin/python tests/programs/vendored_zenflow.py VENDOR
"""
import sys

vendor = sys.argv[1]
sys.path.append(vendor)
import torch  # noqa: E402

import zenflow  # noqa: E402

assert zenflow.__file__.startswith(vendor), zenflow.__file__
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
with zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval=2) as opt:
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    opt.synchronize()
print("OK")
