"""The engine configurations the checkpoint tests train, save and resume (tests/test_checkpoint.py,
test_checkpoint_faults.py and their child programs): each VARIANT on engine_toys' model with
dropout, micro-batches of 4, and the global RNG seeded after the engine is built."""
from pathlib import Path

import torch

from zenflow.engine.engine import initialize

import helpers.engine_toys as toys

FP16 = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 3}
WARMUP = {"type": "WarmupLR", "params": {"warmup_num_steps": 15, "warmup_max_lr": 1e-2}}
VARIANTS = {
    "adamw": dict(kind="adamw", gradient_clipping=1.0),
    "adamw-fp16-warmup": dict(kind="adamw", fp16=FP16, scheduler=WARMUP),
    "adamw-bf16": dict(kind="adamw", bf16={"enabled": True}),
    "offload": dict(kind="offload", gradient_clipping=1.0),
    "zenflow-overlap": dict(kind="zenflow", scheduler=WARMUP),
    "zenflow-sync": dict(kind="zenflow-sync", gradient_clipping=1.0),
}


def _config(variant):
    v = dict(VARIANTS[variant])
    return toys.config(v.pop("kind"), batch_size=8, micro=4, **v)


def _engine(variant, model_seed=0):
    engine, *_ = initialize(model=toys.make_model(seed=model_seed, dropout=0.1),
                            config=_config(variant))
    torch.manual_seed(5)  # dropout draws from here; the checkpoint must carry it across
    return engine


def _counters(engine):
    return {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps, "global_samples": engine.global_samples,
            "lr": engine.get_lr(), "loss_scale": engine.loss_scale}


def _saved(tmp_path, steps=3):
    engine = _engine("adamw")
    toys.train(engine, range(steps))
    path = Path(engine.save_checkpoint(tmp_path / "ckpt"))
    return engine, path
