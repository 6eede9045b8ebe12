"""The asynchronous host worker: a separate process that runs the host AdamW while training goes on.

One worker per optimizer. It is never forked from the training process (so it is safe beside CUDA
and threads): it is forked from multiprocessing's fork server, a clean process spawned once with
torch imported, or spawned from scratch with start_method="spawn". It
receives the `HostState` once (its tensors are in shared memory, so both processes see the same
buffers), pins itself to the cores the training process does not keep, and then serves a pipe:

    parent -> worker   ("update", slot, jobs)   run HostState.update(jobs, slot)
                       ("close",)               exit
    worker -> parent   ("ready",)               started, before the first command
                       ("done", start, end)     perf_counter() bounds of the update it ran
                       ("error", text)          the update raised; the traceback as text

The worker exits on "close", on end-of-file (the parent's end of the pipe closed) and when the
training process no longer exists (it died while something else holds the pipe open). It ignores
SIGINT, so Ctrl-C in a terminal interrupts only the training process, which then closes the worker
itself (close(), garbage collection or atexit). The parent never blocks without a timeout: every
wait polls the pipe briefly and checks that the process is still alive, so a dead worker turns into
a RuntimeError that names the cause instead of a hang.
"""
from __future__ import annotations

import atexit
import math
import os
import signal
import sys
import time
import traceback
import weakref

import torch
import torch.multiprocessing as mp

from zenflow.host import HostJob, HostState

_POLL_S = 0.05          # how long one wait slice blocks before checking the process
_CLOSE_TIMEOUT_S = 5.0  # how long close() waits for a clean exit before killing


# ---------------------------------------------------------------------------- core selection
def _physical_cores(cpus: list[int]) -> list[list[int]]:
    """`cpus` grouped by physical core (hyperthread siblings together), in ascending order.
    Without /sys topology every CPU counts as its own core."""
    groups: dict[tuple, list[int]] = {}
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{base}/physical_package_id") as f:
                package = int(f.read())
            with open(f"{base}/core_id") as f:
                core = int(f.read())
            key = (package, core)
        except (OSError, ValueError):
            key = (cpu,)
        groups.setdefault(key, []).append(cpu)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: g[0])


def split_cores(reserved_perc: float, cpus: list[int] | None = None) -> tuple[list[int], list[int]]:
    """(training cpus, worker cpus) from the CPUs this process may use.

    The training process keeps ceil(reserved_perc * n) cores (at least one when n > 1, at most
    n - 1 so the worker has one); the worker gets the rest. Whole physical cores go to each side
    first; hyperthread siblings are split only when there is a single physical core. With one CPU
    the worker shares it.
    """
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            list(range(os.cpu_count() or 1))
    cpus = sorted(cpus)
    if len(cpus) <= 1:
        return cpus, cpus
    cores = _physical_cores(cpus)
    if len(cores) == 1:          # one physical core with several hyperthreads
        cores = [[c] for c in cores[0]]
    n = len(cores)
    keep = min(n - 1, max(1, math.ceil(reserved_perc * n)))
    training = [c for core in cores[:keep] for c in core]
    worker = [c for core in cores[keep:] for c in core]
    return training, worker


