"""tests/test_lifecycle_faults.py's script: children forked from the training process exit through
sys.exit (atexit hooks and collection run) and must not close the parent's worker. Prints OK."""
import os
import sys
import threading

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

# A child forked while the dispatch thread holds the link's lock (it does while it sends a
# command) has a copy of that lock nothing will release: its exit must not take it.
held, done = threading.Event(), threading.Event()


def hold_lock():
    with opt._pipeline.link._outbox.lock:
        held.set()
        done.wait()


holder = threading.Thread(target=hold_lock)
holder.start()
held.wait()
child = os.fork()
if child == 0:
    sys.exit(0)
for _ in range(600):   # 60 s, then the child is reported as hung
    if os.waitpid(child, os.WNOHANG) != (0, 0):
        break
    threading.Event().wait(0.1)
else:
    os.kill(child, 9)
    os.waitpid(child, 0)
    done.set()
    raise SystemExit("a child forked while the link's lock was held hung at exit")
done.set()
holder.join()
train(4)
opt.synchronize()
assert opt._runner.pid == pid, "the worker was replaced"
opt.close()
print("OK")
