"""The checks of `zenflow selftest` (see zenflow/tools/selftest.py for the sections they form)."""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import torch

from zenflow.host.transfers import DONE, Transfers
from zenflow.optim.offload import OffloadAdamW
from zenflow.optim.optimizer import ZenFlowAdamW
from zenflow.optim.reference import ReferenceZenFlow

SHAPES = [(16, 12), (16,), (10, 16), (10,), (6, 5, 2), (24, 10), (24,)]  # incl. a 3-D weight
HP = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


@dataclass
class Check:
    name: str
    status: str            # "pass", "fail" or "skip"
    detail: str = ""
    seconds: float = 0.0
    measured: dict = field(default_factory=dict)


class SyncTransfers(Transfers):
    """Every copy blocking and on the current stream: the synchronous path that the asynchronous
    one must equal bit for bit."""

    def to_host(self, pairs):
        for dst, src in pairs:
            dst.copy_(src)
        return DONE

    def to_device(self, pairs):
        for dst, src in pairs:
            dst.copy_(src)
        return DONE

    def fence(self, ticket):
        pass


@dataclass
class _Ctx:
    device: torch.device
    dtype: torch.dtype
    transfers: object      # factory(device) -> Transfers, or None for the package's own
    cuda: bool


def _values(shapes, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) * 0.5 for s in shapes]


def _grads(shapes, steps: int, seed: int) -> list[list[torch.Tensor]]:
    """Random gradients whose columns differ in scale, so the selection is well defined."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    return [[torch.randn(s, generator=gen) * (1 + 3 * torch.rand(s[-1:], generator=gen))
             for s in shapes] for _ in range(steps)]


def _params(values, ctx: _Ctx, dtype=None) -> list[torch.Tensor]:
    return [v.to(device=ctx.device, dtype=dtype or ctx.dtype, copy=True).requires_grad_()
            for v in values]


def _use_transfers(opt, factory) -> None:
    """Swap the optimizer's transfer path (keeping its page-lock registrations to undo)."""
    if factory is None:
        return
    old, new = opt._pipeline.transfers, factory(opt.device)
    new._locks, old._locks = old._locks, new._locks
    opt._pipeline.transfers = opt._pipeline.device_sums.transfers = new


def _tol(ctx: _Ctx, dtype=torch.float32) -> dict:
    if dtype == torch.bfloat16:   # both sides round the same fp32 master: at most an ulp apart
        return dict(rtol=2.0 ** -7, atol=1e-5)
    return dict(rtol=1e-4, atol=1e-5) if ctx.cuda else dict(rtol=1e-5, atol=1e-6)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().cpu().float() - b.detach().cpu().float()).abs().max()) if a.numel() \
        else 0.0


def _timed(name: str, check, *args) -> Check:
    start = time.perf_counter()
    c = check(*args)
    c.name, c.seconds = name, time.perf_counter() - start
    return c


def _close(a, b, tol) -> bool:
    return torch.allclose(a.detach().cpu().float(), b.detach().cpu().float(), **tol)


# ---------------------------------------------------------------------------------- correctness
# Every window sum on the device, whatever it has spare: deferred_credit "moments" then applies to
# every matrix, as the reference assumes (it is told no matrix takes "mean"); "mean" runs keep
# theirs on the host, so that both paths are checked.
ALL_ON_DEVICE = dict(device_sum_budget=1 << 50)
ON_HOST = dict(device_sum_budget=0)


def _against_reference(ctx: _Ctx, settings: dict, steps: int, seed: int) -> Check:
    values, grads = _values(SHAPES, seed), _grads(SHAPES, steps, seed)
    fast = _params(values, ctx)
    slow = [v.to(ctx.dtype).clone() for v in values]
    tol, worst, bad = _tol(ctx, ctx.dtype), 0.0, None
    placement = ALL_ON_DEVICE if settings.get("deferred_credit") == "moments" else ON_HOST
    opt = ZenFlowAdamW(fast, select_strategy="step", select_interval=4, **placement, **settings)
    _use_transfers(opt, ctx.transfers)
    ref = ReferenceZenFlow(slow, select_interval=4, **settings)
    try:
        for t, gs in enumerate(grads):
            for p, g in zip(fast, gs):
                p.grad = g.to(device=ctx.device, dtype=ctx.dtype)
            opt.step()
            ref.step([g.to(ctx.dtype) for g in gs], reselect=(t, "reselect") in opt.decisions)
            for p, q in zip(fast, slow):
                worst = max(worst, _diff(p, q))
                if bad is None and not _close(p, q, tol):
                    bad = t
        reselections = opt.num_reselections
    finally:
        opt.close()
    shown = ", ".join(f"{k}={v}" for k, v in settings.items() if k != "lr")
    detail = (f"{shown}; {steps} steps, {reselections} reselection(s), max |diff| {worst:.1e}"
              + (f"; first mismatch at step {bad}" if bad is not None else ""))
    return Check("", "pass" if bad is None else "fail", detail,
                 measured={"max_abs_diff": worst, "reselections": reselections})


