"""Operators a step launches, by the number of matrices: ZenFlowAdamW beside
torch.optim.AdamW(fused=True) on the same parameters (issue 38's table).

    python benchmarks/launches.py [--matrices 226 5000] [--steps 12] [--profiler] [--out DIR]

On a GPU the Python thread only queues kernels, and a step is free of Python overhead only while
it queues far fewer of them than the device runs behind the backward. Every parameter here is an
8x8 matrix, so arithmetic is negligible and what is left is the per-operator cost. Counts the aten
operators each `step()` dispatches on the calling thread (a TorchDispatchMode: what becomes
kernel launches on a GPU), separately for steps inside a window and steps that end one, and times
`step()` in other runs (median and mean over alternated rounds: counting costs Python time). Writes JSON
(machine named) under DIR (default benchmarks/results/).
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zenflow.optim.optimizer import ZenFlowAdamW
from zenflow.tools.bench.harness import machine_info, machine_tag, write_json

SYSTEMS = {
    "torch AdamW(fused=True)": None,
    "ZenFlowAdamW (defaults)": {},
    "ZenFlowAdamW (U=4)": {"update_interval": 4, "topk_ratio": 0.25, "worker": False},
    "ZenFlowAdamW (U=4, mean, bf16 sums)": {"update_interval": 4, "topk_ratio": 0.25,
                                            "worker": False, "deferred_credit": "mean",
                                            "device_sum_dtype": "bfloat16"},
    # the sums on the device, as a GPU's defaults place them (on a CPU "device" the budget
    # "auto" leaves them on the host): "factored" runs its op-by-op path here, a GPU compiles it
    "ZenFlowAdamW (U=4, device sums)": {"update_interval": 4, "topk_ratio": 0.25,
                                        "worker": False, "device_sum_budget": 1 << 30},
    "ZenFlowAdamW (U=4, mean, bf16 device sums)": {
        "update_interval": 4, "topk_ratio": 0.25, "worker": False, "deferred_credit": "mean",
        "device_sum_dtype": "bfloat16", "device_sum_budget": 1 << 30},
}


class CountOperators(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _optimizer(params, settings):
    if settings is None:
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    return ZenFlowAdamW(params, lr=1e-3, **settings)


def _profiled_events(step) -> int:
    """The aten events torch.profiler records in step(), nested ones included (what issue 38's
    table counted: on a CPU a multi-tensor call's per-tensor fallbacks count too)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def _run(matrices: int, settings, steps: int, count: bool | str, seed: int = 0):
    """Per step: (operators, window ended, seconds, counts by operator); `count`: count the
    operators (the counting costs Python time per operator: such a run is not timed);
    "profiler": count torch.profiler's aten events instead (_profiled_events)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(8, 8, generator=gen)) for _ in range(matrices)]
    grads = [torch.randn(8, 8, generator=gen) for _ in range(4)]
    opt = _optimizer(params, settings)
    rows = []
    try:
        for t in range(steps):
            for i, p in enumerate(params):
                p.grad = grads[(t + i) % 4].clone()
            windows = getattr(opt, "num_windows", 0)
            counter = CountOperators()
            if count == "profiler":
                counter.counts["events"] = _profiled_events(opt.step)
                seconds = float("nan")
            elif count:
                with counter:
                    opt.step()
                seconds = float("nan")
            else:
                start = time.perf_counter()
                opt.step()
                seconds = time.perf_counter() - start
            ended = getattr(opt, "num_windows", 0) != windows
            rows.append((sum(counter.counts.values()), ended, seconds, counter.counts))
    finally:
        if hasattr(opt, "close"):
            opt.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matrices", type=int, nargs="+", default=[226, 5000])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--name", default="", help="added to the file name (a commit, a variant)")
    parser.add_argument("--profiler", action="store_true",
                        help="also count torch.profiler's aten events, nested ones included")
    args = parser.parse_args()
    torch.manual_seed(0)
    machine = machine_info("cpu")
    result = {"benchmark": "launches", "machine": machine, "tables": {}}
    for n in args.matrices:
        times = collections.defaultdict(list)
        table = {}
        for r in range(args.rounds + 1):   # alternated: every system once per round
            for name in args.systems:
                what = "operators" if r == 0 else f"timed round {r}/{args.rounds}"
                print(f"{n} matrices, {what}: {name}", flush=True)
                rows = _run(n, SYSTEMS[name], args.steps, count=r == 0)
                if r:   # past the first selection
                    times[name] += [s for _, _, s, _ in rows[2:]]
                    times[name, "inside"] += [s for _, ended, s, _ in rows[2:] if not ended]
                    times[name, "ends"] += [s for _, ended, s, _ in rows[2:] if ended]
                else:
                    inside = [c for c, ended, _, _ in rows[2:] if not ended]
                    ends = [c for c, ended, _, _ in rows[2:] if ended]
                    heavy = collections.Counter()
                    for _, ended, _, counts in rows[2:]:
                        if not ended:
                            heavy.update(counts)
                    table[name] = {
                        "ops_inside_window": [min(inside), max(inside)] if inside else None,
                        "ops_at_window_end": [min(ends), max(ends)] if ends else None,
                        "top_ops_inside_window_per_step": {
                            op: round(c / max(1, len(inside)), 1)
                            for op, c in heavy.most_common(12)}}
        base = statistics.median(times["torch AdamW(fused=True)"]) \
            if times.get("torch AdamW(fused=True)") else None
        for name in args.systems:
            if not times.get(name):   # --rounds 0: operators only
                continue
            median = statistics.median(times[name])
            table[name]["step_median_s"] = median
            # (the mean too: a step that stalls now and then, on the host or on Python's
            # collector, hides under the median)
            table[name]["step_mean_s"] = statistics.fmean(times[name])
            for part in ("inside", "ends"):   # steps inside a window, and those ending one
                if times.get((name, part)):
                    table[name][f"step_median_{part}_s"] = statistics.median(times[name, part])
            if base:
                table[name]["step_vs_torch"] = round(median / base, 2)
                table[name]["mean_vs_torch"] = round(
                    table[name]["step_mean_s"]
                    / statistics.fmean(times["torch AdamW(fused=True)"]), 2)
                if times.get((name, "inside")):
                    table[name]["inside_vs_torch"] = round(
                        table[name]["step_median_inside_s"] / base, 2)
        for name in args.systems if args.profiler else ():
            print(f"{n} matrices, profiler events: {name}", flush=True)
            rows = _run(n, SYSTEMS[name], args.steps, count="profiler")[2:]
            for part, ended in (("inside_window", False), ("at_window_end", True)):
                events = [c["events"] for _, e, _, c in rows if e == ended]
                table[name][f"profiler_events_{part}"] = [min(events), max(events)] \
                    if events else None
        result["tables"][str(n)] = table
        print(f"\n{n} matrices of 8x8: aten operators per step() and step() time vs torch")
        for name, row in table.items():
            print(f"  {name:44s} inside {row['ops_inside_window']}, window ends "
                  f"{row['ops_at_window_end']}, {row.get('step_vs_torch', '-')}x torch "
                  f"({row.get('inside_vs_torch', '-')}x inside a window; mean "
                  f"{row.get('mean_vs_torch', '-')}x)"
                  + (f"; profiler events {row['profiler_events_inside_window']}, "
                     f"{row['profiler_events_at_window_end']}" if args.profiler else ""))
    suffix = f"_{args.name}" if args.name else ""
    write_json(result, os.path.join(args.out, f"launches_{machine_tag(machine)}{suffix}.json"))


if __name__ == "__main__":
    main()
