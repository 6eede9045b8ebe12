"""The worker section of `zenflow selftest`: a killed worker is a clear error within 5 s, an idle
one is replaced, and close() leaves no process, descriptor, mapping or /dev/shm file."""
from __future__ import annotations

import gc
import logging
import os
import signal
import time

import torch

from zenflow.optim.optimizer import ZenFlowAdamW
from zenflow.tools.selftest_checks import Check, _Ctx, _params, _values


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
