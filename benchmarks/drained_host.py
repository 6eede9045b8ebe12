"""Host work on the training thread while the worker is drained: a reselection's column moves,
state_dict() and load_state_dict() of Llama-shaped matrices (two 4096x11008, two 11008x4096:
180M parameters), as before and now, alternated in one process, with a worker and the training
thread on 1 and on 2 torch threads:

    before   no threads lent, the host's columns gathered by index_select (one thread), a saved
             state's values checked by isfinite() and a comparison (full-size temporaries)
    now      the drained worker's cores lent to the training thread (cores.lent_threads), the
             columns gathered along the rows (columns.gather_columns: every thread), the values
             checked by one aminmax() (saved_state.check_saved_tensors)

    python benchmarks/drained_host.py [--rounds 3] [--out DIR] [--name TAG]

Random gradients, so most columns move at a reselection (its worst case). Reports each
operation's median and, for a reselection, the part in the host's column gathers
(handoff._host_columns); on a CPU "device" the rest of a reselection is mostly the device state's
own reshuffle, which a GPU does at HBM speed. Writes JSON (machine named) under DIR (default
benchmarks/results/).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # zenflow, from a checkout too

from zenflow.tools.bench.harness import machine_info, machine_tag, write_json  # noqa: E402

SHAPES = [(4096, 11008), (11008, 4096)] * 2


def _index_select_columns(matrix, index, out):
    """columns.gather_columns as it was: index_select, which runs on one thread."""
    if matrix.dtype == out.dtype:
        return torch.index_select(matrix, 1, index, out=out)
    return out.copy_(matrix.index_select(1, index))


@contextlib.contextmanager
def _no_threads_lent(cores):
    """cores.lent_threads as it was: nothing lent."""
    yield torch.get_num_threads()


def _isfinite_check(saved, expected: dict, what: str = "") -> None:
    """saved_state.check_saved_tensors's value checks as they were: isfinite() and a comparison,
    each a full-size temporary (the shape and dtype checks are the same now)."""
    from zenflow.saved_state import check_saved_tensors
    for name, have in expected.items():
        got = saved.get(name)
        if isinstance(got, torch.Tensor) and have.is_floating_point() and got.numel():
            if not bool(torch.isfinite(got).all()):
                raise ValueError(f"saved {name} holds non-finite values (inf or NaN)")
            if name == "exp_avg_sq" and bool((got < 0).any()):
                raise ValueError(f"saved {name} holds negative values")
    check_saved_tensors(saved, expected, what)


@contextlib.contextmanager
def _as(system: str):
    """The library as `system` ("before" or "now") runs it."""
    from zenflow.host import pipeline_state
    from zenflow.optim import columns, device_adam, selector, state
    checking = (pipeline_state, device_adam, state)
    kept = (columns.gather_columns, selector.lent_threads, pipeline_state.lent_threads,
            [m.check_saved_tensors for m in checking])
    if system == "before":
        columns.gather_columns = _index_select_columns
        selector.lent_threads = pipeline_state.lent_threads = _no_threads_lent
        for module in checking:
            module.check_saved_tensors = _isfinite_check
    try:
        yield
    finally:
        columns.gather_columns, selector.lent_threads, pipeline_state.lent_threads, checks = kept
        for module, check in zip(checking, checks):
            module.check_saved_tensors = check


def _measure(rounds: int) -> dict[str, list[float]]:
    """Seconds of each operation, by "system, threads: operation"."""
    import zenflow
    from zenflow.optim import handoff
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in SHAPES]
    grads = [torch.randn(s, generator=gen) for s in SHAPES]
    times: dict[str, list[float]] = {}
    host_columns, gathering = handoff._host_columns, [0.0]

    def timed_host_columns(*args):
        start = time.perf_counter()
        out = host_columns(*args)
        gathering[0] += time.perf_counter() - start
        return out
    handoff._host_columns = timed_host_columns
    try:
        with zenflow.ZenFlowAdamW(params, lr=1e-4, update_interval=1, topk_ratio=0.1,
                                  select_strategy="step", select_interval=2) as opt:
            select, label = opt._selector.select, [""]

            def timed(plan, step):
                start, gathering[0] = time.perf_counter(), 0.0
                select(plan, step)
                if not plan.first:
                    times.setdefault(f"{label[0]}: reselection", []).append(
                        time.perf_counter() - start)
                    times.setdefault(f"{label[0]}: reselection's host gathers", []).append(
                        gathering[0])
            opt._selector.select = timed
            for r in range(rounds):
                for n in (1, 2):
                    for system in ("before", "now"):
                        label[0] = f"{system}, {n} thread(s)"
                        print(f"round {r + 1}/{rounds}: {label[0]}", flush=True)
                        torch.set_num_threads(n)
                        with _as(system):
                            for _ in range(4):   # two reselections: every other step
                                for p, g in zip(params, grads):
                                    p.grad = g.roll(int(torch.randint(1, 99, (1,),
                                                                      generator=gen)), 1)
                                opt.step()
                            start = time.perf_counter()
                            state = opt.state_dict()
                            saved = time.perf_counter()
                            opt.load_state_dict(state)
                            loaded = time.perf_counter()
                        del state
                        times.setdefault(f"{label[0]}: state_dict", []).append(saved - start)
                        times.setdefault(f"{label[0]}: load_state_dict", []).append(
                            loaded - saved)
    finally:
        handoff._host_columns = host_columns
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--name", default="")
    args = parser.parse_args()
    times = _measure(args.rounds)
    table: dict = {k: {"median_s": statistics.median(v), "runs_s": v} for k, v in times.items()}
    for k, v in table.items():
        print(f"{k:55s} {v['median_s'] * 1e3:9.1f} ms")
    operations = sorted({k.split(": ", 1)[1] for k in times})
    for n in (1, 2):
        for op in operations:
            before, now = (table[f"{s}, {n} thread(s): {op}"]["median_s"] for s in ("before", "now"))
            table[f"speed-up, {n} thread(s): {op}"] = before / now
            print(f"{n} thread(s), {op}: now {before / now:.2f}x as fast")
    machine = machine_info("cpu")
    name = f"drained_host_{machine_tag(machine)}" + (f"_{args.name}" if args.name else "")
    write_json({"benchmark": "drained_host", "machine": machine, "rounds": args.rounds,
                "shapes": SHAPES, "table": table}, os.path.join(args.out, f"{name}.json"))


if __name__ == "__main__":
    main()
