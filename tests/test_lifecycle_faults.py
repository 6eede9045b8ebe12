"""The worker's life belongs to the process that made it, its bookkeeping survives Ctrl-C, every
wait has a deadline, and nothing outlives a dropped optimizer (issue 24)."""
from __future__ import annotations

import copy
import gc
import os
import signal
import subprocess
import sys
import sysconfig
import threading

import pytest
import torch

import zenflow
from zenflow.host import forkserver, worker

from helpers.children import program, run_child


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def _train(model, opt, steps):
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()


def _run_script(name: str, *args: str, executable=sys.executable, timeout=240, **kw):
    """tests/programs/NAME run as a script (`python PATH ARGS`)."""
    return run_child([executable, str(program(name)), *args], timeout=timeout, **kw)


def _in_thread(fn, timeout: float):
    """fn() on a daemon thread; its exception, or "hung" if it did not return in time."""
    result = []

    def run():
        try:
            fn()
            result.append(None)
        except BaseException as exc:
            result.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0] if result else "hung"


@pytest.mark.slow   # a child process
def test_forked_child_exiting_leaves_the_parents_worker_alone(tmp_path):
    """A child forked from the training process that exits through sys.exit (atexit hooks and
    collection run) must not close the parent's worker (item 6)."""
    out = _run_script("forked_child_exits.py")
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr
    assert "started a new worker" not in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.slow
def test_five_thousand_matrices_train_from_a_guardless_script(tmp_path):
    """An MoE-shaped model (5,000 tiny experts) starts its worker: the start-up data does not
    travel in the size-limited control message (item 8). No __main__ guard in the script."""
    out = _run_script("five_thousand_matrices.py")
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr


@pytest.mark.slow
def test_zenflow_importable_only_through_sys_path(tmp_path):
    """A vendored zenflow (found only through sys.path.append) starts its worker (item 11). The
    script runs in a virtualenv that sees torch but has no zenflow installed."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    torch_dir = os.path.dirname(os.path.dirname(torch.__file__))
    # A .pth line adds the directory, but not the editable zenflow finder installed in it.
    with open(os.path.join(site, "torch_only.pth"), "w") as f:
        f.write(torch_dir + "\n")
    vendor = tmp_path / "vendor"
    package = os.path.dirname(zenflow.__file__)
    subprocess.run(["cp", "-r", package, str(vendor / "zenflow")] if vendor.mkdir() is None
                   else [], check=True)
    out = _run_script("vendored_zenflow.py", str(vendor), executable=str(venv / "bin" / "python"),
                      cwd=str(tmp_path),
                      env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr
    assert sysconfig  # the venv's layout came from its own sysconfig


class _InterruptAfter:
    """A connection whose send() or recv() delivers a real SIGINT right after doing its work:
    a Ctrl-C landing between that line and the runner's bookkeeping."""

    def __init__(self, conn, method: str):
        self._conn, self._method, self.armed = conn, method, True

    def __getattr__(self, name):
        return getattr(self._conn, name)

    def _maybe_interrupt(self):
        if self.armed:
            self.armed = False
            os.kill(os.getpid(), signal.SIGINT)

    def send(self, obj):
        self._conn.send(obj)
        if self._method == "send":
            self._maybe_interrupt()

    def recv(self):
        message = self._conn.recv()
        if self._method == "recv":
            self._maybe_interrupt()
        return message


@pytest.mark.parametrize("method", ["send", "recv"])
def test_ctrl_c_inside_worker_bookkeeping_then_save(method, ctrl_c_raises):
    """Ctrl-C between a message and its bookkeeping: the next state_dict() and steps do not hang
    (item 10), and the KeyboardInterrupt still reaches the caller."""
    model = _model()
    opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2)
    try:
        _train(model, opt, 3)
        runner = opt._runner
        real = runner._conn
        runner._conn = _InterruptAfter(real, method)
        with pytest.raises(KeyboardInterrupt):
            for _ in range(20):
                _train(model, opt, 1)
                opt.synchronize()
        runner._conn = real
        assert _in_thread(opt.state_dict, 30) is None
        assert _in_thread(lambda: (_train(model, opt, 4), opt.synchronize()), 30) is None
    finally:
        opt.close()


