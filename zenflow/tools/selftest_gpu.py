"""The selftest sections that a GPU run needs (`make gpu-check` runs them with the others):

    model       a real model (the project's GPT, Llama-shaped) trained with attach(), the worker,
                the backward's early copies and real side streams: its weights equal
                zenflow.optim.reference fed the same gradients, step for step, for window sums on
                the host ("mean") and on the device ("moments"); at topk_ratio=1 they equal
                torch.optim.AdamW's
    closure     step(closure) with activation checkpointing (reentrant and not) and attach(), in
                a child process with a deadline: on CUDA the recomputed forward's hooks run on
                autograd's device thread, where they once waited forever for the optimizer
    speed       step time and peak device memory against torch.optim.AdamW(fused=True), bf16
                weights, a 1.3B Llama shape on a GPU (a tiny one elsewhere), in the order
                AdamW, ZenFlowAdamW, AdamW
    pagelocks   a registration the driver refuses is warned about and cleared (a kernel launched
                next does not fail with it), and an optimizer dropped without close() unlocks
    compiled    (zenflow/tools/selftest_compiled.py) deferred_credit="factored"'s step and an
                install's correction compiled for the device against the same functions run
                eagerly

On a CPU "device" they run too, at small sizes (the dry run the test suite holds), except what
only a GPU has (page-locking).
"""
from __future__ import annotations

import gc
import logging
import os
import statistics
import subprocess
import sys
import time

import torch

from zenflow.optim.optimizer import ZenFlowAdamW
from zenflow.optim.reference import ReferenceZenFlow
from zenflow.tools.selftest_checks import Check, _Ctx, _diff, _tol

CLOSURE_DEADLINE_S = 180.0   # the child imports torch and trains a few steps: seconds, normally


def _gpt(ctx: _Ctx, large: bool, dtype=torch.float32):
    from zenflow.tools.bench.model import GPT, GPTConfig
    cfg = (GPTConfig(arch="llama", n_layer=24, n_embd=2048, n_head=16, ffn=5504,
                     vocab_size=32000, seq_len=512) if large else
           GPTConfig(arch="llama", n_layer=2, n_embd=64, n_head=4, ffn=160, vocab_size=128,
                     seq_len=16))
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = GPT(cfg).to(dtype)
    return model, cfg


