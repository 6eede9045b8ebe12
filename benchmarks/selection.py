"""Column selections of many alike small matrices (an MoE's experts): ColumnSelector.select's
time at the first selection and at reselections, with ColumnBlocks (a block's columns taken or
moved at once) and without (one matrix at a time), in one process and on 2 gloo ranks (each
host holding its rows: every rank's rows gathered), alternated.

    python benchmarks/selection.py [--matrices 2000] [--rounds 2] [--out DIR] [--name TAG]

Every parameter an 8x8 matrix, topk_ratio 0.25, U=2, a reselection every 4 steps, one thread a
process. Writes JSON (machine named) under DIR (default benchmarks/results/).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # zenflow, from a checkout too

from zenflow.tools.bench.harness import machine_info, machine_tag, write_json  # noqa: E402


def _selections(matrices: int, stacked: bool) -> list[tuple[bool, float]]:
    """(first, seconds) of each select() in 9 steps."""
    import zenflow
    from zenflow.host import layout
    from zenflow.optim import device_adam
    saved = device_adam.STACK_ELEMENTS, layout.STACK_ELEMENTS
    if not stacked:
        device_adam.STACK_ELEMENTS = layout.STACK_ELEMENTS = 0
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 8, generator=gen)) for _ in range(matrices)]
    spent = []
    try:
        with zenflow.ZenFlowAdamW(params, lr=1e-3, worker=False, update_interval=2,
                                  topk_ratio=0.25, select_strategy="step",
                                  select_interval=4) as opt:
            select = opt._selector.select

            def timed(plan, step):
                start = time.perf_counter()
                select(plan, step)
                spent.append((plan.first, time.perf_counter() - start))
            opt._selector.select = timed
            for _ in range(9):
                for p in params:
                    p.grad = torch.randn(8, 8, generator=gen)
                opt.step()
    finally:
        device_adam.STACK_ELEMENTS, layout.STACK_ELEMENTS = saved
    return spent


def _rank(rank: int, world: int, port: int, matrices: int, stacked: bool, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        spent = _selections(matrices, stacked)
        if rank == 0:
            torch.save(spent, out)
    finally:
        dist.destroy_process_group()


def _on_ranks(matrices: int, stacked: bool, world: int = 2) -> list[tuple[bool, float]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        mp.spawn(_rank, args=(world, port, matrices, stacked, out), nprocs=world)
        return torch.load(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matrices", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--name", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for where in ("one process", "2 gloo ranks"):
            for stacked in (True, False):
                label = f"{where}, {'blocks' if stacked else 'one matrix at a time'}"
                print(f"round {r + 1}/{args.rounds}: {label}", flush=True)
                spent = (_selections(args.matrices, stacked) if where == "one process"
                         else _on_ranks(args.matrices, stacked))
                for first, seconds in spent:
                    key = f"{label}: {'first selection' if first else 'reselection'}"
                    times.setdefault(key, []).append(seconds)
    table = {k: {"median_s": statistics.median(v), "runs_s": v} for k, v in times.items()}
    for k, v in table.items():
        print(f"{k:70s} {v['median_s'] * 1e3:9.1f} ms")
    machine = machine_info("cpu")
    name = f"selection_{machine_tag(machine)}" + (f"_{args.name}" if args.name else "")
    write_json({"benchmark": "selection", "machine": machine, "matrices": args.matrices,
                "rounds": args.rounds, "table": table}, os.path.join(args.out, f"{name}.json"))


if __name__ == "__main__":
    main()
