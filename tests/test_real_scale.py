"""Real scale: Llama-shaped models, scripts as users write them, gradients as users change them.

The model here has Llama-2-7B's layer count (32 layers of q, k, v, o, gate, up, down, plus the
embedding and the head: 226 matrices) at a narrow width, so it runs in seconds.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

import zenflow
from zenflow.host import arena

from helpers.children import program, run_child, with_root_on_path
from helpers.llama import LLAMA, batch, llama


def train(model, opt, steps: int, micro_batches: int = 1) -> list[float]:
    losses = []
    for t in range(steps):
        x, y = batch(t, 4 * micro_batches)
        for xm, ym in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            loss = model(xm, ym) / micro_batches
            loss.backward()
        losses.append(float(loss.detach()) * micro_batches)
        opt.step()
        opt.zero_grad()
    return losses


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_model_has_llama_2_7b_matrix_count():
    assert sum(p.ndim >= 2 for p in llama().parameters()) == 226 == LLAMA.num_matrices()


@pytest.mark.slow   # the Llama-shaped model (226 matrices)
@pytest.mark.parametrize("make", [
    lambda p: zenflow.OffloadAdamW(p, lr=1e-3, worker=True),
    lambda p: zenflow.ZenFlowAdamW(p, lr=1e-3, topk_ratio=0.0, update_interval=1,
                                   overlap_step=False),
], ids=["offload-worker", "zenflow-topk0"])
def test_llama_shaped_model_through_the_worker_equals_adamw(make):
    model, reference = llama(), llama()
    fds = open_fds()
    opt = make(model.parameters())
    assert open_fds() - fds <= 16, "the optimizer's descriptors must not grow with the model"
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    try:
        train(model, opt, 4)
        train(reference, adamw, 4)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        stats = opt.stats()
        assert stats["host_bytes_per_param"] <= 40
    finally:
        opt.close()


@pytest.mark.slow   # the Llama-shaped model, 24 steps with the worker
def test_llama_shaped_model_trains_with_zenflow_defaults():
    model = llama()
    fds = open_fds()
    with zenflow.ZenFlowAdamW(model.parameters(), lr=3e-3) as opt:
        assert open_fds() - fds <= 16
        losses = train(model, opt, 24)
        opt.synchronize()
        stats = opt.stats()
    assert losses[-1] < losses[0] - 0.3
    assert stats["windows"] >= 5 and stats["skipped_steps"] == 0
    matrices = sum(p.numel() for p in model.parameters() if p.ndim >= 2)
    # every matrix's gradient rows (fp32 here) went to the host each step; nothing else did
    assert stats["d2h_bytes_per_step"] == pytest.approx(4 * matrices)


@pytest.mark.slow   # the Llama-shaped model
def test_bf16_gradients_cross_in_bf16():
    model = llama(dtype=torch.bfloat16)
    with zenflow.ZenFlowAdamW(model.parameters(), lr=1e-3, update_interval=2) as opt:
        train(model, opt, 4)
        stats = opt.stats()
    matrices = sum(p.numel() for p in model.parameters() if p.ndim >= 2)
    assert stats["d2h_bytes_per_step"] == pytest.approx(2 * matrices)
    # two windows ended; with overlap the first is installed (in bf16), the second in flight
    assert stats["windows"] == 2 and stats["h2d_bytes_total"] == 2 * matrices
    # fp32 master + two moments + two sums, and one bf16 staging and install buffer
    assert stats["host_bytes_per_param"] == pytest.approx(5 * 4 + 2 * 2)


@pytest.mark.slow   # a child process training the Llama-shaped model
def test_works_under_ulimit_256():
    result = run_child([sys.executable, str(program("open_files_limit.py"))], timeout=120,
                       env=with_root_on_path())
    assert result.returncode == 0, result.stderr
    assert "trained" in result.stdout


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow   # each case starts two interpreters that import torch
@pytest.mark.parametrize("how", ["file", "stdin", "dash-c"])
def test_a_script_without_a_main_guard_trains_and_leaves_nothing(tmp_path, how):
    # The README's quick start as a user saves it: no __main__ guard, no close().
    script = program("quick_start_no_main_guard.py")
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    if how == "file":
        run = run_child([sys.executable, str(script)], timeout=120, cwd=tmp_path)
    elif how == "stdin":
        run = run_child([sys.executable, "-"], input=script.read_text(), timeout=120, cwd=tmp_path)
    else:
        run = run_child([sys.executable, "-c", script.read_text()], timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    worker, server = (int(x) for x in run.stdout.split("pids")[1].split())
    import time
    deadline = time.monotonic() + 5
    while not (_gone(worker) and _gone(server)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(worker) and _gone(server)
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not {f for f in shm_after - shm_before if str(worker) in f or str(server) in f}


def _mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24),
                               torch.nn.Tanh(), torch.nn.Linear(24, 5)).to(dtype)


def _mlp_batch(step, dtype=torch.float32, size=16):
    g = torch.Generator().manual_seed(step)
    return torch.randn(size, 12, generator=g).to(dtype), torch.randn(size, 5, generator=g).to(dtype)


# No lookahead: a scaled loss's fp16 backward rounds differently from the plain one (the fp32 host
# state differs by ~1e-7), which fp16 weights hide but a lookahead's extra step can show.
ZF = dict(lr=1e-2, topk_ratio=0.25, update_interval=3, overlap_step=True, select_strategy="step",
          select_interval=6, install_lookahead=0.0)


def test_user_clipping_before_step_equals_max_grad_norm():
    inside, outside = _mlp(), _mlp()
    with zenflow.ZenFlowAdamW(inside.parameters(), max_grad_norm=0.5, **ZF) as a, \
            zenflow.ZenFlowAdamW(outside.parameters(), **ZF) as b:
        for t in range(14):
            x, y = _mlp_batch(t)
            torch.nn.functional.mse_loss(inside(x), y).mul(20).backward()
            a.step()
            a.zero_grad()
            torch.nn.functional.mse_loss(outside(x), y).mul(20).backward()
            torch.nn.utils.clip_grad_norm_(outside.parameters(), 0.5)
            b.step()
            b.zero_grad()
        a.synchronize()
        b.synchronize()
    for p, q in zip(inside.parameters(), outside.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_micro_batch_accumulation_equals_one_big_batch():
    big, micro = _mlp(), _mlp()
    with zenflow.ZenFlowAdamW(big.parameters(), **ZF) as a, \
            zenflow.ZenFlowAdamW(micro.parameters(), **ZF) as b:
        for t in range(12):
            x, y = _mlp_batch(t, size=16)
            torch.nn.functional.mse_loss(big(x), y).backward()
            a.step()
            a.zero_grad()
            for xm, ym in zip(x.chunk(4), y.chunk(4)):
                (torch.nn.functional.mse_loss(micro(xm), ym) / 4).backward()
            b.step()
            b.zero_grad()
        a.synchronize()
        b.synchronize()
    for p, q in zip(big.parameters(), micro.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_grad_scaler_with_fp16_parameters():
    """GradScaler hands fp16 gradients to step() still scaled (it refuses to unscale fp16 itself):
    the step must unscale them (bit-identical to an unscaled run, the scale being a power of two),
    and a step whose gradients overflowed must change nothing."""
    scaled, plain = _mlp(dtype=torch.float16), _mlp(dtype=torch.float16)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1000)
    with zenflow.ZenFlowAdamW(scaled.parameters(), **ZF) as a, \
            zenflow.ZenFlowAdamW(plain.parameters(), **ZF) as b:
        for t in range(9):
            x, y = _mlp_batch(t, torch.float16)
            scaler.scale(torch.nn.functional.mse_loss(scaled(x), y)).backward()
            scaler.step(a)
            scaler.update()
            a.zero_grad()
            torch.nn.functional.mse_loss(plain(x), y).backward()
            b.step()
            b.zero_grad()
        steps_before = a.stats()["steps"]
        x, y = _mlp_batch(99, torch.float16)
        scaler.scale(torch.nn.functional.mse_loss(scaled(x), y) * 1e30).backward()  # overflows
        scaler.step(a)
        scaler.update()
        a.zero_grad()
        assert a.stats()["steps"] == steps_before and a.stats()["skipped_steps"] == 1
        a.synchronize()
        b.synchronize()
    for p, q in zip(scaled.parameters(), plain.parameters()):
        assert p.dtype == torch.float16
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_grad_scaler_unscale_then_user_clipping():
    """The usual fp32 recipe: unscale_ in place, clip_grad_norm_, then scaler.step."""
    scaled, plain = _mlp(), _mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    with zenflow.ZenFlowAdamW(scaled.parameters(), **ZF) as a, \
            zenflow.ZenFlowAdamW(plain.parameters(), max_grad_norm=0.3, **ZF) as b:
        for t in range(9):
            x, y = _mlp_batch(t)
            scaler.scale(torch.nn.functional.mse_loss(scaled(x), y)).backward()
            scaler.unscale_(a)
            torch.nn.utils.clip_grad_norm_(scaled.parameters(), 0.3)
            scaler.step(a)
            scaler.update()
            a.zero_grad()
            torch.nn.functional.mse_loss(plain(x), y).backward()
            b.step()
            b.zero_grad()
        a.synchronize()
        b.synchronize()
    for p, q in zip(scaled.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_host_too_small_fails_at_construction_with_the_numbers(monkeypatch):
    model = llama()
    before = copy.deepcopy(model.state_dict())
    monkeypatch.setattr(arena, "available_host_bytes", lambda: 1 << 20)   # 1 MiB free
    children = set(os.listdir(f"/proc/{os.getpid()}/task"))
    with pytest.raises(arena.HostMemoryError, match=r"needs 0\.\d+ GiB .* only 0\.00 GiB") as err:
        zenflow.ZenFlowAdamW(model.parameters())
    message = str(err.value)
    assert "topk_ratio does not help" in message and "--memory" in message
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])
    assert set(os.listdir(f"/proc/{os.getpid()}/task")) == children


def test_frozen_parameters_are_skipped_and_cost_no_host_memory():
    model = _mlp()
    model[0].requires_grad_(False)
    frozen = [p.detach().clone() for p in model[0].parameters()]
    with zenflow.ZenFlowAdamW(model.parameters(), **ZF) as opt:
        for t in range(5):
            x, y = _mlp_batch(t)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        host_numel = sum(p.numel() for p in model.parameters() if p.ndim >= 2 and p.requires_grad)
        # + the staging buffer's 4-byte step factor
        assert opt.stats()["host_bytes"] == pytest.approx(host_numel * (5 * 4 + 2 * 4) + 4)
    for p, q in zip(model[0].parameters(), frozen):
        assert torch.equal(p, q)


@pytest.mark.parametrize("make", [
    lambda p: zenflow.ZenFlowAdamW(p, lr=1e-2, weight_decay=0.0, topk_ratio=0.25,
                                   update_interval=2, overlap_step=True),
    lambda p: zenflow.OffloadAdamW(p, lr=1e-2, weight_decay=0.0),
], ids=["zenflow", "offload"])
def test_weights_loaded_into_the_model_survive_the_next_steps(make):
    """model.load_state_dict after the optimizer exists (with a host update in flight): the
    loaded weights are adopted, never overwritten by stale host masters (torch.optim.AdamW
    keeps them too). At lr=0 they must come out of 5 steps unchanged."""
    model = _mlp()
    with make(model.parameters()) as opt:
        for t in range(3):   # ends a window: an update is in flight
            x, y = _mlp_batch(t)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        loaded = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
        model.load_state_dict(loaded)
        for group in opt.param_groups:
            group["lr"] = 0.0
        for t in range(5):
            x, y = _mlp_batch(10 + t)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        for name, value in model.state_dict().items():
            assert torch.equal(value, loaded[name]), name
        # and the optimizer's own masters follow them
        state = opt.state_dict()["state"]
        assert torch.equal(state[0]["host"]["master"], loaded["0.weight"])


def test_a_worker_that_dies_idle_is_replaced_and_nothing_is_lost():
    import signal
    import time
    model, reference = _mlp(), _mlp()
    with zenflow.ZenFlowAdamW(model.parameters(), **ZF) as opt, \
            zenflow.ZenFlowAdamW(reference.parameters(), worker=False, **ZF) as ref:
        for t in range(8):
            if t == 4:
                opt._pipeline.drain()          # idle: everything sent is done
                os.kill(opt._runner.pid, signal.SIGKILL)
                time.sleep(0.5)
            for m, o in ((model, opt), (reference, ref)):
                x, y = _mlp_batch(t)
                torch.nn.functional.mse_loss(m(x), y).backward()
                o.step()
                o.zero_grad()
        opt.synchronize()
        ref.synchronize()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_the_worker_survives_sigterm_to_the_process_group():
    import signal
    import time
    model = _mlp()
    with zenflow.ZenFlowAdamW(model.parameters(), **ZF) as opt:
        x, y = _mlp_batch(0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        os.kill(opt._runner.pid, signal.SIGTERM)
        os.kill(opt._runner.pid, signal.SIGINT)
        time.sleep(0.3)
        state = opt.state_dict()      # the usual preemption handler: save on SIGTERM
        assert state["zenflow"]["step"] == 1
        opt.step()                     # and it goes on
        assert opt._runner.pid and _gone(opt._runner.pid) is False


def test_a_worker_that_dies_mid_update_names_the_torn_state_and_rolls_back():
    import signal
    import threading
    import time
    model = _mlp()
    with zenflow.ZenFlowAdamW(model.parameters(), **ZF) as opt:
        for t in range(3):
            x, y = _mlp_batch(t)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        saved_opt, saved_model = opt.state_dict(), copy.deepcopy(model.state_dict())
        pid = opt._runner.pid
        os.kill(pid, signal.SIGSTOP)        # it cannot finish what it is sent next ...
        threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()   # ... and then dies
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"SIGKILL.*\n.*half-written"):
            for t in range(3, 9):
                x, y = _mlp_batch(t)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        assert time.monotonic() - start < 6
        with pytest.raises(RuntimeError, match="half-written"):
            opt.state_dict()
        model.load_state_dict(saved_model)
        opt.load_state_dict(saved_opt)                 # the roll-back: a new worker starts
        for t in range(3, 6):
            x, y = _mlp_batch(t)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert opt.state_dict()["zenflow"]["step"] == 6


@pytest.mark.slow   # a training subprocess
def test_sigterm_to_the_process_group_saves_a_checkpoint_that_resumes_exactly(tmp_path):
    import signal
    path = tmp_path / "preempted.pt"
    child = subprocess.Popen([sys.executable, str(program("preempted_training.py")), str(path)],
                             stdout=subprocess.PIPE, text=True, start_new_session=True,
                             env=with_root_on_path())
    try:
        assert child.stdout.readline().strip() == "ready"
        os.killpg(child.pid, signal.SIGTERM)      # the scheduler signals the whole job
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
    saved = torch.load(path, weights_only=True)
    assert saved["step"] == 7

    def batch(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(16, 12, generator=g), torch.randn(16, 5, generator=g)

    def fresh():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(),
                                   torch.nn.Linear(24, 5))

    settings = dict(lr=1e-2, topk_ratio=0.25, update_interval=3)
    straight, resumed = fresh(), fresh()
    with zenflow.ZenFlowAdamW(straight.parameters(), **settings) as a, \
            zenflow.ZenFlowAdamW(resumed.parameters(), **settings) as b:
        resumed.load_state_dict(saved["model"])
        b.load_state_dict(saved["opt"])
        for step in range(12):
            x, y = batch(step)
            torch.nn.functional.mse_loss(straight(x), y).backward()
            a.step()
            a.zero_grad()
            if step >= 7:
                torch.nn.functional.mse_loss(resumed(x), y).backward()
                b.step()
                b.zero_grad()
        a.synchronize()
        b.synchronize()
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


@pytest.mark.slow   # 21 workers started
def test_optimizers_dropped_without_close_leak_no_descriptor():
    import gc
    model = _mlp()
    ZenFlow = zenflow.ZenFlowAdamW
    ZenFlow(model.parameters(), worker=True).close()   # the fork server is up
    gc.collect()
    fds = open_fds()
    for _ in range(20):
        opt = ZenFlow(model.parameters(), worker=True)
        del opt
        gc.collect()
    assert open_fds() <= fds + 1
