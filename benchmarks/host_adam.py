"""Host AdamW throughput: zenflow's host update beside torch.optim.AdamW(fused=True) and a plain
memory-bandwidth probe over the same bytes, alternated in one run.

    python benchmarks/host_adam.py [--params 16000000] [--repeats 15] [--threads 1]

Writes benchmarks/results/host_adam.json. Target: the host update reaches >= 0.8x of fused
AdamW's throughput (params/s).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from zenflow.host.buffers import HostJob, HostLayout, HostState
from zenflow.tools.bench.harness import machine_info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=16_000_000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "host_adam.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = 4096
    cols = args.params // rows
    n = rows * cols

    # zenflow host: one window of 4 summed gradients, mean taken inside the fused kernel (the
    # update also writes the new values to the install buffer, as it does in training).
    host = HostState.allocate(HostLayout.build([(rows, cols, torch.float32)], sum_slots=1))
    host.fp32("master", 0).normal_()
    host.fp32("grad_sum0", 0).normal_()
    step = [0]

    def zenflow_host():
        step[0] += 1
        host.update([HostJob(0, step[0], 4, 1e-4, 0.9, 0.999, 1e-8, 0.01)], sum_slot=0)

    param = torch.nn.Parameter(torch.randn(rows, cols))
    param.grad = torch.randn(rows, cols)
    fused = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.01, fused=True)

    # Fused AdamW reads param, grad, m, v and writes param, m, v: 7 fp32 words per parameter.
    src = torch.randn(3 * n)
    dst = torch.empty(4 * n)

    def bandwidth_probe():
        dst[: 3 * n].copy_(src)   # 3 words written, 3 read
        dst[3 * n:].add_(src[:n])  # 1 word read-modified-written + 1 read: ~7 words in all

    systems = {"zenflow_host_update": zenflow_host, "torch_adamw_fused": fused.step,
               "memory_probe_7_words": bandwidth_probe}
    times = {name: [] for name in systems}
    for name, fn in systems.items():  # warm-up
        fn()
    for r in range(args.repeats):
        for name, fn in systems.items():  # alternate so drift hits all alike
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
        print(f"\rround {r + 1}/{args.repeats}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)

    result = {"machine": machine_info("cpu"), "params": n, "threads": args.threads,
              "repeats": args.repeats, "systems": {}}
    for name, ts in times.items():
        med = statistics.median(ts)
        result["systems"][name] = {"median_s": med, "params_per_s": n / med,
                                   "min_s": min(ts), "max_s": max(ts)}
    ratio = (result["systems"]["zenflow_host_update"]["params_per_s"] /
             result["systems"]["torch_adamw_fused"]["params_per_s"])
    result["ratio_zenflow_to_fused_adamw"] = ratio
    result["ratio_zenflow_to_memory_probe"] = (
        result["systems"]["zenflow_host_update"]["params_per_s"] /
        result["systems"]["memory_probe_7_words"]["params_per_s"])
    for name, s in result["systems"].items():
        print(f"{name:24s} {s['params_per_s'] / 1e9:6.2f} G params/s  (median {s['median_s'] * 1e3:.1f} ms)")
    print(f"zenflow host / fused AdamW = {ratio:.2f}x (target >= 0.8x)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
