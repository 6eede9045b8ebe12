"""`zenflow selftest`: prove ZenFlow correct on this machine and measure what `zenflow estimate`
needs, in about a minute.

Sections (each a list of checks with a status, a detail and measured numbers; JSON has them all):

    environment   versions, device
    correctness   ZenFlowAdamW against zenflow.optim.reference (CPU) for fixed and random settings,
                  overlap on and off, with reselection, in the chosen dtype
    equivalences  DESIGN.md section 2's torch.optim.AdamW equivalences, fp32
    bf16          bf16 parameters stay finite and equal the fp32 run rounded to bf16
    offload       OffloadAdamW equals torch.optim.AdamW
    transfers     the asynchronous transfer path equals a synchronous one bit for bit, with the
                  device kept busy (on CUDA a real side-stream test; on CPU the same code path)
    worker        a killed worker is a clear error within 5 s; an idle one is replaced; close()
                  leaves no process, descriptor, mapping or /dev/shm file
    model, closure, pagelocks
                  a real model with attach() against the reference and torch's AdamW;
                  step(closure) with checkpointing under a deadline; refused and dropped
                  page-locks (zenflow/tools/selftest_gpu.py)
    throughput    host AdamW and accumulation on the worker's cores; AdamW on the device
    bandwidth     page-locked device->host and host->device (CUDA; "n/a on CPU")
    memory        free RAM (what the host arena can reserve), /dev/shm
    speed         step time and peak memory against torch.optim.AdamW(fused=True), bf16 (a 1.3B
                  Llama shape on a GPU)

The checks of each section live in selftest_correctness.py (correctness, equivalences, bf16,
offload), selftest_transfers.py, selftest_worker.py, selftest_gpu.py and selftest_compiled.py;
what they share
(`Check`, the context, values and tolerances) in selftest_checks.py.

`run_selftest(transfers=factory)` replaces the transfer path of every optimizer the checks
build, so a test can hand in a deliberately broken one and see the selftest fail.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import asdict

import torch

from zenflow.host.transfers import uses_cuda
from zenflow.tools import selftest_checks as checks
from zenflow.tools import selftest_compiled, selftest_correctness, selftest_transfers, selftest_worker
from zenflow.tools import selftest_gpu as gpu
from zenflow.tools import selftest_measure as measure
from zenflow.tools.selftest_checks import Check
from zenflow.tools.selftest_sections import SECTIONS as SECTIONS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}   # selftest_sections.DTYPES
MIB = 1 << 20


def _environment(ctx) -> list[Check]:
    env = measure.environment(ctx.device)
    return [Check("versions and device", "pass",
                  f"zenflow {env['zenflow']}, torch {env['torch']}, {env.get('gpu', 'CPU')}",
                  measured=env)]


def _throughput(ctx) -> list[Check]:
    mem = measure.memory()["available_host_bytes"]
    want = (32 if ctx.cuda else 4) * MIB
    numel = max(MIB, min(want, mem // 64))        # ~24-28 bytes per parameter, with margin
    host = measure.host_throughput(numel, ctx.dtype)
    # 128 MiB of layer-sized tensors per operand, which no cache holds (a CPU's device figures
    # otherwise read from its L3)
    dev = measure.device_throughput(ctx.device, min(32 * MIB, mem // 64))
    cores = host["worker_cores"]
    return [Check("host AdamW on the worker's cores", "pass",
                  f"{host['host_adamw_params_per_s'] / 1e9:.2f} G params/s AdamW, "
                  f"{host['host_accumulate_params_per_s'] / 1e9:.2f} G params/s accumulate, "
                  f"{host['host_factored_params_per_s'] / 1e9:.2f} G params/s \"factored\" "
                  f"({host['host_dtype']}), {len(cores)} core(s) {cores}, "
                  f"{host['host_params'] / 1e6:.0f}M params; one core: "
                  f"{host['host_adamw_params_per_s_per_core'] / 1e9:.2f} G params/s AdamW, "
                  f"{host['host_adamw_moments_params_per_s_per_core'] / 1e9:.2f} with "
                  f"\"moments\", {host['host_factored_params_per_s_per_core'] / 1e9:.2f} "
                  "\"factored\"", measured=host),
            Check("AdamW on the device", "pass",
                  f"{dev['device_adamw_params_per_s'] / 1e9:.2f} G params/s (fused, fp32); copies "
                  f"{dev['device_copy_bytes_per_s'] / 1e9:.1f} GB/s, a pointwise pass reads and "
                  f"writes {dev['device_pass_bytes_per_s'] / 1e9:.1f} GB/s, gradient norm reads "
                  f"{dev['device_norm_bytes_per_s'] / 1e9:.1f} GB/s, fingerprints "
                  f"{dev['device_fingerprint_bytes_per_s'] / 1e9:.1f} GB/s",
                  measured=dev)]


def _bandwidth(ctx) -> list[Check]:
    if not ctx.cuda:
        bw = measure.bandwidth(ctx.device, 256 * MIB)
        return [Check("pinned D2H / H2D bandwidth", "skip", "n/a on CPU"),
                Check("memcpy (the CPU device's stand-in for the bus)", "pass",
                      f"{bw['memcpy_bytes_per_s'] / 1e9:.1f} GB/s", measured=bw)]
    bw = measure.bandwidth(ctx.device, 256 * MIB)
    return [Check("pinned D2H / H2D bandwidth", "pass" if bw["pinned"] else "fail",
                  f"D2H {bw['d2h_bytes_per_s'] / 1e9:.1f} GB/s, H2D {bw['h2d_bytes_per_s'] / 1e9:.1f}"
                  " GB/s" + ("" if bw["pinned"] else "; page-locking FAILED: copies will block"),
                  measured=bw)]


def _memory(ctx) -> list[Check]:
    mem = measure.memory()
    shm = mem.get("dev_shm_free_bytes")
    return [Check("free host memory", "pass",
                  f"{mem['available_host_bytes'] / 2**30:.1f} GiB available for the host arena; "
                  f"/dev/shm {'n/a' if shm is None else f'{shm / 2**30:.1f} GiB'} (not used: the "
                  "arena is a memfd)", measured=mem)]


_RUNNERS = {
    "environment": _environment,
    "correctness": lambda ctx: selftest_correctness.correctness(ctx, quick=not ctx.cuda),
    "equivalences": selftest_correctness.equivalences,
    "bf16": selftest_correctness.bf16,
    "offload": selftest_correctness.offload,
    "transfers": selftest_transfers.transfers,
    "worker": selftest_worker.worker,
    "model": gpu.model,
    "closure": gpu.closure,
    "pagelocks": gpu.pagelocks,
    "compiled": selftest_compiled.compiled,
    "throughput": _throughput,
    "bandwidth": _bandwidth,
    "memory": _memory,
    "speed": gpu.speed,
}


def _status(items: list[Check]) -> str:
    if any(c.status == "fail" for c in items):
        return "fail"
    return "skip" if items and all(c.status == "skip" for c in items) else "pass"


def run_selftest(device=None, dtype: str = "fp32", transfers=None, sections=SECTIONS,
                 echo=None) -> dict:
    """Run the checks; returns the report (see module doc). `transfers`: a factory
    device -> Transfers used by every optimizer the checks build instead of the package's own.
    `echo(section, check)` is called as each check finishes."""
    device = torch.device(device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not uses_cuda(device):
        raise ValueError(f"device {device}: CUDA is not available to this torch build")
    ctx = checks._Ctx(device, DTYPES[dtype], transfers, uses_cuda(device))
    start = time.perf_counter()
    report = {"zenflow_selftest": 1, "device": str(device), "dtype": dtype, "sections": {}}
    for name in SECTIONS:
        if name not in sections:
            continue
        t0 = time.perf_counter()
        try:
            items = _RUNNERS[name](ctx)
        except Exception as exc:   # a crashing check is a failed check, with its cause
            items = [Check("(crashed)", "fail", f"{type(exc).__name__}: {exc}",
                           measured={"traceback": traceback.format_exc()})]
        seconds = time.perf_counter() - t0
        for c in items:
            c.seconds = c.seconds or seconds / len(items)
            if echo:
                echo(name, c)
        report["sections"][name] = {"status": _status(items), "seconds": seconds,
                                    "checks": [asdict(c) for c in items]}
    report["seconds"] = time.perf_counter() - start
    report["passed"] = all(s["status"] != "fail" for s in report["sections"].values())
    report["measured"] = measured_figures(report)
    return report


def measured_figures(report: dict) -> dict:
    """The numbers `zenflow estimate --selftest-json` uses, flattened from the sections."""
    out = {"device": report["device"]}
    keep = ("host_adamw_params_per_s", "host_accumulate_params_per_s", "worker_cores",
            "host_factored_params_per_s",
            "host_adamw_params_per_s_per_core", "host_adamw_moments_params_per_s_per_core",
            "host_factored_params_per_s_per_core",
            "device_adamw_params_per_s", "device_copy_bytes_per_s", "device_norm_bytes_per_s",
            "device_fingerprint_bytes_per_s", "device_pass_bytes_per_s",
            "d2h_bytes_per_s", "h2d_bytes_per_s",
            "memcpy_bytes_per_s", "pinned", "available_host_bytes", "total_host_bytes",
            "dev_shm_free_bytes", "gpu_memory_bytes", "gpu", "cpus")
    for section in report["sections"].values():
        for c in section["checks"]:
            out.update({k: v for k, v in c["measured"].items() if k in keep})
    return out