# ---------------------------------------------------------------------------- the worker process
def _alive(pid: int) -> bool:
    """Whether process `pid` exists. (With forkserver the worker's parent is the fork server, not
    the training process, so the parent pid alone says nothing.)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _worker_main(conn, host: HostState, cores: list[int] | None, parent_pid: int) -> None:
    _serve(conn, host, cores, parent_pid)
    # Nothing is left to flush or save: skip the interpreter's teardown of torch (about a second
    # here) so that close() returns quickly. The kernel drops the shared mappings.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _serve(conn, host: HostState, cores: list[int] | None, parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if cores:
        try:
            os.sched_setaffinity(0, cores)
        except (AttributeError, OSError):
            pass  # affinity is an optimisation; a platform without it still works
        torch.set_num_threads(len(cores))
    conn.send(("ready",))
    while True:
        try:
            if not conn.poll(1.0):
                if not _alive(parent_pid):
                    return   # the training process died; nobody will read our results
                continue
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "close":
            return
        _, slot, jobs = message
        start = time.perf_counter()
        try:
            host.update(jobs, slot)
            reply = ("done", start, time.perf_counter())
        except BaseException:  # report anything; the parent decides what is fatal
            reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return


# ---------------------------------------------------------------------------- the parent's side
def _describe_exit(exitcode: int | None, started: bool) -> str:
    if exitcode is None:
        return "is unresponsive"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = str(-exitcode)
        hint = " (the out-of-memory killer sends SIGKILL)" if -exitcode == signal.SIGKILL else ""
        return f"was killed by signal {name}{hint}"
    if not started:
        return (f"exited with code {exitcode} while starting; spawn re-imports the main script in "
                "the worker, so a training script needs an `if __name__ == \"__main__\":` guard "
                "(see the worker's traceback above)")
    return f"exited with code {exitcode}"


# Runners not yet closed, held weakly so that an optimizer can still be garbage collected; one
# atexit hook closes whatever is left when the interpreter exits.
_live_runners: "weakref.WeakSet[WorkerHostRunner]" = weakref.WeakSet()


@atexit.register
def _close_live_runners() -> None:
    for runner in list(_live_runners):
        try:
            runner.close()
        except Exception:
            pass


class WorkerHostRunner:
    """Runs host updates in a worker process; same methods as `InlineHostRunner`.

    submit() hands a window to the worker and returns at once; wait() blocks until it is done and
    returns the seconds spent blocked. At most one update is in flight.

    start_method "forkserver" (default) forks each worker from a clean server process that was
    spawned once with torch imported: as safe beside CUDA as "spawn" (the server never touches
    CUDA or starts threads), but a worker starts in milliseconds instead of re-importing torch
    (seconds). "spawn" starts every worker from scratch.
    """

    def __init__(self, host: HostState, cores: list[int] | None = None,
                 start_method: str = "forkserver"):
        self.host = host
        self.busy_seconds = 0.0
        self.updates: list[tuple[float, float]] = []  # (start, end) perf_counter of each update
        self._pending = False
        self._error: str | None = None
        self._closed = False
        self._ready = False
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(["torch", "zenflow.worker"])
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_main, name="zenflow-host-worker",
                                   args=(child_conn, host, cores, os.getpid()), daemon=True)
        self.process.start()
        child_conn.close()  # so that the worker's death shows up here as end-of-file
        self.pid = self.process.pid
        _live_runners.add(self)

    # -- receiving
    def _fail(self, cause: str) -> None:
        self._error = f"ZenFlow host worker (pid {self.pid}) {cause}"
        self._pending = False
        raise RuntimeError(self._error)

    def _receive(self, timeout: float) -> bool:
        """Handle at most one message, waiting up to `timeout`; False when none came. Raises if
        the worker reported an error or is dead."""
        if self._error is not None:
            raise RuntimeError(self._error)
        try:
            if self._conn.poll(timeout):
                message = self._conn.recv()
            else:
                message = None
        except (EOFError, OSError):
            message = None
            self.process.join(1.0)
            self._fail(_describe_exit(self.process.exitcode, self._ready))
        if message is None:
            if not self.process.is_alive():
                if self._conn.poll(0):       # it answered before it died
                    return self._receive(0)
                self._fail(_describe_exit(self.process.exitcode, self._ready))
            return False
        kind = message[0]
        if kind == "ready":
            self._ready = True
        elif kind == "done":
            self._pending = False
            start, end = message[1], message[2]
            self.busy_seconds += end - start
            self.updates.append((start, end))
        elif kind == "error":
            self._fail(f"failed in the host update:\n{message[1]}")
        return True

    def check(self) -> None:
        """Raise RuntimeError now if the worker died or reported an error; never blocks."""
        if self._closed:
            raise RuntimeError("ZenFlow host worker: used after close()")
        while self._receive(0.0):
            pass

    # -- the runner interface
    def ready(self) -> bool:
        """Whether no update is in flight (never blocks; raises if the worker died)."""
        self.check()
        return not self._pending

    @property
    def last_update_seconds(self) -> float:
        """How long the worker took for the last host update (0 before the first)."""
        return self.updates[-1][1] - self.updates[-1][0] if self.updates else 0.0

    def submit(self, jobs: list[HostJob], slot: int) -> None:
        self.check()
        if self._pending:
            raise RuntimeError("ZenFlow host worker: submit() while an update is in flight")
        try:
            self._conn.send(("update", slot, list(jobs)))
        except (BrokenPipeError, OSError):
            self.process.join(1.0)
            self._fail(_describe_exit(self.process.exitcode, self._ready))
        self._pending = True

    def wait(self) -> float:
        """Block until the submitted update is done; returns the seconds spent blocked."""
        if not self._pending:
            if not self._closed:
                self.check()
            return 0.0
        start = time.perf_counter()
        while self._pending:
            self._receive(_POLL_S)
        return time.perf_counter() - start

    def close(self) -> None:
        """Stop the worker (asking first, then killing) and drop the shared buffers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _live_runners.discard(self)
        process = self.process
        if process.is_alive():
            if self._ready or self._conn.poll(0):
                try:
                    self._conn.send(("close",))
                except (BrokenPipeError, OSError):
                    pass
                process.join(_CLOSE_TIMEOUT_S)
            if process.is_alive():   # still importing torch, or stuck: no need to be polite
                process.kill()
                process.join(_CLOSE_TIMEOUT_S)
        else:
            process.join(0)
        self._conn.close()
        self._pending = False


    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
