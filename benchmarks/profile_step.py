"""Where a ZenFlowAdamW step's time goes: torch.profiler over a few training steps of the GPT
that `make gpu-check`'s speed section times (a 1.3B Llama shape on a GPU; a tiny one on a CPU),
per configuration, beside torch.optim.AdamW(fused=True).

    python benchmarks/profile_step.py [--out DIR] [--steps N]

Writes, per system, the profiler's table (self device time and self CPU time, top operators),
the kernel launches and operators per step, and the wall time per step, as JSON (machine named)
and text under DIR (default benchmarks/results/).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from zenflow.optim.optimizer import ZenFlowAdamW
from zenflow.tools.bench.harness import slug, write_json
from zenflow.tools.selftest_checks import _Ctx
from zenflow.tools.selftest_gpu import ZENFLOW_CONFIGS, _batch, _gpt

SYSTEMS = {"adamw": None, **{f"zenflow ({name})": settings
                             for name, settings in ZENFLOW_CONFIGS.items()}}


def _profile(ctx: _Ctx, name: str, settings, steps: int, warmup: int) -> dict:
    large = ctx.cuda
    model, cfg = _gpt(ctx, large, torch.bfloat16)
    if settings is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    else:
        opt = ZenFlowAdamW(model.parameters(), lr=1e-5, **settings)
        opt.attach(model)   # as the speed section and a user's loop
    batch = 4 if large else 2
    parts: dict[str, list[float]] = {"forward_backward": [], "optimizer_step": []}

    def sync() -> None:
        if ctx.cuda:
            torch.cuda.synchronize(ctx.device)

    def one(t: int) -> float:
        """A training step, the device finished; its forward and backward (with the hooks
        attach() puts there) and its step() apart, each to the device's end."""
        x, y = _batch(cfg, t, batch, ctx.device)
        sync()
        start = time.perf_counter()
        model(x, y).backward()
        sync()
        middle = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        end = time.perf_counter()
        parts["forward_backward"].append(middle - start)
        parts["optimizer_step"].append(end - middle)
        return end - start
    try:
        for t in range(warmup):
            one(t)
        for times in parts.values():
            times.clear()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
        with profile(activities=activities) as prof:
            times = [one(warmup + t) for t in range(steps)]
        events = prof.key_averages()
        sort = "self_cuda_time_total" if ctx.cuda else "self_cpu_time_total"
        table = events.table(sort_by=sort, row_limit=30)
        cpu_table = events.table(sort_by="self_cpu_time_total", row_limit=25)
        launches = sum(e.count for e in events if e.key.startswith(("cudaLaunchKernel",
                                                                     "cuLaunchKernel")))
        operators = sum(e.count for e in events if e.key.startswith("aten::"))
        out = {"median_step_s": statistics.median(times), "steps": steps,
               "kernel_launches_per_step": launches / steps,
               "aten_ops_per_step": operators / steps, "table": table, "cpu_table": cpu_table,
               **{f"median_{k}_s": statistics.median(v) for k, v in parts.items()}}
        if settings is not None:
            out["windows"] = opt.stats()["windows"]
    finally:
        if settings is not None:
            opt.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    ctx = _Ctx(device, torch.bfloat16, None, device.type == "cuda")
    machine = torch.cuda.get_device_name(device) if ctx.cuda else platform.processor() or "cpu"
    results = {"machine": machine, "torch": torch.__version__, "systems": {}}
    for name, settings in SYSTEMS.items():
        print(f"-- {name}", flush=True)
        results["systems"][name] = r = _profile(ctx, name, settings, args.steps, warmup=4)
        print(f"{r['median_step_s'] * 1e3:.1f} ms a step (forward and backward "
              f"{r['median_forward_backward_s'] * 1e3:.1f}, step() {r['median_optimizer_step_s'] * 1e3:.1f})"
              f", {r['kernel_launches_per_step']:.0f} launches and {r['aten_ops_per_step']:.0f} "
              "operators a step", flush=True)
        print(r["table"], flush=True)
        print(r["cpu_table"], flush=True)
    write_json(results, os.path.join(args.out, f"profile-step-{slug(machine)}.json"))


if __name__ == "__main__":
    main()
