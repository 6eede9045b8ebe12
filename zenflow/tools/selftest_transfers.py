"""The transfers section of `zenflow selftest`: the asynchronous transfer path equals a
synchronous one (SyncTransfers) bit for bit with the device kept busy, and a step inside a window
never waits for the device."""
from __future__ import annotations

import contextlib
import os
import threading
import time

import torch

from zenflow.host.transfers import DONE, Transfers
from zenflow.optim.optimizer import ZenFlowAdamW
from zenflow.tools.selftest_checks import HP, Check, _Ctx, _params, _use_transfers, _values


class SyncTransfers(Transfers):
    """Every copy blocking and on the current stream: the synchronous path that the asynchronous
    one must equal bit for bit."""

    def to_host(self, pairs):
        for dst, src in pairs:
            dst.copy_(src)
        return DONE

    def to_device(self, pairs, then=None):
        for dst, src in pairs:
            dst.copy_(src)
        if then is not None:
            then()
        return DONE

    def fence(self, ticket):
        pass


def _busy_run(ctx: _Ctx, shapes, steps: int, factory) -> list[list[torch.Tensor]]:
    """Train with `factory`'s transfers while the device is kept busy: each gradient is written
    in place after a long kernel (a copy that does not wait for it reads stale bytes), zeroed in
    place right after step() (one that is not fenced reads zeros) and each weight is read right
    after step() (an install the compute stream does not wait for is missed)."""
    params = _params(_values(shapes, 5), ctx)
    for p in params:
        p.grad = torch.zeros_like(p)
    snaps = []
    opt = ZenFlowAdamW(params, **HP, topk_ratio=0.25, update_interval=2, overlap_step=True,
                       select_strategy="step", select_interval=4)
    _use_transfers(opt, factory)
    try:
        for t in range(steps):
            gen = torch.Generator(ctx.device).manual_seed(1000 + t)   # the same in every run
            gs = [torch.randn(p.shape, generator=gen, device=ctx.device, dtype=ctx.dtype) *
                  (1 + 3 * torch.rand(p.shape[-1:], generator=gen, device=ctx.device))
                  for p in params]
            if ctx.cuda:
                torch.cuda._sleep(2_000_000)
            for p, g in zip(params, gs):
                p.grad.copy_(g)
            opt.step()
            for p in params:
                p.grad.zero_()
            snaps.append([p.detach().clone() for p in params])
        opt.synchronize()
        snaps.append([p.detach().clone() for p in params])
        if ctx.cuda:
            torch.cuda.synchronize(ctx.device)
    finally:
        opt.close()
    return snaps


def transfers(ctx: _Ctx) -> list[Check]:
    shapes = ([(2048, 2048), (2048,), (4096, 2048), (2048, 4096)] if ctx.cuda else
              [(64, 48), (64,), (96, 64), (48, 96)])
    steps = 32 if ctx.cuda else 16
    start = time.perf_counter()
    sync = _busy_run(ctx, shapes, steps, SyncTransfers)
    sync_s = time.perf_counter() - start
    start = time.perf_counter()
    fast = _busy_run(ctx, shapes, steps, ctx.transfers)
    async_s = time.perf_counter() - start
    bad = next((t for t, (a, b) in enumerate(zip(fast, sync))
                if not all(torch.equal(x, y) for x, y in zip(a, b))), None)
    where = "CUDA side streams, device kept busy" if ctx.cuda else "CPU: the same code path"
    return [Check("async transfers == sync, bit for bit", "pass" if bad is None else "fail",
                  f"{steps} steps ({where})" + ("" if bad is None else
                                                f"; first difference after step {bad}"),
                  measured={"sync_s": sync_s, "async_s": async_s}),
            work_after_a_copy(ctx),
            *(no_syncs_inside_a_window(ctx, sums) for sums in ("host", "device", "bf16 device"))]


