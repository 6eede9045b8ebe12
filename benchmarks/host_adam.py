"""Host AdamW against memory bandwidth: the worker's update (HostState.update) beside a streaming
probe that reads and writes the same bytes, on 1 and 2 cores, alternated in one run.

    python benchmarks/host_adam.py [--params 64000000] [--repeats 15] [--cores 1,2]
    python benchmarks/host_adam.py --tiny --out /tmp/host_adam.json    # does it run? (seconds)

For each core count a child process is pinned to that many of this process's CPUs, with as many
torch threads, before it imports torch (torch's OpenMP threads keep the affinity they start
with). It times, in turn and round after round so that drift hits every system alike:

    zenflow   one window's update of bf16 parameters with fp32 state: AdamW on the mean of 4
              summed gradients, and the install values in bf16 (variant "mean"); with the
              lookahead ("lookahead", install_lookahead=1); deferred_credit "moments" (which
              also reads the sums of squares and writes bf16 rates); deferred_credit "factored"
              (the default: the squares as row and column sums, the rates fitted as row x
              column factors, O(rows + cols) beside the same 30 bytes); "mean_bf16" and
              "factored_bf16": the same with host_moments_dtype="bfloat16" (the moments read
              and written in 2 bytes each: 22 bytes per parameter)
    probe     the same chunks, each touching the same buffers with the cheapest operators:
              every buffer the update reads is read from memory once, every buffer it writes is
              written once (mean and lookahead: 30 bytes per parameter; moments: 36)
    torch     torch.optim.AdamW(fused=True) over one fp32 tensor of the same size (28 bytes per
              parameter, no install values), for scale

and reports medians, the update's time over the probe's (target: within 1.2x) and the update's
parameters per second per core. Writes benchmarks/results/host_adam_<machine>.json. Run it on a
quiet machine: it measures memory bandwidth, which other jobs share.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # zenflow, from a checkout too
VARIANTS = {"mean": 30, "lookahead": 30, "moments": 36,   # bytes per parameter, as counted above
            "factored": 30, "mean_bf16": 22, "factored_bf16": 22}
COMPACT = "_bf16"   # a variant on bf16 moments (host_moments_dtype="bfloat16"): 8 bytes fewer
ROWS = 4096


def _child(args) -> dict:
    import torch

    from zenflow.host import buffers
    from zenflow.host.buffers import HostState
    from zenflow.host.layout import HostJob, HostLayout, HostUpdate

    torch.set_num_threads(args.cores)
    cols = max(1, args.params // ROWS)
    n = ROWS * cols
    chunks = buffers.chunks(0, n, [0, n], [args.cores])
    step = [0]
    hosts: dict[str, HostState] = {}

    def host_for(variant: str) -> HostState:
        """The host state a variant updates: bf16 moments for the "_bf16" ones."""
        dtype = "bfloat16" if variant.endswith(COMPACT) else "float32"
        if dtype not in hosts:
            host = hosts[dtype] = HostState.allocate(HostLayout.build(
                [(ROWS, cols, torch.bfloat16)], sum_slots=2, rates=True, factors=True,
                moments_dtype=getattr(torch, dtype)), "benchmarks/host_adam.py")
            v = host.arena.views
            for name in ("master", "exp_avg", "grad_sum0"):
                v[name].normal_()
            v["exp_avg_sq"].uniform_(0.0, 1e-3)
            v["grad_sum1"].uniform_(0.0, 1e-3)   # sums of squares (moments)
            row_sq, col_sq, deferred, _, _ = host.factors(0)
            row_sq.uniform_(0.0, 4e-3 * cols)   # the window's squares' sums: 4 gradients' worth
            col_sq.uniform_(0.0, 4e-3 * ROWS)
            deferred.fill_(1.0)
        return hosts[dtype]

    def update(variant: str):
        host, rule = host_for(variant), variant.removesuffix(COMPACT)

        def run():
            step[0] += 1
            host.update([HostJob(0, step[0], 4, HostUpdate(
                1e-4, 0.9, 0.999, 1e-8, 0.01, lookahead=1.0 if rule == "lookahead" else 0.0,
                moments=rule in ("moments", "factored"),
                factored=rule == "factored"))], 0)
        return run

    def restore_sums(variant: str):
        g = host_for(variant).arena.views["grad_sum0"]

        def run():
            # The fused kernel leaves the mean in the sums (it divides them in place by 4);
            # times 4 is exact, and is not timed.
            g.mul_(4.0)
        return run

    def probe(variant: str):
        moments = variant == "moments"
        v = host_for(variant).arena.views
        x, g, m, sq, q = (v[k] for k in ("master", "grad_sum0", "exp_avg", "exp_avg_sq",
                                         "grad_sum1"))
        install, rate = v["install_bfloat16"], v["rate_bfloat16"]

        def run():
            # Adding 0 times a buffer reads it and leaves the values as they were, so the
            # update that runs next finds the state it left (no overflow, no negative moments).
            for _, a, b in chunks:
                xs, ms, vs = x[a:b], m[a:b], sq[a:b]
                xs.add_(g[a:b], alpha=0.0)       # master and sums read, master written
                ms.add_(xs, alpha=0.0)           # the first moment read and written
                vs.add_(ms, alpha=0.0)           # the second moment read and written
                if moments:
                    vs.add_(q[a:b], alpha=0.0)   # the sums of squares read
                    rate[a:b].copy_(vs)          # the rates written
                install[a:b].copy_(xs)           # the install values written
        return run

    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    fused = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.01, fused=True)
    systems = {}
    for variant in args.variants:
        systems[f"zenflow_{variant}"] = (update(variant),
                                         restore_sums(variant)
                                         if variant.removesuffix(COMPACT) in ("mean", "lookahead")
                                         else None)
        systems[f"probe_{variant}"] = (probe(variant), None)
    systems["torch_adamw_fused"] = (fused.step, None)

    times: dict[str, list[float]] = {name: [] for name in systems}
    for fn, after in systems.values():   # warm-up: pages, caches, thread pools
        fn()
        if after:
            after()
    for _ in range(args.repeats):
        for name, (fn, after) in systems.items():   # alternated
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
            if after:
                after()
    for host in hosts.values():
        host.arena.release()
    out = {"cores": args.cores, "cpus": sorted(os.sched_getaffinity(0)), "params": n,
           "torch_threads": torch.get_num_threads(), "piece": buffers.PIECE, "systems": {}}
    for name, ts in times.items():
        out["systems"][name] = {"median_s": statistics.median(ts), "min_s": min(ts),
                                "max_s": max(ts), "params_per_s": n / statistics.median(ts)}
    for variant in args.variants:
        zf, pr = out["systems"][f"zenflow_{variant}"], out["systems"][f"probe_{variant}"]
        out[variant] = {
            "ratio_update_to_probe": zf["median_s"] / pr["median_s"],   # target <= 1.2
            "update_params_per_s_per_core": zf["params_per_s"] / args.cores,
            "update_bytes_per_s": VARIANTS[variant] * zf["params_per_s"],
            "probe_bytes_per_s": VARIANTS[variant] * pr["params_per_s"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=64_000_000,
                        help="parameters updated (default 64M: ~1.9 GB of state, beyond caches)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cores", default="1,2", help="core counts, comma-separated")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--tiny", action="store_true",
                        help="64K parameters, 2 repeats: checks that it runs, measures nothing")
    parser.add_argument("--out", default=None,
                        help="JSON path (default benchmarks/results/host_adam_<machine>.json)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: {unknown} are not variants; allowed: {', '.join(VARIANTS)}")
    args.variants = variants
    if args.tiny:
        args.params, args.repeats = 1 << 16, 2
    if args.child:
        args.cores = int(args.cores)
        print(json.dumps(_child(args)))
        return

    try:
        cores = [int(c) for c in args.cores.split(",")]
    except ValueError:
        parser.error(f"--cores must be comma-separated integers, got {args.cores!r}")
    cpus = sorted(os.sched_getaffinity(0))
    if any(not 1 <= c <= len(cpus) for c in cores):
        parser.error(f"--cores: each count must be between 1 and the {len(cpus)} CPUs this "
                     f"process may use, got {args.cores!r}")
    from zenflow.tools.bench.harness import machine_info, machine_tag
    machine = machine_info("cpu")
    runs = []
    for count in cores:
        command = [sys.executable, __file__, "--child", "--cores", str(count), "--params",
                   str(args.params), "--repeats", str(args.repeats), "--variants",
                   ",".join(variants)]
        # pinned before torch is imported: its OpenMP threads inherit the affinity
        result = subprocess.run(command, capture_output=True, text=True, check=False,
                                preexec_fn=lambda c=count: os.sched_setaffinity(0, cpus[:c]))
        if result.returncode:
            sys.exit(f"the {count}-core run failed:\n{result.stderr}")
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
        run = runs[-1]
        for variant in variants:
            r = run[variant]
            print(f"{count} core(s) {variant:9s}: update {r['update_bytes_per_s'] / 1e9:6.1f} "
                  f"GB/s, probe {r['probe_bytes_per_s'] / 1e9:6.1f} GB/s, update/probe "
                  f"{r['ratio_update_to_probe']:.2f}x (target <= 1.2), "
                  f"{r['update_params_per_s_per_core'] / 1e9:.2f} G params/s per core")
        fused = run["systems"]["torch_adamw_fused"]["params_per_s"]
        print(f"{count} core(s) torch AdamW(fused=True): {fused / 1e9:.2f} G params/s")
    out = Path(args.out) if args.out else (
        Path(__file__).parent / "results" / f"host_adam_{machine_tag(machine)}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "tiny": args.tiny, "params": args.params,
                               "repeats": args.repeats, "variants": variants,
                               "bytes_per_param": {v: VARIANTS[v] for v in variants},
                               "runs": runs}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
