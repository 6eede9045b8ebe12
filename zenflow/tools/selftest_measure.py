"""What `zenflow selftest` measures on this machine (and `zenflow estimate` reads back): host
AdamW and accumulation throughput on the worker's cores, AdamW throughput on the device, the bus
bandwidth each way through page-locked host memory (CUDA), and the memory the host can give."""
from __future__ import annotations

import os
import platform
import statistics
import time

import torch

from zenflow.adamw import adamw_
from zenflow.host.arena import Arena, available_host_bytes
from zenflow.host.buffers import HostState
from zenflow.host.commands import Accumulate, Update
from zenflow.host.cores import local_rank_share, split_cores
from zenflow.host.fingerprints import column_bit_sums
from zenflow.host.layout import HostJob, HostJobs, HostLayout, HostUpdate
from zenflow.host.transfers import Transfers, uses_cuda
from zenflow.host.worker import WorkerHostRunner
from zenflow.optim.step_scale import gradient_norms

GIB = 1 << 30


def _sync(device: torch.device) -> None:
    if uses_cuda(device):
        torch.cuda.synchronize(device)


def environment(device: torch.device) -> dict:
    import zenflow
    env = {"zenflow": zenflow.__version__, "torch": torch.__version__,
           "python": platform.python_version(), "platform": platform.platform(),
           "device": str(device), "cpus": len(os.sched_getaffinity(0))}
    if uses_cuda(device):
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_bytes=props.total_memory,
                   cuda=torch.version.cuda, capability=f"{props.major}.{props.minor}")
    return env


