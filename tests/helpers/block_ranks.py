"""Code that runs inside 2 gloo ranks holding replicas of alike small matrices (an MoE's experts)
in ColumnBlocks: each rank's host holds its rows, and a selection takes, a reselection moves, a
whole block's columns at once, every rank's rows gathered in one collective a kind
(handoff.take_block_from_host, move_block_columns), or, with blocks turned off, one matrix at a
time. A warm-up round first, so that the first selection takes moments the host has stepped."""
import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import zenflow
from zenflow.host import layout
from zenflow.optim import device_adam, handoff

from helpers.spawn import spawn_ranks

STEPS = 11
# 8x8 and 5x6 experts (5 rows split 3 + 2), interleaved, then two matrices of their own
SHAPES = [(8, 8), (5, 6)] * 4 + [(8, 8)] * 3 + [(40, 300), (8,)]


def _train(stacked: bool) -> dict:
    """STEPS steps on gradients alike on every rank (averaged already, as DDP leaves them): the
    weights, this rank's state and the block moves."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen) * 0.1) for s in SHAPES]
    moved, taken = [], []
    real, real_take = handoff.move_block_columns, handoff.take_block_from_host
    handoff.move_block_columns = lambda block, *a: moved.append(block.size) or real(block, *a)
    handoff.take_block_from_host = lambda block, *a: (taken.append(block.size)
                                                      or real_take(block, *a))
    saved = device_adam.STACK_ELEMENTS, layout.STACK_ELEMENTS
    if not stacked:
        device_adam.STACK_ELEMENTS = layout.STACK_ELEMENTS = 0
    try:
        opt = zenflow.ZenFlowAdamW(params, lr=1e-2, worker=False, update_interval=2,
                                   topk_ratio=0.34, select_strategy="step", select_interval=4,
                                   weight_decay=0.01, host_moments_dtype="bfloat16",
                                   full_warm_up_rounds=1)
        with opt:
            for _ in range(STEPS):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen)
                opt.step()
            return {"weights": [p.detach().clone() for p in params], "state": opt.state_dict(),
                    "moved": moved, "taken": taken, "reselections": opt.num_reselections}
    finally:
        handoff.move_block_columns, handoff.take_block_from_host = real, real_take
        device_adam.STACK_ELEMENTS, layout.STACK_ELEMENTS = saved


def _rank_main(rank: int, world: int, port: int, out_dir: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    result = {}
    try:
        result = {"stacked": _train(True), "single": _train(False)}
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def run_block_ranks(tmp_path, world: int = 2, timeout: float = 120) -> list:
    """Both runs on `world` spawned ranks: what each rank wrote."""
    return spawn_ranks(_rank_main, (str(tmp_path),), tmp_path, world, timeout)