def _batch(cfg, step: int, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


# ------------------------------------------------------------------------------------- model
def _model_against_reference(ctx: _Ctx, credit: str, steps: int = 12) -> Check:
    """ZenFlowAdamW through a real model, with attach() and the worker (on CUDA: side streams
    and the backward's early copies), against the reference fed the gradients it saw."""
    model, cfg = _gpt(ctx, large=False)
    placement = dict(device_sum_budget=0) if credit == "mean" else dict(device_sum_budget=1 << 50)
    # Unclipped: a real model's gradients of a column can cancel over a window (a mean of 1e-9
    # from terms of 5e-4), where AdamW's step, mean / (|mean| + eps), hangs on the last bits of
    # each term, and a clipping factor rounded apart moves it by 1e-3 of a step on one side or
    # the other of the exact value; the synthetic checks (correctness) cover clipping.
    settings = dict(lr=1e-2, topk_ratio=0.25, update_interval=2, overlap_step=True,
                    deferred_credit=credit)
    opt = ZenFlowAdamW(model.parameters(), select_strategy="step", select_interval=4,
                       **placement, **settings)
    opt.attach(model)
    ref_params = [p.detach().to("cpu", torch.float32, copy=True) for p in model.parameters()]
    ref = ReferenceZenFlow(ref_params, select_interval=4, **settings)
    tol, worst, bad = _tol(ctx), 0.0, None
    try:
        for t in range(steps):
            x, y = _batch(cfg, t, 4, ctx.device)
            model(x, y).backward()
            grads = [p.grad.detach().to("cpu", torch.float32, copy=True)
                     for p in model.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
            ref.step(grads, reselect=(t, "reselect") in opt.decisions)
            opt.wait_for_install()
            for p, q in zip(model.parameters(), ref_params):
                worst = max(worst, _diff(p, q))
                if bad is None and not torch.allclose(p.detach().cpu(), q, **tol):
                    bad = t
        stats = opt.stats()
    finally:
        opt.close()
    early = stats["early_copies"]
    status = "pass" if bad is None and (early > 0 or credit != "mean" or not ctx.cuda) else "fail"
    detail = (f"{steps} steps, {stats['windows']} windows, max |diff| {worst:.1e}; early copies "
              f"{early}, late {stats['late_copies']}"
              + (f"; first mismatch at step {bad}" if bad is not None else "")
              + ("; NO early copy on CUDA" if status == "fail" and bad is None else ""))
    return Check("", status, detail, measured={"max_abs_diff": worst, **{
        k: stats[k] for k in ("early_copies", "late_copies", "windows", "device_sum_matrices")}})


def _model_topk_one_against_adamw(ctx: _Ctx, steps: int = 8) -> Check:
    model, cfg = _gpt(ctx, large=False)
    twin, _ = _gpt(ctx, large=False)
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    opt = ZenFlowAdamW(model.parameters(), **hp, topk_ratio=1.0, update_interval=3)
    opt.attach(model)
    adamw = torch.optim.AdamW(twin.parameters(), **hp)
    tol, worst, bad = _tol(ctx), 0.0, None
    try:
        for t in range(steps):
            for m, o in ((model, opt), (twin, adamw)):
                x, y = _batch(cfg, t, 4, ctx.device)
                m(x, y).backward()
                o.step()
                o.zero_grad(set_to_none=True)
            for p, q in zip(model.parameters(), twin.parameters()):
                worst = max(worst, _diff(p, q))
                if bad is None and not torch.allclose(p, q, **tol):
                    bad = t
    finally:
        opt.close()
    return Check("", "pass" if bad is None else "fail",
                 f"{steps} steps, max |diff| {worst:.1e}"
                 + (f"; first mismatch at step {bad}" if bad is not None else ""),
                 measured={"max_abs_diff": worst})


def model(ctx: _Ctx) -> list[Check]:
    out = []
    for name, run in (("GPT with attach, host sums ('mean') == reference",
                       lambda: _model_against_reference(ctx, "mean")),
                      ("GPT with attach, device sums ('moments') == reference",
                       lambda: _model_against_reference(ctx, "moments")),
                      ("GPT with attach, topk_ratio=1 == torch.optim.AdamW",
                       lambda: _model_topk_one_against_adamw(ctx))):
        start = time.perf_counter()
        check = run()
        check.name, check.seconds = name, time.perf_counter() - start
        out.append(check)
    return out


# ----------------------------------------------------------------------------------- closure
def closure(ctx: _Ctx) -> list[Check]:
    """The child (zenflow/tools/selftest_closure.py) in its own process: a hang there ends at
    the deadline as a failed check, never as a hung selftest."""
    command = [sys.executable, "-m", "zenflow.tools.selftest_closure", "--device", str(ctx.device)]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CLOSURE_DEADLINE_S,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-400:]
        return [Check("step(closure) with checkpointing and attach", "fail",
                      f"no answer within {CLOSURE_DEADLINE_S:.0f} s: a hook waits for the "
                      f"optimizer (last output: {tail!r})")]
    seconds = time.perf_counter() - start
    ok = done.returncode == 0 and "closure-ok" in done.stdout
    return [Check("step(closure) with checkpointing and attach", "pass" if ok else "fail",
                  done.stdout.strip().splitlines()[-1] if ok else
                  f"exit {done.returncode}: {(done.stdout + done.stderr)[-600:]}",
                  seconds=seconds)]


# ------------------------------------------------------------------------------------- speed
def _phase(ctx: _Ctx, system: str, large: bool, steps: int, warmup: int,
           settings: dict | None = None) -> dict:
    """`steps` timed training steps of `system` ("adamw", or "zenflow" with `settings`) on a
    fresh bf16 model: their median wall time (the device finished each), the peak device memory,
    and ZenFlowAdamW's stats."""
    if ctx.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    model, cfg = _gpt(ctx, large, torch.bfloat16)
    if system == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    else:
        opt = ZenFlowAdamW(model.parameters(), lr=1e-5, **(settings or {}))
        opt.attach(model)
    batch = 4 if large else 2
    times = []
    try:
        for t in range(warmup + steps):
            x, y = _batch(cfg, t, batch, ctx.device)
            _finished(ctx)
            start = time.perf_counter()
            model(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _finished(ctx)
            if t >= warmup:
                times.append(time.perf_counter() - start)
        out = {"median_step_s": statistics.median(times), "steps": steps,
               "params": sum(p.numel() for p in model.parameters())}
        if ctx.cuda:
            out["peak_memory_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
        if system == "zenflow":
            stats = opt.stats()
            out.update({k: stats[k] for k in (
                "windows", "last_window_steps", "early_copies", "late_copies", "pinned_bytes",
                "device_sum_matrices", "device_sum_bytes", "host_bytes", "last_install_wait_s")})
    finally:
        if system == "zenflow":
            opt.close()
        del model, opt
        gc.collect()
    return out


def _finished(ctx: _Ctx) -> None:
    if ctx.cuda:
        torch.cuda.synchronize(ctx.device)


# The defaults, and the configuration `zenflow estimate` calls fastest on one GPU.
ZENFLOW_CONFIGS = {"defaults": {},
                   "mean, bf16 sums": dict(deferred_credit="mean", device_sum_dtype="bfloat16")}


def speed(ctx: _Ctx) -> list[Check]:
    large = ctx.cuda
    steps, warmup = (20, 4) if large else (4, 1)
    start = time.perf_counter()
    first = _phase(ctx, "adamw", large, steps, warmup)
    zen = {name: _phase(ctx, "zenflow", large, steps, warmup, settings)
           for name, settings in ZENFLOW_CONFIGS.items()}
    last = _phase(ctx, "adamw", large, steps, warmup)
    adamw_s = (first["median_step_s"] + last["median_step_s"]) / 2
    ratios = {name: z["median_step_s"] / adamw_s for name, z in zen.items()}

    def shown(name: str) -> str:
        z = zen[name]
        memory = f", {z['peak_memory_bytes'] / 2**30:.1f} GiB" if ctx.cuda else ""
        return (f"ZenFlowAdamW ({name}) {z['median_step_s'] * 1e3:.1f} ms = {ratios[name]:.2f}x"
                f"{memory}, {z['windows']} windows")
    memory = f", {first['peak_memory_bytes'] / 2**30:.1f} GiB" if ctx.cuda else ""
    return [Check("step time against torch.optim.AdamW(fused=True)", "pass",
                  f"{first['params'] / 1e9:.2f}B params, bf16, peak device memory after each: "
                  f"AdamW {first['median_step_s'] * 1e3:.1f} / {last['median_step_s'] * 1e3:.1f}"
                  f" ms (before / after){memory}; " + "; ".join(shown(n) for n in zen),
                  seconds=time.perf_counter() - start,
                  measured={"adamw_first": first, "adamw_last": last, "zenflow": zen,
                            "zenflow_over_adamw": ratios})]


# --------------------------------------------------------------------------------- pagelocks
class _Unmapped:
    """A host "tensor" at an address nothing is mapped at: the driver refuses to lock it."""

    def data_ptr(self) -> int:
        return 4096

    def numel(self) -> int:
        return 1024

    def element_size(self) -> int:
        return 4

    def is_pinned(self) -> bool:
        return False


def pagelocks(ctx: _Ctx) -> list[Check]:
    if not ctx.cuda:
        return [Check("a refused page-lock is reported and cleared", "skip",
                      "n/a on CPU: nothing is page-locked")]
    from zenflow.host import page_locks
    out = []
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("zenflow")
    logger.addHandler(handler)
    try:
        locks = page_locks.PageLocks(ctx.device)
        error = None
        locks.lock([_Unmapped()])
        try:   # a kernel launch checks the runtime's last error: it must not find the refusal
            torch.ones(8, device=ctx.device).add_(1)
            torch.cuda.synchronize(ctx.device)
        except RuntimeError as exc:
            error = exc
        warned = any("page-locking 1 host buffer" in r.getMessage() for r in records)
        how = ("libcudart's cudaGetLastError" if page_locks._loaded_cudart() is not None
               else "a launch check")
        ok = error is None and warned and locks.nbytes == 0
        out.append(Check("a refused page-lock is reported and cleared", "pass" if ok else "fail",
                         f"cleared through {how}; warned: {warned}"
                         + ("" if error is None else f"; the next kernel failed: {error}")))
        buffer = torch.empty(1 << 20)
        locks = page_locks.PageLocks(ctx.device)
        locks.lock([buffer])
        locked = buffer.is_pinned()
        del locks
        gc.collect()
        out.append(Check("page-locks dropped without close() are released",
                         "pass" if locked and not buffer.is_pinned() else "fail",
                         f"locked: {locked}, after the drop: {buffer.is_pinned()}"))
    finally:
        logger.removeHandler(handler)
    return out