@pytest.mark.slow   # waits out a deadline
def test_stopped_worker_is_an_error_naming_it(monkeypatch):
    """A stopped worker makes synchronize() fail after the deadline, saying it is stopped and how
    long it waited, instead of blocking forever (item 10)."""
    monkeypatch.setattr(worker, "_WAIT_TIMEOUT_S", 1.5, raising=False)
    model = _model()
    opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=1)
    pid = opt._runner.pid
    try:
        _train(model, opt, 2)
        opt.synchronize()
        os.kill(pid, signal.SIGSTOP)
        outcome = _in_thread(lambda: (_train(model, opt, 2), opt.synchronize()), 20)
        assert isinstance(outcome, RuntimeError), outcome
        assert f"pid {pid}" in str(outcome) and "stopped" in str(outcome), outcome
        assert "no progress for" in str(outcome)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass   # the stuck worker was stopped for good
        opt.close()


@pytest.mark.slow   # waits out a deadline
def test_stopped_fork_server_is_a_clear_error(monkeypatch, capfd):
    """A stopped fork server fails the optimizer's construction with an error naming it, no
    BrokenPipe traceback, and the next optimizer gets a new server (item 10)."""
    server = forkserver._ForkServer.get()
    with zenflow.ZenFlowAdamW(_model().parameters(), topk_ratio=0.25):
        pass   # the server is up and has forked once
    monkeypatch.setattr(forkserver, "_FORK_TIMEOUT_S", 1.0, raising=False)
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        outcome = _in_thread(lambda: zenflow.ZenFlowAdamW(_model().parameters(),
                                                          topk_ratio=0.25).close(), 30)
    finally:
        if server.process.poll() is None:
            os.kill(server.process.pid, signal.SIGCONT)
    monkeypatch.undo()
    assert isinstance(outcome, RuntimeError), outcome
    assert f"worker server (pid {server.process.pid})" in str(outcome), outcome
    assert "did not start a worker" in str(outcome) and "SIGSTOP" in str(outcome), outcome
    with zenflow.ZenFlowAdamW(_model().parameters(), topk_ratio=0.25) as opt:
        assert opt._runner.pid > 0
    assert "BrokenPipe" not in capfd.readouterr().err


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _arena_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum("zenflow-host-state" in line for line in f)


def _copy_threads() -> int:
    return sum(t.name == "zenflow-copy" for t in threading.enumerate())


def test_dropped_optimizer_leaks_nothing():
    """Optimizers dropped without close() leave no copy thread, descriptor or mapping (item 14)."""
    def drop_one():
        model = _model()
        opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25,
                                   update_interval=2)
        _train(model, opt, 3)

    def settled(expected=None) -> tuple[int, int, int]:
        """What is open once nothing of a dropped optimizer is left (`expected`, or no mapping,
        no copy thread and a steady count of descriptors): its copy thread sees its stop, and
        its last views' mapping and its worker's pipe go a moment after collection (another
        thread may drop the last reference: measured up to a few ms). A leak never settles."""
        gc.collect()
        last = None
        for _ in range(50):
            now = _open_fds(), _arena_mappings(), _copy_threads()
            if now == expected or (expected is None and now[1:] == (0, 0) and now == last):
                break
            last = now
            threading.Event().wait(0.05)
        return now

    drop_one()
    before = settled()
    assert before[1:] == (0, 0)
    for _ in range(6):
        drop_one()
    assert settled(before) == before


def test_a_dropped_links_finalizer_run_under_its_own_lock_returns():
    """The collector may finalize a dropped optimizer's worker link on its dispatch thread while
    that thread holds the link's lock (an allocation while it sends a command): the finalizer,
    which stops that thread, must not wait for the lock its own thread holds."""
    model = _model()
    opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2)
    _train(model, opt, 3)
    link = opt._pipeline.link

    def finalize_under_the_lock():
        with link._outbox.lock:
            link._stop()   # the weakref.finalize the collector would call
    result = _in_thread(finalize_under_the_lock, timeout=20)
    if result == "hung":   # the lock stays held: close() and the exit would hang on it too
        link._stop.detach()
        link.runner.close()
        pytest.fail("the finalizer waited for the lock its own thread holds")
    assert result is None
    opt.close()


def test_deepcopy_of_a_live_optimizer_is_refused_clearly():
    model = _model()
    with zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.25) as opt:
        with pytest.raises(TypeError, match="cannot be deep-copied.*load_state_dict"):
            copy.deepcopy(opt)
        _train(model, opt, 2)   # still works


def test_meta_device_parameter_is_refused_by_name():
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"params\[0\] \(shape \(4, 4\)\) is on the meta device"):
        zenflow.ZenFlowAdamW(model.parameters())


