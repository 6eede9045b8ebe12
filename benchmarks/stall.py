"""Stall benchmark: how long the training process waits for the optimizer's host work.

Runs `zenflow bench`'s harness (zenflow/tools/bench/: each round and system in a fresh child process,
systems rotated every round, medians over update windows, JSON with the machine named, step-time
and timeline plots) on five systems and the project's GPT (zenflow/bench/model.py):
torch.optim.AdamW (fused, no offload), zenflow.OffloadAdamW (synchronous ZeRO-Offload),
ZenFlowAdamW with U=4 and overlap_step off and on, and ZenFlowAdamW with its own defaults
(windows as short as the host keeps up with). The model is wide and each step sees few tokens,
so the step is optimizer-bound.

What this adds to `zenflow bench`: the stall per step of each system, counting all of
OffloadAdamW's step() as stall (it is host AdamW and copies that training waits for), how much
of that stall ZenFlow removes, and a cProfile of ZenFlow's step() in this process, which splits
the training process's own work (column gather/scatter, selection, queuing copies) from waiting.

    python benchmarks/stall.py                 # 117.6M parameters
    python benchmarks/stall.py --quick         # a small model, to check it runs

Every `zenflow bench` option is accepted (`--seq-len`, `--rounds`, `--topk-ratio`, ...; not
`--preset`: the defaults below take its place). Writes
benchmarks/results/stall_<device>_<cores>cpu_t<seq_len>.json, .png (step times) and
_timeline.png unless --json / --plot name other paths.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
from pathlib import Path

import torch

import zenflow
from zenflow.tools.bench import cli, harness, plots
from zenflow.tools.bench.model import GPT, GPTConfig, TokenStream
from zenflow.tools.bench.report import format_table
from zenflow.tools.bench.systems import BUILDERS

SYSTEMS = ["adamw", "offload", "zenflow-sync", "zenflow", "zenflow-defaults", "zenflow-moments"]
# GPT-2-shaped, 117.6M parameters, batch 1 x 32 tokens: the step, not the model, dominates.
DEFAULTS = dict(systems=",".join(SYSTEMS), n_layer=8, n_embd=1024, n_head=16, vocab_size=8192,
                seq_len=32, batch_size=1, dtype="float32", warmup=4, steps=8, rounds=6,
                lr=1e-4, topk_ratio=0.1, update_interval=4)
QUICK = dict(n_layer=2, n_embd=256, n_head=4, vocab_size=1024, rounds=2)
RESULTS = Path(__file__).resolve().parent / "results"
PACKAGE = os.path.dirname(os.path.abspath(zenflow.__file__))
PROFILE_ROWS = 12


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_arguments(parser)
    parser.add_argument("--quick", action="store_true",
                        help=f"a small model and {QUICK['rounds']} rounds, to check it runs")
    parser.set_defaults(**DEFAULTS)
    args = parser.parse_args(argv)
    if args.preset:
        parser.error("--preset is zenflow bench's; stall.py has its own defaults (see --help)")
    if args.quick:
        vars(args).update(QUICK)
    return args


def stall_per_step(report: dict) -> dict[str, dict[str, float | None]]:
    """Per system: time per step (the harness's window mean), mean step() time, stall per step."""
    rows = {}
    for name, entry in report["systems"].items():
        summary = entry.get("summary")
        if not summary:
            continue
        step = summary["phase_mean_s"]["step"]
        if name == "offload":
            stall = step            # synchronous: all of step() is host work training waits for
        elif name == "adamw":
            stall = 0.0             # no host work at all
        else:
            stall = summary["stall_per_step_s"]
        rows[name] = {"time_per_step_s": summary["window_step_s"]["median"], "step_s": step,
                      "stall_s": stall}
    offload_stall = rows.get("offload", {}).get("stall_s")
    for name in ("zenflow-sync", "zenflow", "zenflow-defaults", "zenflow-moments"):
        stall = rows.get(name, {}).get("stall_s")
        if stall is not None and offload_stall:
            rows[name]["stall_cut_vs_offload"] = 1 - stall / offload_stall
    return rows


def profile_zenflow_step(spec: dict) -> dict[str, float]:
    """Seconds per step that ZenFlowAdamW (overlap on) spends in the package's functions
    (cProfile cumulative time, the largest PROFILE_ROWS), over the measured steps of one round
    run in this process after its warm-up steps."""
    torch.set_num_threads(spec["main_threads"])
    torch.manual_seed(spec["seed"])
    device = torch.device(spec["device"])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cfg = GPTConfig(**spec["model"])
    model = GPT(cfg).to(device=device, dtype=getattr(torch, spec["dtype"]))
    stream = TokenStream(cfg.vocab_size, cfg.seq_len, spec["batch_size"], seed=spec["seed"])
    runner = BUILDERS["zenflow"](model, spec)
    profiler = cProfile.Profile()
    try:
        for i in range(spec["warmup"] + spec["steps"]):
            if i == spec["warmup"]:
                profiler.enable()
            x, y = (t.to(device) for t in stream.batch(i))
            runner.train_step(x, y, sync)
        profiler.disable()
    finally:
        runner.close()
    # The optimizer's own code only: the model and the harness live in zenflow/bench.
    per_function = {}
    for (file, _, func), (_, _, _, cumulative, _) in pstats.Stats(profiler).stats.items():
        if file.startswith(PACKAGE) and not file.startswith(os.path.join(PACKAGE, "bench")):
            key = f"{os.path.relpath(file, PACKAGE)}:{func}"
            per_function[key] = per_function.get(key, 0.0) + cumulative / spec["steps"]
    largest = sorted(per_function.items(), key=lambda kv: -kv[1])[:PROFILE_ROWS]
    return dict(largest)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        spec, systems, rounds = cli.build_spec(args)
    except ValueError as exc:
        print(f"stall.py: error: {exc}", file=sys.stderr)
        return 2
    report = harness.run_benchmark(spec, systems, rounds, child_timeout_s=args.child_timeout,
                                   title="stall benchmark")
    report["benchmark"] = "stall"
    report["stall"] = stall_per_step(report)
    report["zenflow_step_profile_s"] = profile_zenflow_step(spec)

    print()
    print(format_table(report))
    print("\nstall per step (OffloadAdamW: all of step()):")
    for name, row in report["stall"].items():
        stall = "-" if row["stall_s"] is None else f"{row['stall_s'] * 1e3:7.1f} ms"
        cut = row.get("stall_cut_vs_offload")
        print(f"  {name:13s} {row['time_per_step_s'] * 1e3:7.1f} ms/step, step() "
              f"{row['step_s'] * 1e3:7.1f} ms, stall {stall}"
              + ("" if cut is None else f" ({cut:.0%} less than OffloadAdamW)"))
    print("ZenFlowAdamW step() profile (ms/step, cumulative): " + ", ".join(
        f"{k} {v * 1e3:.1f}" for k, v in report["zenflow_step_profile_s"].items()))

    tag = f"stall_{spec['device']}_{report['machine']['cores']}cpu_t{spec['model']['seq_len']}" + (
        "_quick" if args.quick else "")
    json_path = Path(args.json or RESULTS / f"{tag}.json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1))
    print(f"wrote {json_path}")
    for path in plots.write_plots(report, str(args.plot or json_path.with_suffix(".png"))):
        print(f"wrote {path}")
    return 0 if report["stall"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