def correctness(ctx: _Ctx, quick: bool) -> list[Check]:
    fixed = dict(lr=1e-2, topk_ratio=0.25, update_interval=3, full_warm_up_rounds=2,
                 max_grad_norm=4.0)
    checks = []
    for overlap in (True, False):
        for credit in ("moments", "mean"):
            checks.append(_timed(f"vs reference, fixed, overlap {'on' if overlap else 'off'}, "
                                 f"{credit}", _against_reference, ctx,
                                 dict(fixed, overlap_step=overlap, deferred_credit=credit), 24, 1))
    for seed in range(3 if quick else 8):
        rng = random.Random(seed)
        settings = dict(lr=rng.choice([1e-2, 3e-3]), topk_ratio=[0.25, 0.5, 0.0, 1.0][seed % 4],
                        update_interval=rng.choice([1, 2, 3]),
                        overlap_step=seed % 3 != 1,
                        full_warm_up_rounds=rng.choice([0, 2]),
                        max_grad_norm=rng.choice([None, 4.0]), importance=rng.choice(["l2", "l1"]),
                        deferred_credit=("moments", "mean")[seed % 2])
        checks.append(_timed(f"vs reference, random settings #{seed}", _against_reference, ctx,
                             settings, 12, 100 + seed))
    return checks


def _equivalence(ctx: _Ctx, kw: dict, mode: str, steps: int = 12) -> Check:
    """ZenFlowAdamW(**kw) against torch.optim.AdamW on the same device: `mode` is "same",
    "accumulate" (matrices: AdamW every U steps on the mean gradient) or "delayed" (matrices one
    step late); vectors are AdamW every step in all three."""
    values, grads = _values(SHAPES, 7), _grads(SHAPES, steps, 7)
    fast, twin = _params(values, ctx, torch.float32), _params(values, ctx, torch.float32)
    mats, vecs = [p for p in twin if p.ndim >= 2], [p for p in twin if p.ndim < 2]
    opts = ([torch.optim.AdamW(mats, **HP), torch.optim.AdamW(vecs, **HP)] if mode == "accumulate"
            else [torch.optim.AdamW(twin, **HP)])
    sums = [torch.zeros_like(p) for p in mats]
    interval = kw.get("update_interval", 1)
    tol, worst, bad = _tol(ctx), 0.0, None
    opt = kw.pop("cls", ZenFlowAdamW)(fast, **HP, **kw)
    _use_transfers(opt, ctx.transfers)
    try:
        for t, gs in enumerate(grads):
            before = [p.detach().clone() for p in twin]
            for p, q, g in zip(fast, twin, gs):
                p.grad, q.grad = g.to(ctx.device), g.to(ctx.device)
            opt.step()
            if mode == "accumulate":
                opts[1].step()
                for s, p in zip(sums, mats):
                    s += p.grad
                if (t + 1) % interval == 0:
                    for s, p in zip(sums, mats):
                        p.grad = s / interval
                        s.zero_()
                    opts[0].step()
            else:
                opts[0].step()
            for p, q, b in zip(fast, twin, before):
                want = b if mode == "delayed" and p.ndim >= 2 else q
                worst = max(worst, _diff(p, want))
                if bad is None and not _close(p, want, tol):
                    bad = t
    finally:
        opt.close()
    return Check("", "pass" if bad is None else "fail",
                 f"{steps} steps, max |diff| {worst:.1e}" +
                 (f"; first mismatch at step {bad}" if bad is not None else ""),
                 measured={"max_abs_diff": worst})


def equivalences(ctx: _Ctx) -> list[Check]:
    cases = [("topk_ratio=1 == AdamW", dict(topk_ratio=1.0, update_interval=3, overlap_step=True,
                                            select_strategy="step", select_interval=5), "same"),
             ("topk_ratio=0, U=1, no overlap == AdamW",
              dict(topk_ratio=0.0, update_interval=1, overlap_step=False), "same"),
             ("topk_ratio=0, U=1, no overlap, 'moments' on the device == AdamW",
              dict(topk_ratio=0.0, update_interval=1, overlap_step=False,
                   deferred_credit="moments", **ALL_ON_DEVICE), "same"),
             ("topk_ratio=0, U=3, no overlap, 'mean' == accumulated AdamW",
              dict(topk_ratio=0.0, update_interval=3, overlap_step=False, deferred_credit="mean"),
              "accumulate"),
             ("topk_ratio=0, U=1, overlap, 'mean' == AdamW one step late",
              dict(topk_ratio=0.0, update_interval=1, overlap_step=True, install_lookahead=0.0,
                   deferred_credit="mean"), "delayed")]
    return [_timed(name, _equivalence, ctx, kw, mode) for name, kw, mode in cases]


def offload(ctx: _Ctx) -> list[Check]:
    c = _equivalence(ctx, dict(cls=OffloadAdamW), "same")
    c.name = "OffloadAdamW == AdamW"
    return [c]


