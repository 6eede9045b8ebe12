"""The host worker: a separate process that sums gradients and runs the host AdamW.

Starting it: each worker is forked from a small server process (zenflow/host/forkserver.py), never
from the training process and never by re-importing the user's script, and handed two file
descriptors: the optimizer's host memory (zenflow/host/arena.py) and its end of a command socket.

The protocol, in order on one socket:

    parent -> worker   (seq, command)    an Accumulate or an Update (zenflow/host/commands.py)
                       None              close
    worker -> parent   ("ready", team_threads)  torch threads of each NUMA node's team
                                                ([] without teams: zenflow/host/teams.py)
                       ("done", seq, start, end)       perf_counter() bounds of the work
                       ("error", seq, traceback_text)

Accumulates run as they arrive; an update runs on a second thread so the sums of the next window
keep flowing in while it works (they go to the other sum slot). The worker ignores SIGINT and
SIGTERM: the training process owns shutdown, so a scheduler's SIGTERM to the whole process group
does not take the host state away before the training process's handler has saved it. It exits
on "close", when its socket reaches end-of-file (the training process closed it or died) and
when the training process no longer exists. The parent never blocks without a timeout: every wait
polls briefly and checks the worker, so a dead worker becomes a RuntimeError naming the cause.
"""
from __future__ import annotations

import atexit
import logging
import math
import os
import signal
import socket
import time
import weakref
from multiprocessing.connection import Connection

from zenflow.host import numa
from zenflow.host.commands import HostCommand, Update
from zenflow.host.forkserver import _ForkServer
from zenflow.host.signals import sigint_deferred as _sigint_deferred
from zenflow.host.worker_main import _alive, process_state

log = logging.getLogger("zenflow")

_POLL_S = 0.05          # how long one wait slice blocks before checking the process
_CLOSE_TIMEOUT_S = 5.0  # how long close() waits for a clean exit before killing
# A wait on the worker that sees no progress this long logs a warning, and this long raises: a
# stopped or starved worker becomes an error naming it, never a silent hang. Host updates of the
# largest models take seconds, so the limit is generous; ZENFLOW_WORKER_TIMEOUT_S changes it.
_WARN_AFTER_S = 60.0


def _wait_timeout(environ=os.environ) -> float:
    """ZENFLOW_WORKER_TIMEOUT_S, checked: a positive, finite number of seconds (default 1800)."""
    text = environ.get("ZENFLOW_WORKER_TIMEOUT_S", "1800")
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"ZENFLOW_WORKER_TIMEOUT_S must be a positive, finite number of "
                         f"seconds (how long a wait on the host worker may see no progress), "
                         f"got {text!r}")
    return value


_WAIT_TIMEOUT_S = _wait_timeout()


# ---------------------------------------------------------------------------- the parent's side
def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is gone (its exit status is unknown)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        hint = " (the out-of-memory killer sends SIGKILL)" if -code == signal.SIGKILL else ""
        return f"was killed by signal {name}{hint}"
    return f"exited with code {code} (see its traceback above)"


class WorkerDied(RuntimeError):
    """The worker process is gone (killed, out of memory) or failed in a command."""


class WorkerStuck(WorkerDied):
    """The worker made no progress for the wait's deadline (stopped, starved, or hung)."""


# Runners not yet closed, held weakly so that an optimizer can still be garbage collected; one
# atexit hook closes whatever is left when the interpreter exits.
_live_runners: weakref.WeakSet[WorkerHostRunner] = weakref.WeakSet()


@atexit.register
def _close_live_runners() -> None:
    # In a process forked from the training process (its atexit hooks run at sys.exit), the
    # runners are the parent's: each one's close() leaves its worker alone.
    for runner in list(_live_runners):
        try:
            runner.close()
        except Exception:
            pass


def start_server_early() -> None:
    """Start this process's worker fork server now, without waiting for it: its import of torch
    (a second or two) then runs beside the optimizer's own start-up (torch.optim imports
    torch._dynamo at the first add_param_group: as long again) instead of after it."""
    _ForkServer.get()


