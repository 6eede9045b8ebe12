"""A user's FSDP2 training script, as torchrun runs it (no `__main__` guard, no explicit rank
set-up beyond init_process_group): a Llama-shaped model (the 226 matrices of Llama-2-7B, 32
blocks, at width 64) sharded with fully_shard per block and at the root, trained by
ZenFlowAdamW with its host worker. Writes OUT/rank<r>.pt: losses, the matrices, selections."""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import zenflow
from zenflow.tools.bench.model import GPT, GPTConfig

out_dir = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
torch.manual_seed(0)
model = GPT(GPTConfig(arch="llama", n_layer=32, n_embd=64, n_head=4, ffn=160, vocab_size=256,
                      seq_len=8))
for block in model.blocks:
    fully_shard(block)
fully_shard(model)
opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-3, topk_ratio=0.1, update_interval=2,
                           overlap_step=True, max_grad_norm=1.0)
losses = []
for step in range(6):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 256, (2 * world, 9), generator=g)[2 * rank:2 * rank + 2]
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
opt.synchronize()
stats = opt.stats()
torch.save({"losses": losses, "matrices": len(opt._host_params), "windows": stats["windows"],
            "host_bytes": stats["host_bytes"], "worker": stats["worker"],
            "selections": [m.selected.column_indices.tolist() for m in opt._host_params]},
           os.path.join(out_dir, f"rank{rank}.pt"))
opt.close()
dist.destroy_process_group()
