"""Does `zenflow estimate` predict what this machine measures? Its model against `zenflow bench`.

Three measurements, one after the other, on the machine this runs on:
  1. `zenflow selftest --sections throughput,bandwidth`: the host's accumulate and AdamW rates on
     the worker's cores and the device's (here the CPU's, on the bench's one training thread)
     AdamW, copy, norm and fingerprint speeds;
  2. `zenflow bench --preset cpu-llama` (Llama-2-7B's 226-matrix layout at width 896, 316M
     parameters) with AdamW, OffloadAdamW and ZenFlowAdamW, alternated in fresh processes;
  3. `zenflow estimate` for the same shapes and settings, fed the figures of 1 and AdamW's
     measured forward+backward from 2.
It prints and writes (results/estimate_calibration.json) predicted against measured for each
system's step and for OffloadAdamW's time in step(): the model is trusted where they agree (the
issue asks for 15%). ZenFlow's time in step() is not compared: on a CPU the worker's work slows
the forward and backward beside it (one memory), which the model counts in the step but does not
place in a phase. Run it on a quiet machine:

    .venv/bin/python benchmarks/calibrate_estimate.py [--preset cpu-llama] [--rounds 2]
    .venv/bin/python benchmarks/calibrate_estimate.py --remodel results/estimate_calibration.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = ("adamw", "offload", "zenflow")
BENCH_MAIN_THREADS = 1   # torch threads of the bench's training processes (its default)


def _run(what: str, argv: list[str], threads: int | None = None) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}: {' '.join(argv)}", flush=True)
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    subprocess.run([sys.executable, "-m", "zenflow", *argv], check=True, env=env)


def _phase(summary: dict, name: str) -> float:
    return summary["phase_median_s"][name]


def compare(bench: dict, estimate: dict) -> list[dict]:
    """Rows of (quantity, predicted, measured, error) from a bench report and an estimate."""
    time_model = estimate["time"]
    measured = {name: bench["systems"][name]["summary"] for name in SYSTEMS}
    rows = [
        ("adamw step", time_model["adamw_step_s"], measured["adamw"]["step_s"]["median"]),
        ("offload step", time_model["offload_step_s"], measured["offload"]["step_s"]["median"]),
        ("zenflow step", time_model["zenflow_step_s"], measured["zenflow"]["step_s"]["median"]),
        ("offload step()", time_model["offload_stall_s"], _phase(measured["offload"], "step")),
    ]
    return [{"quantity": q, "predicted_s": p, "measured_s": m, "error": p / m - 1.0}
            for q, p, m in rows]


def _measure(args) -> tuple[dict, dict]:
    """selftest's figures and `zenflow bench`'s report, measured now."""
    with tempfile.TemporaryDirectory() as tmp:
        figures_path, bench_path = os.path.join(tmp, "selftest.json"), os.path.join(tmp, "bench.json")
        # The device's figures on the torch threads the bench's training processes have, as the
        # model's CPU device runs on them.
        _run("measuring the host and the device",
             ["selftest", "--device", "cpu", "--sections", "throughput,bandwidth",
              "--json", figures_path], threads=BENCH_MAIN_THREADS)
        _run("training side by side", ["bench", "--preset", args.preset, "--systems",
                                       ",".join(SYSTEMS), "--rounds", str(args.rounds),
                                       "--main-threads", str(BENCH_MAIN_THREADS),
                                       "--json", bench_path])
        with open(figures_path) as f:
            figures = json.load(f).get("measured", {})
        with open(bench_path) as f:
            return figures, json.load(f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu-llama")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=os.path.join(HERE, "results", "estimate_calibration.json"))
    p.add_argument("--remodel", metavar="JSON",
                   help="measure nothing: model again the measurements of an earlier run's "
                        "result (after a change to the model)")
    args = p.parse_args()

    from zenflow.tools import estimate as model
    from zenflow.tools.bench.cli import PRESETS, SEED_ZENFLOW_BLOCK
    from zenflow.tools.estimate_shapes import preset_shapes

    if args.remodel:
        with open(args.remodel) as f:
            earlier = json.load(f)
        args.preset, figures = earlier["preset"], earlier["figures"]
        bench = {"machine": earlier["machine"], "systems": {
            name: {"summary": summary} for name, summary in earlier["bench_summaries"].items()}}
    else:
        figures, bench = _measure(args)


    adamw = bench["systems"]["adamw"]["summary"]
    fwd_bwd = _phase(adamw, "forward") + _phase(adamw, "backward")
    shapes, dtype = preset_shapes(args.preset)
    report = model.estimate(shapes, dtype, topk_ratio=SEED_ZENFLOW_BLOCK["topk_ratio"],
                            update_interval=SEED_ZENFLOW_BLOCK["update_interval"], overlap=True,
                            fwd_bwd_s=fwd_bwd, measured=figures, target="cpu",
                            source=f"bench preset {args.preset}")
    rows = compare(bench, report)
    print(f"\n{args.preset}, {PRESETS[args.preset]['n_layer']} layers, forward+backward "
          f"{fwd_bwd * 1e3:.0f} ms (AdamW's, measured)")
    print(f"{'quantity':<16} {'predicted':>10} {'measured':>10} {'error':>7}")
    for row in rows:
        print(f"{row['quantity']:<16} {row['predicted_s'] * 1e3:>8.0f}ms "
              f"{row['measured_s'] * 1e3:>8.0f}ms {row['error']:>+7.0%}")
    result = {
        "benchmark": "calibrate_estimate", "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {**bench["machine"], "node": platform.node()},
        "preset": args.preset, "fwd_bwd_s": fwd_bwd, "figures": figures, "rows": rows,
        "measured_at": (earlier.get("measured_at", earlier["created"]) if args.remodel
                        else time.strftime("%Y-%m-%d %H:%M:%S")),
        "estimate_seconds": report["seconds"], "estimate_time": report["time"],
        "bench_summaries": {name: bench["systems"][name]["summary"] for name in SYSTEMS},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
