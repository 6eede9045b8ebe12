"""The compiled "factored" step a call a matrix against runs of BATCH matrices a call
(zenflow/host/credit_factored.py factored_steps_), by the number of matrices.

    python benchmarks/compiled_runs.py [--matrices 64 226] [--rounds 3] [--out DIR]

On a GPU each compiled call costs the Python thread a guard check and a wrapper (about 0.25 ms
a matrix in the H100's profile, benchmarks/results/profile-step-nvidia-h100-80gb-hbm3.json),
and a step launches rather than computes: that cost is the step. Here the CPU's C++ backend
compiles the same functions (8x8 matrices: the arithmetic is negligible, the calls are what is
left), and `step()` inside a window is timed for both ways, alternated round after round
(medians, and their ratio). The first round of each compiles (its time is reported apart).
Writes benchmarks/results/compiled_runs_<machine>.json. Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # zenflow, from a checkout too

import torch  # noqa: E402

from zenflow.host import compiled, credit_factored  # noqa: E402
from zenflow.optim.optimizer import ZenFlowAdamW  # noqa: E402
from zenflow.tools.bench.harness import machine_info, machine_tag, write_json  # noqa: E402

WAYS = {"a call a matrix": 10 ** 9, "runs of BATCH": credit_factored.BATCH}


def _run(matrices: int, batch: int, steps: int = 40) -> tuple[float, float]:
    """(median step() inside a window, seconds of the whole run) at `matrices` 8x8 matrices."""
    credit_factored.BATCH = batch
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(matrices)]
    opt = ZenFlowAdamW(params, lr=1e-3, update_interval=4, topk_ratio=0.25,
                       device_sum_budget=1 << 40, worker=False)
    grads = [torch.randn(8, 8) for _ in params]
    times, start = [], time.perf_counter()
    try:
        for t in range(steps):
            for p, g in zip(params, grads):
                p.grad = g
            inside = 0 < opt.counters.window_steps < 3
            begin = time.perf_counter()
            opt.step()
            if t >= 8 and inside:
                times.append(time.perf_counter() - begin)
        assert opt.stats()["fused_steps"] > 0
    finally:
        opt.close()
    return statistics.median(times), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matrices", type=int, nargs="+", default=[64, 226])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = parser.parse_args()
    compiled.COMPILE_ON.add("cpu")
    info = machine_info("cpu")
    result = {"benchmark": "compiled_runs", "machine": info, "batch": credit_factored.BATCH,
              "counts": {}}
    for n in args.matrices:
        steps: dict[str, list[float]] = {way: [] for way in WAYS}
        first: dict[str, float] = {}
        for r in range(args.rounds + 1):
            for way, batch in WAYS.items():
                step_s, run_s = _run(n, batch)
                if r == 0:
                    first[way] = run_s
                else:
                    steps[way].append(step_s)
                print(f"{n} matrices, {way}: round {r}, step() {step_s * 1e3:.2f} ms "
                      f"(run {run_s:.1f} s)", flush=True)
        medians = {way: statistics.median(v) for way, v in steps.items()}
        ratio = medians["a call a matrix"] / medians["runs of BATCH"]
        result["counts"][n] = {"median_step_s": medians, "first_run_s": first,
                               "per_matrix_over_runs": ratio}
        print(f"{n} matrices: a call a matrix {medians['a call a matrix'] * 1e3:.2f} ms, runs of "
              f"{credit_factored.BATCH} {medians['runs of BATCH'] * 1e3:.2f} ms: {ratio:.2f}x",
              flush=True)
    write_json(result, os.path.join(args.out, f"compiled_runs_{machine_tag(info)}.json"))


if __name__ == "__main__":
    main()
