"""Code that runs inside the 2-process tests of tests/test_distributed.py (spawned ranks)."""
import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import zenflow
from conftest import make_mlp

GLOBAL_BATCH = 16


def batch(step: int):
    g = torch.Generator().manual_seed(5000 + step)
    return torch.randn(GLOBAL_BATCH, 12, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)


def optimizer_kwargs(overlap: bool) -> dict:
    return dict(lr=3e-3, topk_ratio=0.2, update_interval=3, overlap_step=overlap,
                select_strategy="step", select_interval=4, max_grad_norm=5.0)


def engine_config(overlap: bool) -> dict:
    kw = optimizer_kwargs(overlap)
    return {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // 2,
            "gradient_clipping": kw["max_grad_norm"],
            "optimizer": {"type": "AdamW", "params": {"lr": kw["lr"], "weight_decay": 0.01}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                  "zenflow": {"topk_ratio": kw["topk_ratio"],
                                              "update_interval": kw["update_interval"],
                                              "select_strategy": "step", "select_interval": 4,
                                              "overlap_step": overlap}}}


def single_process_run(steps: int, overlap: bool) -> dict:
    """The reference: one process, the whole global batch each step."""
    model = make_mlp()
    opt = zenflow.ZenFlowAdamW(model.parameters(), weight_decay=0.01, worker=False,
                               **optimizer_kwargs(overlap))
    for t in range(steps):
        x, y = batch(t)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    host_bytes = opt.stats()["host_bytes"]
    opt.close()
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()},
            "host_bytes": host_bytes}


def _my_half(t: int, rank: int):
    x, y = batch(t)
    half = GLOBAL_BATCH // 2
    return x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]


def _train_engine(engine, steps, start=0):
    for t in range(start, steps):
        x, y = _my_half(t, dist.get_rank())
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()


def rank_main(rank: int, world: int, port: int, mode: str, overlap: bool, out_dir: str,
              steps: int, worker: bool):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    result = {}
    try:
        if mode == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(make_mlp())
            opt = zenflow.ZenFlowAdamW(model.parameters(), weight_decay=0.01, worker=worker,
                                       **optimizer_kwargs(overlap))
            for t in range(steps):
                x, y = _my_half(t, rank)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            state = opt.state_dict()
            result["host_rows"] = [s["host"]["master"].shape[0] for s in state["state"].values()
                                   if s["kind"] == "host"]
            result["host_bytes"] = opt.stats()["host_bytes"]
            result["weights"] = {k.removeprefix("module."): v.clone()
                                 for k, v in model.state_dict().items()}
            opt.close()
        elif mode == "engine_resume":
            engine, *_ = zenflow.initialize(model=make_mlp(), config=engine_config(overlap))
            _train_engine(engine, steps // 2)
            engine.save_checkpoint(os.path.join(out_dir, "ckpt"))
            engine.close()
            engine, *_ = zenflow.initialize(model=make_mlp(), config=engine_config(overlap))
            engine.load_checkpoint(os.path.join(out_dir, "ckpt"))
            _train_engine(engine, steps, start=steps // 2)
            result["weights"] = {k: v.clone() for k, v in engine.module.state_dict().items()}
            engine.close()
        elif mode == "engine":
            engine, *_ = zenflow.initialize(model=make_mlp(), config=engine_config(overlap))
            _train_engine(engine, steps)
            result["weights"] = {k: v.clone() for k, v in engine.module.state_dict().items()}
            engine.close()
        elif mode == "rank_dies":
            engine, *_ = zenflow.initialize(model=make_mlp(), config=engine_config(overlap))
            for t in range(steps):
                if rank == 1 and t == 3:
                    os._exit(17)  # dies without a word, mid-training
                x, y = _my_half(t, rank)
                engine.backward(torch.nn.functional.mse_loss(engine(x), y))
                engine.step()
    except Exception as exc:  # reported to the test, which decides what is expected
        result["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if "error" not in result:
        dist.destroy_process_group()
