"""tests/test_real_scale.py's child: the Llama-shaped model (226 matrices) trains with its worker
under `ulimit -n 256`. Prints `trained`."""
import resource

import torch

import zenflow
from zenflow.tools.bench.model import GPT, GPTConfig

resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
model = GPT(GPTConfig(arch="llama", n_layer=32, n_embd=32, n_head=4, vocab_size=64, seq_len=8))
opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-3, update_interval=2)
for step in range(4):
    tokens = torch.randint(0, 64, (2, 9))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()
    opt.zero_grad()
opt.close()
print("trained")
