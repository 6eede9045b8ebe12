"""Tiny models, data and configs shared by the engine and checkpoint tests (and their child
processes). Data for step t comes from its own seeded generator, so a resumed run sees the same
batches as an uninterrupted one; dropout draws from the global RNG, which checkpoints restore."""
from __future__ import annotations

import copy

import torch

# The exact zenflow block of DeepSpeed's ZenFlow tutorial.
SEED_ZERO_BLOCK = {
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {
            "device": "cpu",
            "pin_memory": True
        },
        "zenflow": {
            "topk_ratio": 0.05,
            "select_strategy": "auto",
            "select_interval": "auto",
            "update_interval": 4,
            "full_warm_up_rounds": 0,
            "overlap_step": True
        }
    }
}

IN, HIDDEN, OUT = 32, 48, 4
# Where the engine puts the model; hand-written reference loops and data go there too.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_model(seed: int = 0, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.GELU(),
                               torch.nn.Dropout(dropout), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.GELU(), torch.nn.Linear(HIDDEN, OUT)).to(DEVICE)


_TEACHER = None


def batch(step: int, size: int):
    """A regression batch for step `step`: inputs and the outputs of a fixed random teacher."""
    global _TEACHER
    if _TEACHER is None:
        g = torch.Generator().manual_seed(1234)
        _TEACHER = torch.randn(IN, OUT, generator=g) / IN ** 0.5
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(size, IN, generator=g)
    return x.to(DEVICE), (torch.tanh(x @ _TEACHER) * 3).to(DEVICE)


def config(kind: str = "adamw", batch_size: int = 8, micro: int | None = None, **extra) -> dict:
    """A config for `kind`: 'adamw' (plain), 'offload', 'zenflow' (the seed block), or
    'zenflow-sync' (the seed block with overlap_step false)."""
    cfg = {"train_batch_size": batch_size,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}
    if micro is not None:
        cfg["train_micro_batch_size_per_gpu"] = micro
    if kind in ("zenflow", "zenflow-sync"):
        cfg.update(copy.deepcopy(SEED_ZERO_BLOCK))
        if kind == "zenflow-sync":
            cfg["zero_optimization"]["zenflow"]["overlap_step"] = False
    elif kind == "offload":
        cfg["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    cfg.update(extra)
    return cfg


def train(engine, steps: range, batch_size: int = 8) -> list[float]:
    """Run optimizer steps `steps` through the engine, micro-batched as the config says."""
    losses = []
    micro = engine.train_micro_batch_size_per_gpu()
    for t in steps:
        x, y = batch(t, batch_size)
        for i in range(0, batch_size, micro):
            loss = torch.nn.functional.mse_loss(engine(x[i:i + micro]).float(), y[i:i + micro])
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


def weights(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def eval_loss(engine) -> float:
    """Loss on a fixed held-out batch, in eval mode (dropout off): a noise-free progress measure."""
    was_training = engine.module.training
    engine.eval()
    x, y = batch(-1, 256)
    loss = torch.nn.functional.mse_loss(engine(x).float(), y).item()
    engine.train(was_training)
    return loss
