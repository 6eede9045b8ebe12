"""tests/test_worker.py's training process: three steps with the worker, then prints the worker's
pid. With `hang` it then sleeps (to be killed or interrupted); with `exit` it leaves without
close(), so atexit must stop the worker.

    python tests/programs/worker_parent.py exit|hang
"""
import sys
import time

import torch

import zenflow

model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
opt = zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval=1)
for _ in range(3):
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
print(opt._runner.pid, flush=True)
if sys.argv[1] == "hang":
    time.sleep(60)
# "exit": leave without close(); atexit must stop the worker