def test_state_dict_from_another_thread_while_stepping_does_not_tear():
    """Asynchronous checkpointing: state_dict() on a thread while the main thread steps (item 7)."""
    model = _model()
    opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2)
    errors, saved, stop = [], [], threading.Event()

    def checkpoint():
        while not stop.is_set():
            try:
                saved.append(opt.state_dict()["zenflow"]["step"])
            except BaseException as exc:
                errors.append(exc)
                return
    try:
        thread = threading.Thread(target=checkpoint, daemon=True)
        thread.start()
        _train(model, opt, 60)
        stop.set()
        thread.join(30)
        opt.synchronize()
        assert not errors, errors[0]
        assert len(saved) > 0 and saved == sorted(saved)
        assert all(torch.isfinite(p).all() for p in model.parameters())
    finally:
        stop.set()
        opt.close()


def test_memory_limits_read_from_cgroup_v1_and_v2(tmp_path):
    """The container's memory limit counts whether it is set through cgroup v1 or v2, at the
    process's own cgroup (item 12)."""
    from zenflow.host import arena
    proc = tmp_path / "cgroup"
    v1 = tmp_path / "v1"
    (v1 / "memory" / "job").mkdir(parents=True)
    (v1 / "memory" / "job" / "memory.limit_in_bytes").write_text(str(3 << 30))
    (v1 / "memory" / "job" / "memory.usage_in_bytes").write_text(str(1 << 30))
    proc.write_text("12:memory:/job\n3:cpu,cpuacct:/job\n")
    assert arena._cgroup_headroom(str(v1), str(proc)) == 2 << 30
    (v1 / "memory" / "job" / "memory.limit_in_bytes").write_text(str(2 ** 63 - 4096))
    assert arena._cgroup_headroom(str(v1), str(proc)) is None     # v1's "no limit"
    v2 = tmp_path / "v2"
    (v2 / "slice").mkdir(parents=True)
    (v2 / "slice" / "memory.max").write_text(str(5 << 30))
    (v2 / "slice" / "memory.current").write_text(str(1 << 30))
    proc.write_text("0::/slice\n")
    assert arena._cgroup_headroom(str(v2), str(proc)) == 4 << 30
    (v2 / "slice" / "memory.max").write_text("max")
    assert arena._cgroup_headroom(str(v2), str(proc)) is None


@pytest.mark.slow   # a child process
def test_small_address_space_limit_is_a_clear_error_and_leaks_no_memfd(tmp_path):
    """`ulimit -v` too small: HostMemoryError naming it, from the check and from the mapping
    itself, with no memory file left open (item 12)."""
    out = _run_script("address_space_limit.py")
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr


def test_close_takes_the_attached_models_hooks_off():
    """A model trained again under a new optimizer (a sweep, a notebook) carries no hook of a
    closed one's: 200 cycles leave none behind."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    hooks_before = (len(model[0]._forward_pre_hooks), len(model._state_dict_pre_hooks))
    for _ in range(200):
        opt = zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.25, worker=False)
        opt.attach(model)
        opt.close()
    assert (len(model[0]._forward_pre_hooks), len(model._state_dict_pre_hooks)) == hooks_before


@pytest.mark.parametrize("value", ["0", "nan", "abc", "-3", "inf"])
def test_a_bad_worker_timeout_is_refused_by_name(value):
    with pytest.raises(ValueError, match=f"ZENFLOW_WORKER_TIMEOUT_S must be a positive, finite "
                                         f"number of seconds .* got '{value}'"):
        worker._wait_timeout({"ZENFLOW_WORKER_TIMEOUT_S": value})
    assert worker._wait_timeout({"ZENFLOW_WORKER_TIMEOUT_S": "90"}) == 90.0
    assert worker._wait_timeout({}) == 1800.0


@pytest.mark.parametrize("attach", [False, True])
def test_a_model_deep_copied_right_after_a_step_is_the_trained_model(attach):
    """An EMA or teacher copy taken right after step(): without attach every install is finished
    in the step; with it, the copy follows wait_for_install(), attach's contract. The copy's
    forward runs, equals the model's, and its weights are its own."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    with zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval=1,
                              worker=False) as opt:
        if attach:
            opt.attach(model)
        for _ in range(3):
            model(torch.randn(2, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        if attach:
            opt.wait_for_install()
        teacher = copy.deepcopy(model)
        x = torch.randn(2, 8)
        torch.testing.assert_close(teacher(x), model(x), rtol=0, atol=0)
        model(torch.randn(2, 8)).square().mean().backward()
        opt.step()
        assert not torch.equal(teacher[0].weight, model[0].weight)
