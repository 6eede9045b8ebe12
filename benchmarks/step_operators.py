"""The operators ZenFlowAdamW.step() dispatches, by the number of matrices and where their sums
are: the counts behind `zenflow estimate`'s Python-thread terms (zenflow/tools/estimate_terms.py
STEP_OPERATORS...; tests/test_estimate_terms.py holds those constants to this count).

    python benchmarks/step_operators.py [--matrices 64 226] [--out DIR]

Every parameter an 8x8 matrix, topk_ratio 0.25, U=4, no worker, standing in for a real model's
matrices: each too large to share a ColumnBlock or a back-to-back copy with others (stacking is
off unless --stacked; alike small matrices, an MoE's experts, dispatch a count that does not
grow with their number: tests/test_launch_budget.py). A TorchDispatchMode counts the
aten operators each step() dispatches on the calling thread, outside the compiled "factored"
kernels (run here eagerly, as a GPU would run them compiled: what they dispatch inside is the
GPU's one call, counted apart) and outside the host's commands (run inline here, without a
worker: a real run's worker process does them). Per placement: the operators of a step inside a window (the
steady one), and a window's extras (its end, and the steps after it that finish installs, over
the steady count), each fitted as a + b x matrices over the two counts.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # zenflow, from a checkout too

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from zenflow.host import factored_kernels, layout  # noqa: E402
from zenflow.optim import device_adam  # noqa: E402
from zenflow.optim.optimizer import ZenFlowAdamW  # noqa: E402
from zenflow.tools.bench.harness import machine_info, machine_tag, write_json  # noqa: E402

PLACEMENTS = {"host": dict(device_sum_budget=0),
              "device": dict(device_sum_budget=1 << 40, deferred_credit="mean"),
              "factored": dict(device_sum_budget=1 << 40, deferred_credit="factored")}
_KERNELS = ("factored_step", "factored_correct")
# worker=False runs the worker's commands inline: their operators are another process's in a
# real run (the host's accumulate and update), not the training thread's
_WORKERS = os.path.join("zenflow", "host", "commands.py")


class _Operators(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and not (frame.f_code.co_name.startswith(_KERNELS)
                                         or frame.f_code.co_filename.endswith(_WORKERS)):
            frame = frame.f_back
        self.count += frame is None   # the training thread's own, outside the kernels
        return func(*args, **(kwargs or {}))


def count(matrices: int, placement: str, interval: int = 4, steps: int = 20,
          stacked: bool = False) -> dict:
    """{"step": operators of a steady step inside a window, "window": a window's extras}."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(matrices)]
    eager = mock.patch.object(factored_kernels, "compiled_for", lambda fn, device, batch=False: (
        (lambda *a, signature: fn(*a)) if batch else fn))
    limit = device_adam.STACK_ELEMENTS if stacked else 0
    with eager, mock.patch.object(device_adam, "STACK_ELEMENTS", limit), \
            mock.patch.object(layout, "STACK_ELEMENTS", limit):
        opt = ZenFlowAdamW(params, lr=1e-3, update_interval=interval, topk_ratio=0.25,
                           worker=False, **PLACEMENTS[placement])
        by_position: dict[int, int] = {}
        try:
            for t in range(steps):
                for p in params:
                    p.grad = torch.randn(8, 8)
                position = opt.counters.window_steps
                counter = _Operators()
                with counter:
                    opt.step()
                if t >= 2 * interval:   # past warm-up and the first selection
                    by_position[position] = counter.count
        finally:
            opt.close()
    steady = min(by_position.values())
    return {"step": steady, "window": sum(n - steady for n in by_position.values())}


def fit(counts: list[int], values: list[float]) -> tuple[float, float]:
    """(a, b) of a + b x over two points."""
    (n0, n1), (v0, v1) = counts, values
    slope = (v1 - v0) / (n1 - n0)
    return v0 - slope * n0, slope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matrices", type=int, nargs=2, default=[64, 226])
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--stacked", action="store_true",
                        help="let the 8x8 matrices stack, as alike small ones do")
    args = parser.parse_args()
    info = machine_info("cpu")   # (the counts are the code's, not the machine's)
    result = {"benchmark": "step_operators", "machine": info, "matrices": args.matrices,
              "stacked": args.stacked, "placements": {}}
    for placement in PLACEMENTS:
        counted = [count(n, placement, stacked=args.stacked) for n in args.matrices]
        step, window = (fit(args.matrices, [c[k] for c in counted]) for k in ("step", "window"))
        result["placements"][placement] = {"counts": counted, "step": step, "window": window}
        print(f"{placement:9} step {step[0]:.0f} + {step[1]:.2f} x matrices, window "
              f"{window[0]:.0f} + {window[1]:.2f} x matrices  ({counted})", flush=True)
    name = "step_operators_stacked" if args.stacked else "step_operators"
    write_json(result, os.path.join(args.out, f"{name}_{machine_tag(info)}.json"))


if __name__ == "__main__":
    main()
