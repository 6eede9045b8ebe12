"""The child program of `zenflow selftest`'s closure section: step(closure) with activation
checkpointing (reentrant and not) and attach(), as Lightning's automatic optimization runs it. On
CUDA the backward and the forward that checkpointing recomputes run on autograd's device thread;
the parent gives this process a deadline, so a hook waiting for the optimizer shows as a failed
check. Prints "closure-ok ..." when every step has run."""
from __future__ import annotations

import argparse

import torch
from torch.utils.checkpoint import checkpoint

import zenflow


class Blocks(torch.nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(4))
        self.head = torch.nn.Linear(64, 8)
        self.reentrant = reentrant

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    for reentrant in (False, True):
        torch.manual_seed(0)
        model = Blocks(reentrant).to(device)
        with zenflow.ZenFlowAdamW(model.parameters(), lr=1e-3, topk_ratio=0.25,
                                  update_interval=2) as opt:
            opt.attach(model)
            for _ in range(args.steps):
                x = torch.randn(16, 64, device=device, requires_grad=reentrant)

                def closure():
                    opt.zero_grad()
                    loss = model(x).square().mean()
                    loss.backward()
                    return loss
                opt.step(closure)
            windows = opt.num_windows
        print(f"reentrant={reentrant}: {args.steps} steps, {windows} windows", flush=True)
    print(f"closure-ok on {device}", flush=True)


if __name__ == "__main__":
    main()