def memory() -> dict:
    """Free RAM (what an arena can reserve), total RAM and /dev/shm (which the arena does not use)."""
    out = {"available_host_bytes": available_host_bytes()}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    out["total_host_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        st = os.statvfs("/dev/shm")
        out["dev_shm_free_bytes"] = st.f_bavail * st.f_frsize
    except OSError:
        out["dev_shm_free_bytes"] = None
    return out


def worker_cores() -> list[int]:
    """The cores a single-rank optimizer's worker gets with the default placement
    (pt_reserved_cores_perc unset: every core but two)."""
    return split_cores(None, local_rank_share(sorted(os.sched_getaffinity(0))))[1]


def host_throughput(numel: int, dtype: torch.dtype, repeats: int = 3) -> dict:
    """Host AdamW, the "factored" update and gradient accumulation, in parameters per second, in
    a real worker on the worker's cores, over `numel` parameters (large enough to stream from
    memory, not cache);
    and the AdamW of one core, for a window's "mean" update, for a "moments" one (which
    also reads the squares and writes the rates) and for a "factored" one: what a core
    computes, against which the worker's figure shows how far more cores help (they stop
    helping at the memory's bandwidth)."""
    cols = 4096
    rows = max(1, numel // cols)
    layout = HostLayout.build([(rows, cols, dtype)], sum_slots=2, rates=True, factors=True)
    host = HostState.allocate(layout, "zenflow selftest")
    host.step_coef(0).fill_(1.0)   # a kept step's factor: a skipped step's (0) adds nothing
    host.state("exp_avg_sq", 0).fill_(1e-4)
    host.fp32("grad_sum1", 0).fill_(1e-4)   # the squares of a "moments" window
    row_sq, col_sq, deferred, _, _ = host.factors(0)   # ... and of a "factored" one
    row_sq.fill_(1e-4 * cols)
    col_sq.fill_(1e-4 * rows)
    deferred.fill_(1.0)
    cores = worker_cores()

    def timed(runner, command) -> float:
        before = runner.busy_seconds
        runner.send(command)
        runner.wait()
        return runner.busy_seconds - before

    def updates(runner, moments: bool, factored: bool = False) -> list[float]:
        return [timed(runner, Update(0, HostJobs.of([HostJob(0, i + 1, 1, HostUpdate(
                   1e-3, 0.9, 0.999, 1e-8, 0.01, moments=moments, factored=factored))])))
                for i in range(repeats + 1)][1:]
    runner = WorkerHostRunner(host, cores)
    try:
        acc = [timed(runner, Accumulate(0, 0, (0,) if i else (), () if i else (0,)))
               for i in range(repeats + 1)][1:]
        upd = updates(runner, moments=False)
        factored = updates(runner, moments=True, factored=True)
    finally:
        runner.close()
    one = WorkerHostRunner(host, cores[:1])
    try:
        upd_one, moments_one = updates(one, moments=False), updates(one, moments=True)
        factored_one = updates(one, moments=True, factored=True)
    finally:
        one.close()
        host.arena.release()
    n = rows * cols

    def rate(times: list[float]) -> float:
        return n / max(statistics.median(times), 1e-9)
    return {"host_params": n, "host_dtype": str(dtype).removeprefix("torch."),
            "worker_cores": cores,
            "host_adamw_params_per_s": rate(upd),
            "host_accumulate_params_per_s": rate(acc),
            "host_factored_params_per_s": rate(factored),
            "host_adamw_params_per_s_per_core": rate(upd_one),
            "host_adamw_moments_params_per_s_per_core": rate(moments_one),
            "host_factored_params_per_s_per_core": rate(factored_one)}


def _timed(device: torch.device, work, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        work(i)
        _sync(device)
        times.append(time.perf_counter() - start)
    return max(statistics.median(times[1:]), 1e-9)


def device_throughput(device: torch.device, numel: int, repeats: int = 3,
                      piece: int = 1 << 21) -> dict:
    """Fused AdamW on the device (fp32 state), in parameters per second, and the device's own
    copy bandwidth (bytes copied per second), how fast the gradient-norm kernel reads and how
    fast a window end's fingerprint reads: over tensors of `piece` elements (a layer's matrix at
    narrow width; on a CPU a kernel over one huge tensor runs at half the speed it has over a
    model's matrices, whose state stays in cache from one pass to the next)."""
    cols = 4096
    piece = max(cols, min(piece, numel) // cols * cols)
    pieces = max(1, numel // piece)
    t = [[torch.zeros(piece, device=device) for _ in range(pieces)] for _ in range(4)]
    numel = piece * pieces
    adamw = _timed(device, lambda i: adamw_(*t, i + 1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                            weight_decay=0.01), repeats)
    copy = _timed(device, lambda i: [b.copy_(a) for a, b in zip(t[0], t[1])], repeats)
    # a pointwise pass (a sum's add: reads three values, writes one), the rate the estimate
    # divides a pass's reads plus writes by
    update = _timed(device, lambda i: [c.addcmul_(a, b) for a, b, c in zip(t[0], t[1], t[2])],
                    repeats)
    norm = _timed(device, lambda i: gradient_norms(t[0]), repeats)
    fingerprint = _timed(device, lambda i: [column_bit_sums(x.view(-1, cols)) for x in t[0]],
                         repeats)
    return {"device_adamw_params_per_s": numel / adamw, "device_copy_bytes_per_s": 4 * numel / copy,
            "device_pass_bytes_per_s": 16 * numel / update,
            "device_norm_bytes_per_s": 4 * numel / norm,
            "device_fingerprint_bytes_per_s": 4 * numel / fingerprint}


def bandwidth(device: torch.device, nbytes: int, repeats: int = 4) -> dict:
    """Device->host and host->device bytes per second through page-locked shared host memory
    (registered as the optimizer registers its arena); on a CPU device, the memcpy bandwidth
    that stands in for the bus (copies are synchronous there and run in the training thread)."""
    if not uses_cuda(device):
        # A CPU device's copies run in the training thread, on its torch threads, between its
        # tensors and the arena: measured so, over more bytes than any cache holds.
        arena = Arena.create([("buf", torch.float32, nbytes // 4)], "zenflow selftest")
        try:
            a, b = torch.ones(nbytes // 4), arena.views["buf"]
            b.fill_(0.0)   # its pages exist before the timing
            seconds = _timed(device, lambda i: b.copy_(a), repeats)
            del a, b
        finally:
            arena.release()
        return {"pinned": False, "memcpy_bytes_per_s": nbytes / seconds}
    arena = Arena.create([("buf", torch.uint8, nbytes)], "zenflow selftest")
    transfers = Transfers(device)
    try:
        host = arena.views["buf"]
        transfers.pin([host])
        pinned = bool(host.is_pinned())
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        out = {"pinned": pinned}
        for name, dst, src in (("d2h_bytes_per_s", host, dev), ("h2d_bytes_per_s", dev, host)):
            times = []
            for _ in range(repeats + 1):
                torch.cuda.synchronize(device)
                start = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
            out[name] = nbytes / statistics.median(times[1:])
        del dev, host, dst, src
    finally:
        transfers.unpin()
        arena.release()
    return out
