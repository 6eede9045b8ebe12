"""`make gpu-check`: validate the library on a GPU in a few minutes, and keep the evidence.

Runs `zenflow selftest` on the GPU (every section in fp32, the correctness sections in bf16 too:
results against zenflow.optim.reference and torch.optim.AdamW through a real model with attach,
early copies and real side streams, no host-device sync inside a window, step(closure) with
checkpointing under a deadline, the page-lock path with a refused registration, and step time and
peak memory against torch.optim.AdamW(fused=True) at a 1.3B shape), then the suite's tests marked
`cuda` (`pytest -m cuda`), and writes everything to
benchmarks/results/gpu-check-<gpu>.json. Exit status 0 when all passed.

Without a CUDA device it says so and exits 0 (nothing to check); `--dry-run` runs the same
sections on the CPU at small sizes instead (the test suite does, so the command itself is tested
where CI runs).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from zenflow.tools.bench.harness import slug

PYTEST_DEADLINE_S = 420


def _pytest(repo: str, log_path: str) -> dict:
    """The suite's CUDA tests, in a child with a deadline (none when run from an installed copy
    without the tests); their whole output goes to log_path, since a failure's traceback is what
    a GPU session has the least time to rerun for."""
    tests = os.path.join(repo, "tests")
    if not os.path.isdir(tests):
        return {"status": "skip", "detail": "no tests/ beside the package"}
    command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
               tests]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=repo, capture_output=True, text=True,
                              timeout=PYTEST_DEADLINE_S)
    except subprocess.TimeoutExpired:
        return {"status": "fail", "detail": f"pytest -m cuda ran past {PYTEST_DEADLINE_S} s"}
    with open(log_path, "w") as f:
        f.write(done.stdout + done.stderr)
    tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
    # 5: no test was collected (a checkout without CUDA tests) is not a failure
    status = "pass" if done.returncode in (0, 5) else "fail"
    return {"status": status, "returncode": done.returncode,
            "seconds": time.perf_counter() - start, "tail": tail}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dry-run", action="store_true",
                        help="run the checks on the CPU at small sizes (no GPU needed)")
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "results"),
                        help="where the JSON goes (default: benchmarks/results)")
    parser.add_argument("--sections", default=None,
                        help="comma-separated selftest sections (default: all)")
    parser.add_argument("--no-pytest", action="store_true", help="skip `pytest -m cuda`")
    args = parser.parse_args(argv)

    import torch

    from zenflow.tools.selftest import SECTIONS, run_selftest
    from zenflow.tools.selftest_cli import _row
    if not args.dry_run and not torch.cuda.is_available():
        print(f"gpu-check: skipped: no CUDA device visible to torch {torch.__version__} (built "
              f"for CUDA: {torch.version.cuda or 'no'}). Run it on a machine with a GPU, in the "
              "Python environment that has its CUDA build of torch (make gpu-check GPU_PY=...), "
              "or try `--dry-run` for the same checks on the CPU.")
        return 0
    device = "cpu" if args.dry_run else args.device
    sections = args.sections.split(",") if args.sections else list(SECTIONS)
    start = time.perf_counter()

    def echo(section, check):
        print(_row(section, check), flush=True)
    reports = {}
    for dtype, wanted in (("fp32", sections),
                          ("bf16", [s for s in ("correctness", "bf16") if s in sections])):
        if wanted:
            print(f"-- zenflow selftest --device {device} --dtype {dtype}", flush=True)
            reports[dtype] = run_selftest(device, dtype, sections=wanted, echo=echo)
    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
    result = {"gpu_check": 1, "gpu": gpu, "device": device, "dry_run": args.dry_run,
              "torch": torch.__version__, "cuda": torch.version.cuda, "selftest": reports}
    if not args.no_pytest and not args.dry_run:
        print("-- pytest -m cuda", flush=True)
        os.makedirs(args.out_dir, exist_ok=True)
        log = os.path.join(args.out_dir, f"gpu-check-{slug(gpu)}-pytest.log")
        result["pytest"] = _pytest(os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__)))), log)
        print("\n".join(result["pytest"].get("tail", [result["pytest"].get("detail", "")])))
    result["seconds"] = time.perf_counter() - start
    result["passed"] = (all(r["passed"] for r in reports.values())
                        and result.get("pytest", {}).get("status") != "fail")
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"gpu-check-{slug(gpu)}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"\ngpu-check {'PASSED' if result['passed'] else 'FAILED'} on {gpu} in "
          f"{result['seconds']:.0f} s; wrote {path}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
