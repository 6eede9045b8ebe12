"""tests/test_lifecycle_faults.py's script: children forked from the training process exit through
sys.exit (atexit hooks and collection run) and must not close the parent's worker. Prints OK."""
import os
import sys

import torch

import zenflow

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25,
                           update_interval=2)


def train(n):
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()


train(3)
pid = opt._runner.pid
for _ in range(4):
    child = os.fork()
    if child == 0:
        sys.exit(0)
    os.waitpid(child, 0)
train(4)
opt.synchronize()
assert opt._runner.pid == pid, "the worker was replaced"
opt.close()
print("OK")
