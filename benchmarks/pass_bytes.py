"""How fast does a device pass move its bytes, against the copy figure `zenflow selftest` reports?

`zenflow selftest` measures `device_copy_bytes_per_s` as the bytes a copy copies a second (a copy
of N bytes reads N and writes N). zenflow/tools/estimate_terms.py counts a pass's bytes as what it
reads plus what it writes, so it must divide them by twice that figure. This checks it: the
selftest's own copy measurement, then, over the same tensors (pieces of 2M fp32 values, as the
selftest takes them), kernels whose reads and writes are known, each timed in turn, round after
round. For each: its time over the copy's, against traffic / (2 x copy figure) and against
traffic / copy figure (the model before 2026-11-29, which counted the sums' add twice over).

    python benchmarks/pass_bytes.py [--device cpu] [--mib 512] [--rounds 5]

Writes benchmarks/results/pass_bytes_<machine>.json. On a CPU the second core should be quiet.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # zenflow, from a checkout too

from zenflow.tools.estimate_cli import at_least  # noqa: E402 (torch-free: the path first)

PIECE = 1 << 21   # fp32 values a tensor, as zenflow.tools.selftest_measure.device_throughput


def kernels(t: list[list]) -> dict[str, tuple[int, object]]:
    """name -> (bytes read plus written a value, the pass over every piece)."""
    import torch
    a, b, c, d = t

    def each(fn):
        return lambda: [fn(*xs) for xs in zip(a, b, c, d)]
    return {
        "copy": (8, each(lambda a, b, c, d: b.copy_(a))),
        "add, out of place": (12, each(lambda a, b, c, d: torch.add(a, b, out=c))),
        "addcmul_ (a sum's add)": (16, each(lambda a, b, c, d: c.addcmul_(a, b))),
        "sum (a read)": (4, each(lambda a, b, c, d: a.sum())),
        "lerp_ (a moment)": (12, each(lambda a, b, c, d: d.lerp_(a, 0.1))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mib", type=at_least(1, int), default=512,
                        help="MiB of each of the 4 tensors' pieces")
    parser.add_argument("--rounds", type=at_least(1, int), default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    from zenflow.tools.bench.harness import machine_info, machine_tag, write_json
    from zenflow.tools.selftest_measure import _sync, device_throughput
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    numel = args.mib * 2**20 // 4
    figure = device_throughput(device, numel)["device_copy_bytes_per_s"]
    pieces = max(1, numel // PIECE)
    t = [[torch.rand(PIECE, device=device) for _ in range(pieces)] for _ in range(4)]
    n = pieces * PIECE
    work = kernels(t)
    times: dict[str, list[float]] = {name: [] for name in work}
    for r in range(args.rounds + 1):
        for name, (_, fn) in work.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            if r:   # the first round warms up
                times[name].append(time.perf_counter() - start)
        print(f"round {r}/{args.rounds}", flush=True)
    copy_s = statistics.median(times["copy"])
    rows = []
    for name, (traffic, _) in work.items():
        s = statistics.median(times[name])
        rows.append({"kernel": name, "bytes_read_and_written_per_value": traffic,
                     "median_s": s, "vs_copy": s / copy_s,
                     "model_s": traffic * n / (2 * figure),
                     "model_before_s": traffic * n / figure,
                     "measured_over_model": s / (traffic * n / (2 * figure)),
                     "measured_over_model_before": s / (traffic * n / figure)})
    for row in rows:
        print(f"{row['kernel']:24s} {row['vs_copy']:5.2f}x the copy   measured / model "
              f"{row['measured_over_model']:5.2f}  (/ the model before: "
              f"{row['measured_over_model_before']:5.2f})")
    info = machine_info(device.type)
    out = args.out or str(Path(__file__).resolve().parent / "results" /
                          f"pass_bytes_{machine_tag(info)}.json")
    write_json({"benchmark": "pass_bytes", "machine": info, "device": str(device),
                "values": n, "rounds": args.rounds,
                "selftest_device_copy_bytes_per_s": figure, "rows": rows}, out)


if __name__ == "__main__":
    main()
