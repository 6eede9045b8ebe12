"""tests/test_real_scale.py's training job: trains until step 7, prints `ready` and sleeps; on
SIGTERM (the usual preemption handler) it saves the model, the optimizer and the step to PATH and
exits 0.

    python tests/programs/preempted_training.py PATH
"""
import signal
import sys
import time

import torch

import zenflow

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))
opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=3)
step = 0


def save_and_exit(signum, frame):   # the usual preemption handler
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
               sys.argv[1])
    sys.exit(0)


signal.signal(signal.SIGTERM, save_and_exit)
while True:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 12, generator=g), torch.randn(16, 5, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    step += 1
    if step == 7:
        print("ready", flush=True)
        time.sleep(60)