class WorkerHostRunner:
    """Runs host commands in a worker process; same methods as `InlineHostRunner`.

    send() hands a command to the worker and returns its sequence number at once; wait(seq)
    blocks until that command (and everything before it) is done and returns the seconds spent
    blocked.
    """

    def __init__(self, host, cores: list[int] | None = None):
        self.busy_seconds = 0.0
        self.updates: list[tuple[float, float]] = []  # (start, end) of each update, last 10k
        self._seq = 0
        self._done_through = 0        # every command with seq <= this is done
        self._finished: set[int] = set()
        self._unfinished: dict[int, HostCommand] = {}   # seq -> command, until its "done" arrives
        self._error: str | None = None
        self._closed = False
        self._creator_pid = os.getpid()   # the worker belongs to this process, not to its forks
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # On a host whose state is shared out over NUMA nodes, the worker updates each node's
        # share on its cores there: one list of cores per node, in the arena's share order.
        teams = numa.cores_by_node(cores, host.arena.nodes) if cores and host.arena.nodes else []
        init = {"layout": host.layout, "regions": host.arena.regions, "size": host.arena.size,
                "cores": cores, "parent_pid": os.getpid(), "nodes": host.arena.nodes,
                "teams": teams}
        self.team_threads: list[int] = []   # from the worker's "ready": its teams' torch threads
        self._server = _ForkServer.get()
        try:
            self.pid = self._server.fork(theirs.fileno(), host.arena.fd, init)
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        _live_runners.add(self)

    # -- receiving
    def _fail(self, cause: str) -> None:
        self._error = f"ZenFlow host worker (pid {self.pid}) {cause}"
        raise WorkerDied(self._error)

    def unfinished(self) -> list[HostCommand]:
        """Commands sent but not reported done (after a death: the work it was doing)."""
        return list(self._unfinished.values())

    def _receive(self, timeout: float) -> bool:
        """Handle at most one message, waiting up to `timeout`; False when none came. Raises if
        the worker reported an error or is dead."""
        if self._error is not None:
            raise WorkerDied(self._error)
        with _sigint_deferred():   # a message taken off the socket is always booked
            try:
                message = self._conn.recv() if self._conn.poll(timeout) else None
            except (EOFError, OSError):
                message = EOFError
            if message is not None and message is not EOFError:
                self._book(message)
        if message is EOFError:
            self._fail(_describe_exit(self._server.exit_code(self.pid, 2.0)))
        if message is None:
            if not _alive(self.pid):
                self._fail(_describe_exit(self._server.exit_code(self.pid, 2.0)))
            return False
        if message[0] == "error":
            self._fail(f"failed in a host command:\n{message[2]}")
        return True

    def _book(self, message) -> None:
        kind = message[0]
        if kind == "ready":
            self.team_threads = list(message[1])
        if kind == "done":
            seq, start, end = message[1:]
            self.busy_seconds += end - start
            command = self._unfinished.pop(seq, None)
            if isinstance(command, Update):
                self.updates.append((start, end))
                del self.updates[:-10_000]
            self._finished.add(seq)
            while self._done_through + 1 in self._finished:
                self._done_through += 1
                self._finished.discard(self._done_through)

    def check(self) -> None:
        """Raise RuntimeError now if the worker died or reported an error; never blocks."""
        if self._closed:
            raise RuntimeError("ZenFlow host worker: used after close()")
        while self._receive(0.0):
            pass
        if not _alive(self.pid):   # its socket may not have reached end-of-file yet
            self._fail(_describe_exit(self._server.exit_code(self.pid, 2.0)))

    # -- the runner interface
    def send(self, command: HostCommand) -> int:
        """Hand `command` to the worker; returns its sequence number at once."""
        self.check()
        return self.post(command)

    def post(self, command: HostCommand) -> int:
        """send() without reading the worker's messages first: the dispatch thread sends this
        way (zenflow/host/worker_link.py) while the training thread may be reading them. The
        command is booked before it is written, so a "done" read at once finds it."""
        if self._error is not None:
            raise WorkerDied(self._error)
        with _sigint_deferred():   # sent and booked, or neither
            seq = self._seq + 1
            self._unfinished[seq] = command
            self._seq = seq
            try:
                self._conn.send((seq, command))
            except (BrokenPipeError, OSError):
                # never delivered: nothing of it was done
                del self._unfinished[seq]
                self._seq = seq - 1
                seq = None
        if seq is None:
            self._fail(_describe_exit(self._server.exit_code(self.pid, 2.0)))
        return seq

    def done(self, seq: int) -> bool:
        self.check()
        return seq <= self._done_through or seq in self._finished

    def wait(self, seq: int | None = None) -> float:
        """Block until command `seq` is done, or with no seq until every command sent is done
        (commands finish out of order: an update runs beside later accumulates); returns the
        seconds spent blocked."""
        def finished() -> bool:
            if seq is None:
                return self._done_through >= self._seq
            return seq <= self._done_through or seq in self._finished
        self.check()
        if finished():
            return 0.0
        start = progress = time.perf_counter()
        warned = False
        while not finished():
            if self._receive(_POLL_S):
                progress = time.perf_counter()
                continue
            quiet = time.perf_counter() - progress
            if quiet > _WARN_AFTER_S and not warned:
                warned = True
                log.warning("still waiting for the ZenFlow host worker (pid %d) after %.0f s "
                            "without progress%s", self.pid, quiet, self._state_note())
            if quiet > _WAIT_TIMEOUT_S:
                self._error = (f"ZenFlow host worker (pid {self.pid}) made no progress for "
                               f"{quiet:.0f} s{self._state_note()} (limit: "
                               f"ZENFLOW_WORKER_TIMEOUT_S={_WAIT_TIMEOUT_S:g})")
                raise WorkerStuck(self._error)
        return time.perf_counter() - start

    def _state_note(self) -> str:
        state = process_state(self.pid)
        return f"; it is {state}" if state else ""

    @property
    def last_update_seconds(self) -> float:
        """How long the worker took for the last host update (0 before the first)."""
        return self.updates[-1][1] - self.updates[-1][0] if self.updates else 0.0

    def close(self, wait: bool = True) -> None:
        """Stop the worker (asking first, then, with `wait`, killing it if it does not exit in
        time). Idempotent. Without `wait` (a runner collected by the garbage collector, which
        may run inside the fork server's own lock) it only asks: the worker exits at the close
        message or at its socket's end of file, and the fork server reaps it."""
        if self._closed:
            return
        self._closed = True
        _live_runners.discard(self)
        if os.getpid() != self._creator_pid:
            # A forked child (exiting through sys.exit, atexit or garbage collection): the
            # worker is its parent's. Drop our copy of the socket, leave the worker alone.
            self._conn.close()
            return
        try:
            self._conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        if not wait:
            self._conn.close()
            return
        deadline = time.monotonic() + _CLOSE_TIMEOUT_S
        while _alive(self.pid) and time.monotonic() < deadline:
            if self._server.exit_code(self.pid, _POLL_S) is not None:
                break
        if self._server.exit_code(self.pid, 0.0) is None and _alive(self.pid):
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._server.exit_code(self.pid, _CLOSE_TIMEOUT_S)
        self._conn.close()

    def __del__(self):
        try:
            self.close(wait=False)
        except Exception:
            pass