def bf16(ctx: _Ctx, steps: int = 30) -> list[Check]:
    """The same bf16-representable start and gradients in bf16 and in fp32: the fp32 masters agree,
    so the bf16 weights are the fp32 weights rounded (within an ulp), and finite."""
    values = [v.to(torch.bfloat16).float() for v in _values(SHAPES, 3)]
    grads = [[g.to(torch.bfloat16) for g in gs] for gs in _grads(SHAPES, steps, 3)]
    kw = dict(lr=1e-2, topk_ratio=0.3, update_interval=3, full_warm_up_rounds=1,
              overlap_step=True, select_strategy="step", select_interval=6)
    runs = []
    for dtype in (torch.bfloat16, torch.float32):
        params = _params(values, ctx, dtype)
        opt = ZenFlowAdamW(params, **kw)
        _use_transfers(opt, ctx.transfers)
        try:
            for gs in grads:
                for p, g in zip(params, gs):
                    p.grad = g.to(device=ctx.device, dtype=dtype)
                opt.step()
            opt.synchronize()
        finally:
            opt.close()
        runs.append(params)
    finite = all(bool(torch.isfinite(p).all()) for p in runs[0])
    close = all(_close(a, b, _tol(ctx, torch.bfloat16)) for a, b in zip(*runs))
    worst = max(_diff(a, b) for a, b in zip(*runs))
    return [Check("bf16 weights finite and == fp32 run rounded",
                  "pass" if finite and close else "fail",
                  f"{steps} steps, max |bf16 - fp32| {worst:.1e}" + ("" if finite else "; NOT finite"),
                  measured={"max_abs_diff": worst, "finite": finite})]


# ---------------------------------------------------------------------------------- transfers
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
            *(no_syncs_inside_a_window(ctx, sums) for sums in ("host", "device", "bf16 device"))]


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


# ---------------------------------------------------------------------------------- the worker
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _arena_handles() -> tuple[int, int]:
    """(descriptors, mappings) of this process that point at an optimizer's host memory."""
    fds = maps = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += "zenflow-host-state" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        maps = sum("zenflow-host-state" in line for line in f)
    return fds, maps


def _wait_gone(pid: int, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not _alive(pid)


def _train(params, opt, steps: int) -> None:
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()


def worker(ctx: _Ctx) -> list[Check]:
    values = _values([(256, 512), (256,)], 9)
    # Killed in the middle of host work: stopped first, so the kill surely finds work in flight.
    params = _params(values, ctx)
    opt = ZenFlowAdamW(params, topk_ratio=0.25, update_interval=1, overlap_step=True)
    try:
        _train(params, opt, 2)
        opt.synchronize()
        pid = opt._runner.pid
        os.kill(pid, signal.SIGSTOP)
        _train(params, opt, 1)
        opt._pipeline.link.send_all()
        os.kill(pid, signal.SIGKILL)
        start, message = time.monotonic(), ""
        try:
            _train(params, opt, 3)
        except RuntimeError as exc:
            message = str(exc)
        elapsed = time.monotonic() - start
    finally:
        opt.close()
    ok = "SIGKILL" in message and "load_state_dict" in message and elapsed < 5.0
    checks = [Check("killed mid-work: clear error within 5 s", "pass" if ok else "fail",
                    f"error after {elapsed:.2f} s: {message.splitlines()[0] if message else 'none'}",
                    measured={"seconds_to_error": elapsed})]
    # Killed while idle: replaced, training goes on; then close() leaves nothing behind.
    del opt, params
    gc.collect()
    before = _arena_handles()
    params = _params(values, ctx)
    opt = ZenFlowAdamW(params, topk_ratio=0.25, update_interval=1, overlap_step=True)
    level = logging.getLogger("zenflow").level
    logging.getLogger("zenflow").setLevel(logging.ERROR)   # the replacement's warning is expected
    old = new = None
    try:
        _train(params, opt, 2)
        opt.synchronize()
        old = opt._runner.pid
        os.kill(old, signal.SIGKILL)
        _wait_gone(old)
        _train(params, opt, 2)
        new = opt._runner.pid
        detail = f"worker {old} -> {new}"
    except RuntimeError as exc:
        detail = str(exc).splitlines()[0]
    finally:
        logging.getLogger("zenflow").setLevel(level)
        opt.close()
    checks.append(Check("killed idle: replaced, training goes on",
                        "pass" if new not in (None, old) else "fail", detail))
    gone = new is None or _wait_gone(new)
    del opt, params
    gc.collect()
    after = _arena_handles()
    shm = [f for f in os.listdir("/dev/shm") if str(os.getpid()) in f] \
        if os.path.isdir("/dev/shm") else []
    ok = gone and after[0] <= before[0] and after[1] <= before[1] and not shm
    checks.append(Check("close() leaves no process or shared memory", "pass" if ok else "fail",
                        f"worker gone: {gone}; host-memory descriptors/mappings before {before}, "
                        f"after {after}; /dev/shm files of ours: {len(shm)}"))
    return checks
