"""The asynchronous host worker: overlap semantics, checkpoints, lifecycle and failure.

Every ZenFlowAdamW here runs its host updates in a real worker process (the default).
"""
from __future__ import annotations

import copy
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import zenflow
from zenflow.host.buffers import HostState
from zenflow.host.commands import Update
from zenflow.host.cores import split_cores
from zenflow.host.layout import HostJob, HostLayout, HostUpdate
from zenflow.host.worker import WorkerHostRunner
from zenflow.optim.reference import ReferenceZenFlow

from helpers.children import program, sigint_as_in_a_terminal, with_root_on_path


def _model(seed: int, bias: bool = True) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16, bias=bias), torch.nn.Tanh(),
                               torch.nn.Linear(16, 10, bias=bias), torch.nn.Linear(10, 6, bias=bias))


def _grads(model, steps: int, seed: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen) * (1 + 3 * torch.rand(p.shape[-1:], generator=gen))
             for p in model.parameters()] for _ in range(steps)]


def _set_grads(model, grads) -> None:
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, dead but not yet reaped by its new parent, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _shm_files(*pids: int) -> set[str]:
    """Shared-memory files named after one of `pids` (torch and Python name them so); other jobs
    on the machine may create their own files meanwhile."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {f for f in os.listdir("/dev/shm") if any(f"_{pid}_" in f"_{f}_" or f"_{pid}_" in f
                                                      for pid in pids)}


@pytest.mark.parametrize("seed", [0, 1])
def test_overlap_with_worker_matches_reference(seed):
    rng = random.Random(seed)
    settings = dict(lr=rng.choice([1e-2, 3e-3]), weight_decay=rng.choice([0.0, 0.05]),
                    topk_ratio=rng.choice([0.2, 0.5]), update_interval=rng.choice([1, 2, 3]),
                    full_warm_up_rounds=rng.choice([0, 2]),
                    max_grad_norm=rng.choice([None, 5.0]))
    select_interval = rng.choice([3, 5])
    fast_model, ref_model = _model(seed), _model(seed)
    opt = zenflow.ZenFlowAdamW(fast_model.parameters(), select_strategy="step",
                               select_interval=select_interval, overlap_step=True, **settings)
    ref = ReferenceZenFlow(list(ref_model.parameters()), overlap_step=True, **settings)
    assert isinstance(opt._runner, WorkerHostRunner)
    try:
        for t, grads in enumerate(_grads(fast_model, 14, seed)):
            lr = settings["lr"] * (1 - 0.03 * t)   # a schedule: the host must see the group's lr
            opt.param_groups[0]["lr"] = lr
            _set_grads(fast_model, grads)
            opt.step()
            # select_interval counts steps: a reselection cuts the window before it short
            reselect = (t, "reselect") in opt.decisions
            ref.step(grads, lr=lr, reselect=reselect, flush=(t, "flush") in opt.decisions)
            for p, q in zip(fast_model.parameters(), ref_model.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"step {t} {settings}")
        assert opt.stats()["host_busy_s"] > 0
    finally:
        opt.close()


def test_topk0_interval1_overlap_is_one_step_delayed_adamw():
    model, ref_model = _model(3), _model(3)
    opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, topk_ratio=0.0,
                               update_interval=1, overlap_step=True, install_lookahead=0.0)
    adamw = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    previous = [p.detach().clone() for p in ref_model.parameters()]
    with opt:
        for t, grads in enumerate(_grads(model, 8, 3)):
            _set_grads(model, grads)
            opt.step()
            _set_grads(ref_model, grads)
            adamw.step()
            for p, before, now in zip(model.parameters(), previous, ref_model.parameters()):
                # matrices show the update one step late; vectors are updated on the device at once
                torch.testing.assert_close(p, before if p.ndim >= 2 else now, rtol=1e-6,
                                           atol=1e-7, msg=f"step {t}")
            previous = [p.detach().clone() for p in ref_model.parameters()]


def test_state_dict_round_trip_in_overlap_mode_is_bit_exact():
    settings = dict(lr=1e-2, topk_ratio=0.25, update_interval=3, select_strategy="step",
                    select_interval=9, overlap_step=True)
    grads = _grads(_model(5), 13, 5)
    model = _model(5)
    with zenflow.ZenFlowAdamW(model.parameters(), **settings) as opt:
        for g in grads:
            _set_grads(model, g)
            opt.step()
        expected = [p.detach().clone() for p in model.parameters()]

    model = _model(5)
    with zenflow.ZenFlowAdamW(model.parameters(), **settings) as opt:
        for g in grads[:7]:   # stops mid-window with an update in flight
            _set_grads(model, g)
            opt.step()
        assert opt._pipeline.in_flight is not None
        saved_opt = copy.deepcopy(opt.state_dict())
        saved_model = copy.deepcopy(model.state_dict())

    model = _model(99)
    model.load_state_dict(saved_model)
    with zenflow.ZenFlowAdamW(model.parameters(), **settings) as opt:
        opt.load_state_dict(saved_opt)
        for g in grads[7:]:
            _set_grads(model, g)
            opt.step()
        resumed = [p.detach().clone() for p in model.parameters()]   # as `expected`: before
        # close() installs the update in flight
    for p, q in zip(resumed, expected):
        assert torch.equal(p, q)


def test_worker_reports_readiness_and_update_time_to_the_auto_window():
    """update_interval="auto" avoids stalls by asking whether the worker is still busy and how
    long an update takes: both must come from the real worker."""
    model = _model(0)
    opt = zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval=1)
    runner, pipeline = opt._runner, opt._pipeline
    assert pipeline.ready() and runner.last_update_seconds == 0.0
    for g in _grads(model, 3, 0):
        _set_grads(model, g)
        opt.step()
    deadline = time.monotonic() + 5
    while not pipeline.ready() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pipeline.ready()
    assert runner.last_update_seconds > 0.0
    opt.close()


def test_garbage_collection_stops_the_worker():
    import gc
    model = _model(0)
    opt = zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval=1)
    for g in _grads(model, 2, 0):
        _set_grads(model, g)
        opt.step()
    pid = opt._runner.pid
    del opt
    gc.collect()
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_a_wrapper_sharing_the_optimizers_dict_does_not_stop_its_worker():
    """Lightning's LightningOptimizer copies the optimizer's __dict__; dropping it must not
    close the worker the real optimizer still uses."""
    import gc
    model = _model(0)
    opt = zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval=1)
    wrapper = object.__new__(type("Wrapper", (type(opt),), {}))
    wrapper.__dict__ = opt.__dict__
    del wrapper
    gc.collect()
    for g in _grads(model, 3, 0):
        _set_grads(model, g)
        opt.step()
    assert _alive(opt._runner.pid)
    opt.close()


def test_close_stops_the_worker_and_leaves_no_shared_memory():
    model = _model(0)
    opt = zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval=1)
    for g in _grads(model, 2, 0):
        _set_grads(model, g)
        opt.step()
    pid = opt._runner.pid
    time.sleep(1.5)   # an idle worker stays up (it checks on its parent about once a second)
    assert _alive(pid)
    opt.close()
    opt.close()  # idempotent
    assert not _alive(pid)
    assert not _shm_files(os.getpid(), pid)
    with pytest.raises(RuntimeError, match="after close"):
        opt.step()


@pytest.mark.slow   # each case starts two interpreters that import torch
@pytest.mark.parametrize("how", ["exit", "sigkill", "sigint"])
def test_no_worker_survives_its_parent(how):
    child = subprocess.Popen([sys.executable, str(program("worker_parent.py")),
                              "exit" if how == "exit" else "hang"], stdout=subprocess.PIPE,
                             text=True, preexec_fn=sigint_as_in_a_terminal, env=with_root_on_path())
    try:
        worker_pid = int(child.stdout.readline())
        if how == "sigkill":
            child.kill()
        elif how == "sigint":
            child.send_signal(signal.SIGINT)   # Ctrl-C
        child.wait(timeout=30)
        deadline = time.monotonic() + 5
        while _alive(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker_pid), f"worker {worker_pid} outlived its parent ({how})"
        assert not _shm_files(child.pid, worker_pid)
    finally:
        if child.poll() is None:
            child.kill()


def test_killed_worker_fails_the_next_step_quickly():
    model = _model(1)
    with zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval=2) as opt:
        grads = _grads(model, 4, 1)
        for g in grads[:2]:
            _set_grads(model, g)
            opt.step()
        # A worker that dies idle is replaced (another test); stopped first, this one is sure
        # to die with work it was sent unfinished, however fast it would have been.
        pid = opt._runner.pid
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
        _set_grads(model, grads[2])
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="SIGKILL"):
            opt.step()
            opt.step()   # even if the death went unnoticed for one step, the window end sees it
        assert time.monotonic() - start < 5


def test_worker_exception_is_reported_with_its_traceback():
    host = HostState.allocate(HostLayout.build([(3, 4, torch.float32)], sum_slots=1))
    runner = WorkerHostRunner(host, cores=None)
    try:
        runner.send(Update(0, (HostJob(0, 1, 1, HostUpdate(1e-3, 0.9, 0.999, 1e-8, 0.0)),)))
        assert runner.wait() >= 0.0
        runner.send(Update(0, (HostJob(7, 1, 1, HostUpdate(1e-3, 0.9, 0.999, 1e-8, 0.0)),)))  # none
        with pytest.raises(RuntimeError, match="IndexError"):
            runner.wait()
        with pytest.raises(RuntimeError):   # and it stays failed
            runner.check()
    finally:
        runner.close()
    assert not _alive(runner.pid)


def test_split_cores():
    fake = [1000, 1001, 1002, 1003]   # no /sys topology: each CPU is its own core
    assert split_cores(0.5, fake[:2]) == ([1000], [1001])
    assert split_cores(0.5, fake) == ([1000, 1001], [1002, 1003])
    assert split_cores(0.0, fake) == ([1000], [1001, 1002, 1003])   # training keeps one
    assert split_cores(1.0, fake) == ([1000, 1001, 1002], [1003])   # worker keeps one
    assert split_cores(0.5, [1000]) == ([1000], [1000])             # one CPU: shared
    training, worker = split_cores(0.5)
    assert set(training) | set(worker) == set(os.sched_getaffinity(0))
    if len(os.sched_getaffinity(0)) > 1:
        assert not set(training) & set(worker)


def test_worker_false_runs_inline():
    model = _model(2)
    opt = zenflow.ZenFlowAdamW(model.parameters(), worker=False)
    assert not isinstance(opt._runner, WorkerHostRunner)
    with pytest.raises(TypeError, match="worker"):
        zenflow.ZenFlowAdamW(model.parameters(), worker="yes")


def test_ranks_on_one_machine_get_whole_physical_cores(monkeypatch):
    from zenflow.host import cores
    # 4 physical cores, each with its hyperthread sibling numbered +4 (as Linux numbers them)
    monkeypatch.setattr(cores, "_physical_cores",
                        lambda cpus: [[c, c + 4] for c in range(4) if c in cpus])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    shares = []
    for rank in (0, 1):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        shares.append(cores.local_rank_share(list(range(8))))
    assert shares == [[0, 4, 1, 5], [2, 6, 3, 7]]