def work_after_a_copy(ctx: _Ctx) -> Check:
    """to_device's `then` (DDP's install: its correction and all-gather, optim/installs.py) runs
    after the copy and inside its ticket, with the device kept busy first: work in `then` that
    read the destination before the copy landed, or a ticket that said done before `then`'s work
    had run, would give other values. Its temporaries are allocated on the copy's stream."""
    n = (1 << 24) if ctx.cuda else (1 << 12)
    name = "device work queued after an install's copy lands with it"
    # (on a CPU the copy thread, which the training thread waits for before `then`)
    transfers = (ctx.transfers(ctx.device) if ctx.transfers is not None else
                 Transfers(ctx.device, copy_cores=None if ctx.cuda else
                           sorted(os.sched_getaffinity(0))[:1]))
    try:
        src = torch.arange(n, dtype=torch.float32, pin_memory=ctx.cuda)
        dst = torch.zeros(n, device=ctx.device)
        gathered = torch.zeros(n, device=ctx.device)

        def then():   # a correction through a temporary, then a "gather" into another tensor
            doubled = dst * 2.0
            dst.copy_(doubled)
            gathered.copy_(dst)
        bad = 0
        for _ in range(3):
            dst.zero_()
            gathered.zero_()
            if ctx.cuda:
                torch.cuda._sleep(2_000_000)   # the copy stream must wait for this, then copy
            ticket = transfers.to_device([(dst, src)], then=then)
            transfers.order_after([ticket])
            bad += int(not torch.equal(gathered.cpu(), src * 2.0))
        if ctx.cuda:
            torch.cuda.synchronize(ctx.device)
    finally:
        transfers.close()
    return Check(name, "pass" if bad == 0 else "fail",
                 f"3 copies of {n} values, each doubled and copied on in its ticket"
                 + ("" if bad == 0 else f"; {bad} read other values"))


def no_syncs_inside_a_window(ctx: _Ctx, sums: str) -> Check:
    """The steps strictly inside a window (window sums on the host or on the device, clipped,
    with GradScaler's scale and flag) run under torch.cuda.set_sync_debug_mode("error"): any
    wait of the Python thread for the device raises there."""
    name = f"no host-device sync inside a window ({sums} sums)"
    if not ctx.cuda:
        return Check(name, "skip", "n/a on CPU: set_sync_debug_mode is CUDA's (the CPU tests "
                                   "count reads instead: tests/test_host_reads.py)")
    params = _params(_values([(512, 256), (256,), (256, 512)], 11), ctx)
    opt = ZenFlowAdamW(params, topk_ratio=0.25, update_interval=4, overlap_step=True,
                       max_grad_norm=1.0, device_sum_budget=0 if sums == "host" else 10 ** 9,
                       device_sum_dtype="bfloat16" if sums == "bf16 device" else "float32")
    _use_transfers(opt, ctx.transfers)
    detail = "steps 1 and 2 of a window of 4"
    status = "pass"
    waits = _ThreadWaits()
    try:
        for t in range(4):
            for p in params:
                p.grad = torch.randn_like(p) * 256.0
            opt.grad_scale = torch.full((), 256.0, device=ctx.device)
            opt.found_inf = torch.zeros((), device=ctx.device)
            inside = t in (1, 2)
            if inside:
                torch.cuda.set_sync_debug_mode("error")
            try:
                with waits.counted(inside):
                    opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    except RuntimeError as exc:
        status, detail = "fail", f"step {t}: {str(exc).splitlines()[0]}"
    finally:
        opt.close()
    if status == "pass" and waits.calls:
        status, detail = "fail", f"the training thread waited on {waits.calls}"
    return Check(name, status, detail, measured={"training_thread_waits": waits.calls})


class _ThreadWaits:
    """Counts the calling thread's waits for CUDA events and streams, which sync debug mode does
    not see (another thread's, the worker link's dispatch thread, are its business)."""

    def __init__(self):
        self.calls: list[str] = []

    @contextlib.contextmanager
    def counted(self, on: bool):
        if not on:
            yield
            return
        me = threading.get_ident()
        originals = {(cls, name): getattr(cls, name) for cls, name in (
            (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"))}

        def counting(cls, name, original):
            def wait(obj, *args, **kwargs):
                if threading.get_ident() == me:
                    self.calls.append(f"{cls.__name__}.{name}")
                return original(obj, *args, **kwargs)
            return wait
        try:
            for (cls, name), original in originals.items():
                setattr(cls, name, counting(cls, name, original))
            yield
        finally:
            for (cls, name), original in originals.items():
                setattr(cls, name, original)
