"""Column selections of many alike small matrices (an MoE's experts): ColumnSelector.select's
time at the first selection and at reselections, with ColumnBlocks (a block's columns taken or
moved at once) and without (one matrix at a time), in one process and on 2 gloo ranks (each
host holding its rows: every rank's rows gathered), alternated.

    python benchmarks/selection.py [--matrices 2000] [--rounds 2] [--out DIR] [--name TAG]

Every parameter an 8x8 matrix, topk_ratio 0.25, U=2, a reselection every 4 steps, one thread a
process. Writes JSON (machine named) under DIR (default benchmarks/results/).

    python benchmarks/selection.py --large [--rounds 3]

Reselections of Llama-shaped matrices (two 4096x11008, two 11008x4096: 180M parameters), with a
worker, the training thread on 1 and on 2 torch threads, as before (the host's columns gathered
by index_select, which runs on one thread, and no threads lent) and now (columns.gather_columns,
a gather on every thread, and the drained worker's cores lent: cores.lent_threads), alternated in
one process; random gradients, so most columns move (a reselection's worst case). Reports each
reselection's time and the part of it in the host's column gathers (handoff._host_columns); on a
CPU "device" the rest is mostly the device state's own reshuffle, which a GPU does at HBM speed.
"""
from __future__ import annotations

import argparse
import contextlib
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


def _index_select_columns(matrix, index, out):
    """columns.gather_columns as it was: index_select, which runs on one thread."""
    if matrix.dtype == out.dtype:
        return torch.index_select(matrix, 1, index, out=out)
    return out.copy_(matrix.index_select(1, index))


@contextlib.contextmanager
def _no_threads_lent(cores):
    """cores.lent_threads as it was: nothing lent."""
    yield torch.get_num_threads()


def _large_reselections(systems: dict, threads: tuple, rounds: int) -> dict[str, list[float]]:
    """Seconds of each reselection of the Llama-shaped matrices, per (system, threads); a system
    is (the column gather, the threads lent)."""
    import zenflow
    from zenflow.optim import columns, handoff, selector
    gen = torch.Generator().manual_seed(0)
    shapes = [(4096, 11008), (11008, 4096)] * 2
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    times: dict[str, list[float]] = {}
    current, host_columns, lent = columns.gather_columns, handoff._host_columns, \
        selector.lent_threads
    gathering = [0.0]   # seconds in the host's column gathers, this reselection

    def timed_host_columns(*args):
        start = time.perf_counter()
        out = host_columns(*args)
        gathering[0] += time.perf_counter() - start
        return out
    handoff._host_columns = timed_host_columns
    with zenflow.ZenFlowAdamW(params, lr=1e-4, update_interval=1, topk_ratio=0.1,
                              select_strategy="step", select_interval=2) as opt:
        select, label = opt._selector.select, [""]

        def timed(plan, step):
            start, gathering[0] = time.perf_counter(), 0.0
            select(plan, step)
            if not plan.first:
                times.setdefault(label[0], []).append(time.perf_counter() - start)
                times.setdefault(f"{label[0]}: host gathers", []).append(gathering[0])
        opt._selector.select = timed
        try:
            for r in range(rounds):
                for n in threads:
                    for name, (gather, lending) in systems.items():
                        label[0] = f"{name}, {n} thread(s)"
                        print(f"round {r + 1}/{rounds}: {label[0]}", flush=True)
                        torch.set_num_threads(n)
                        columns.gather_columns = gather
                        selector.lent_threads = lending
                        for _ in range(4):   # two reselections: every other step
                            for p, g in zip(params, grads):
                                p.grad = g.roll(int(torch.randint(1, 99, (1,), generator=gen)), 1)
                            opt.step()
        finally:
            columns.gather_columns, handoff._host_columns = current, host_columns
            selector.lent_threads = lent
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--large", action="store_true",
                        help="reselections of Llama-shaped matrices (see the module doc)")
    parser.add_argument("--matrices", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--name", default="")
    args = parser.parse_args()
    if args.large:
        return _main_large(args)
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


def _main_large(args) -> None:
    from zenflow.host.cores import lent_threads
    from zenflow.optim import columns
    systems = {"before": (_index_select_columns, _no_threads_lent),
               "now": (columns.gather_columns, lent_threads)}
    times = _large_reselections(systems, (1, 2), args.rounds)
    table = {k: {"median_s": statistics.median(v), "runs_s": v} for k, v in times.items()}
    for k, v in table.items():
        print(f"{k:55s} {v['median_s'] * 1e3:9.1f} ms a reselection")
    for n in (1, 2):
        for part in ("", ": host gathers"):
            before, now = (table[f"{g}, {n} thread(s){part}"]["median_s"] for g in systems)
            table[f"speed-up, {n} thread(s){part}"] = before / now
            print(f"{n} thread(s){part or ': reselection'}: now {before / now:.2f}x as fast")
    machine = machine_info("cpu")
    name = f"selection_large_{machine_tag(machine)}" + (f"_{args.name}" if args.name else "")
    write_json({"benchmark": "selection --large", "machine": machine, "rounds": args.rounds,
                "table": table}, os.path.join(args.out, f"{name}.json"))


if __name__ == "__main__":
    main()
