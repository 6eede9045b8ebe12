"""The training process's end of the host worker: the runner, and the commands on their way to it.

A command (an Accumulate of a staging buffer, a window's Update: zenflow/host/commands.py) may
reach the worker only once the copies it reads have landed (its `Ticket`). `submit()` queues it,
and it is sent, in order, the moment those copies have landed:

- With a worker process, a dispatch thread waits for the copies (a CUDA event's completion, with
  the GIL released; on a CPU "device" the copy thread's) and sends each command then. On a GPU
  step() returns with its copies in flight, so without it a step's Accumulate would reach the
  worker only at the next step(): the worker would add a step's gradients a step late, a backward
  hook would find their staging buffer still being read (and leave its copy to step()), and every
  host-paced window would grow by a step.
- In process (worker=False) there is no thread: the training thread sends what has landed
  whenever it calls in, and runs it there.

`submit()` returns a `Command` handle; whether it has been sent and done is asked of the link
(`done` never blocks; `wait` does). A worker that died idle is replaced, and every command the old
one was sent counts as done (it had finished them all); one that died in the middle of a command
leaves the matrices it was working on torn, and every later call says so until
load_state_dict() rolls them back (`restart`). A failure on the dispatch thread is reported by the
training thread's next call into the link.

Locks: the queue and the sending share one lock, held for no wait (never while a copy or the
worker is waited for), so a backward hook asking about a staging buffer never blocks on it: it
tries the lock and, if it is taken, leaves its copy to step().
"""
from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from zenflow.host.commands import HostCommand, InlineHostRunner
from zenflow.host.signals import sigint_deferred
from zenflow.host.telemetry import StepTimer
from zenflow.host.transfers import Ticket

log = logging.getLogger("zenflow")


@dataclass(eq=False)
class Command:
    """A command submitted to the link; `seq` is set once it has been sent to the runner of
    `generation` (the runners a link has had, counted from 0)."""
    command: HostCommand
    ticket: Ticket     # the copies it reads
    seq: int | None = None
    generation: int = 0

    @property
    def sent(self) -> bool:
        return self.seq is not None


class _Outbox:
    """The commands not sent yet, and the sending, shared by the training thread and the dispatch
    thread. The thread holds this and nothing else, so that a link dropped without close() is
    collected and its finalizer stops the thread."""

    def __init__(self, runner):
        self.runner = runner
        self.generation = 0
        self.queue: deque[Command] = deque()
        # Reentrant: the link's finalizer stops the thread, and the collector may run it on the
        # dispatch thread itself while that thread holds the lock (an allocation in post())
        self.lock = threading.RLock()
        self.wake = threading.Condition(self.lock)
        self.stopping = False
        self.error: BaseException | None = None   # raised on the dispatch thread, not reported yet

    def send_landed(self) -> None:
        """Send, in order, the queued commands whose copies have landed. Raises WorkerDied."""
        with self.lock:
            while self.queue and self.queue[0].ticket.done():
                head = self.queue[0]
                with sigint_deferred():   # sent, numbered and dequeued, or none of it
                    head.seq = self.runner.post(head.command)
                    head.generation = self.generation
                    self.queue.popleft()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.wake.notify_all()


def _stop_outbox(outbox: _Outbox, creator_pid: int) -> None:
    """Stop the dispatch thread, in the process that started it only: a child forked while that
    thread held the lock has a copy of the lock that nothing will ever release (its exit, through
    atexit or collection, would hang), and no thread to stop."""
    if os.getpid() == creator_pid:
        outbox.stop()


def _dispatch(outbox: _Outbox) -> None:
    """The dispatch thread: send each queued command as soon as its copies have landed."""
    while True:
        with outbox.lock:
            while not outbox.stopping and (not outbox.queue or outbox.error is not None):
                outbox.wake.wait()
            if outbox.stopping:
                return
            ticket = outbox.queue[0].ticket
        try:
            ticket.wait()
            outbox.send_landed()
        except BaseException as exc:   # the training thread's next call reports it
            with outbox.lock:
                outbox.error = exc


class WorkerLink:
    """The runner (a worker process, or in process with `cores` None) and its command queue."""

    def __init__(self, host, cores: list[int] | None, timer: StepTimer):
        self._host, self._cores, self.timer = host, cores, timer
        self.torn: list[int] = []   # matrices whose host state a dying worker left half-written
        self._outbox = _Outbox(self._start_runner())
        self._thread: threading.Thread | None = None
        self._creator_pid = os.getpid()
        if not self.in_process:
            self._thread = threading.Thread(target=_dispatch, args=(self._outbox,), daemon=True,
                                            name="zenflow-dispatch")
            self._thread.start()
        # Dropped without close(): the thread still ends (the runner then closes its worker).
        self._stop = weakref.finalize(self, _stop_outbox, self._outbox, self._creator_pid)

    @property
    def runner(self):
        return self._outbox.runner

    @property
    def in_process(self) -> bool:
        return isinstance(self.runner, InlineHostRunner)

    def _start_runner(self):
        if self._cores is None:
            return InlineHostRunner(self._host)
        from zenflow.host.worker import WorkerHostRunner
        return WorkerHostRunner(self._host, self._cores)

    # -- the worker's life ------------------------------------------------------------------
    @contextmanager
    def _guard(self):
        """A worker that died idle is replaced (no state is lost: it all lives in the shared
        arena); one that died mid-command leaves the matrices it was working on torn, and says
        so."""
        from zenflow.host.worker import WorkerDied
        try:
            yield
        except WorkerDied as exc:
            unfinished = self.runner.unfinished()
            self.runner.close()
            if not unfinished:
                log.warning("%s while idle; started a new worker (no host state was lost)", exc)
                self._replace_runner()
                return
            self.torn = sorted({i for c in unfinished for i in c.matrices()})
            raise RuntimeError(
                f"{exc}\nIt stopped in the middle of host work on {len(self.torn)} parameter(s) "
                f"(host indices {self.torn[:10]}{'...' if len(self.torn) > 10 else ''}), whose "
                "host state may be half-written. Roll back with load_state_dict() from the last "
                "checkpoint: that restores every host buffer and starts a new worker.") from exc

    def _replace_runner(self) -> None:
        """A new runner; every command the old one was sent counts as done."""
        with self._outbox.lock:
            self._outbox.runner = self._start_runner()
            self._outbox.generation += 1
            self._outbox.error = None
            self._outbox.wake.notify_all()

    def _need_worker(self) -> None:
        if self.torn:
            raise RuntimeError(f"the host state of parameters {self.torn[:10]} was left "
                               "half-written by a dead worker; load_state_dict() from the last "
                               "checkpoint to roll back")

    def _reported(self) -> None:
        """Raise (inside the guard) what went wrong on the dispatch thread since the last call."""
        with self._outbox.lock:
            error, self._outbox.error = self._outbox.error, None
            self._outbox.wake.notify_all()
        if error is not None:
            raise error

    def restart(self) -> None:
        """After a worker died mid-command: a new worker, nothing queued, nothing torn (the
        caller rewrites every host buffer: load_state_dict())."""
        self.runner.close()
        with self._outbox.lock:
            self._outbox.queue.clear()
        self._replace_runner()
        self.torn = []

    # -- commands -----------------------------------------------------------------------------
    def submit(self, ticket: Ticket, command: HostCommand) -> Command:
        """Queue `command`, to be sent once `ticket`'s copies have landed."""
        handle = Command(command, ticket)
        with self._outbox.lock:
            self._outbox.queue.append(handle)
            self._outbox.wake.notify_all()
        self.send_landed()
        return handle

    def send_landed(self) -> None:
        """Send what has landed now, on this thread (never waits for a copy)."""
        with self._guard():
            self._reported()
            self._outbox.send_landed()

    def send_all(self, through: Command | None = None) -> None:
        """Send every queued command (or those up to `through`), waiting for their copies; the
        wait counts as stall."""
        outbox = self._outbox
        while True:
            with outbox.lock:
                if not outbox.queue or (through is not None and through.sent):
                    return
                ticket = outbox.queue[0].ticket
            self.timer.stall(ticket.wait())
            self.send_landed()

    def queued(self, accepts: Callable[[HostCommand], bool], blocking: bool = True) -> bool | None:
        """Whether a command `accepts` takes waits in the queue, not yet sent; None if the lock
        is taken and `blocking` is false (a backward hook asks so)."""
        if not self._outbox.lock.acquire(blocking=blocking):
            return None
        try:
            return any(accepts(h.command) for h in self._outbox.queue)
        finally:
            self._outbox.lock.release()

    def done(self, handle: Command) -> bool:
        """Whether the worker has done `handle` (never blocks)."""
        if not handle.sent:
            return False
        if handle.generation != self._outbox.generation:
            return True
        with self._guard():
            return self.runner.done(handle.seq)
        return True   # the runner died idle after doing it, and was replaced

    def wait(self, handle: Command) -> float:
        """Send `handle` (and what is queued before it) and wait until the worker has done it;
        returns the seconds the training thread spent blocked."""
        self._need_worker()
        self.send_all(through=handle)
        if handle.generation != self._outbox.generation:
            return 0.0
        with self._guard():
            return self.runner.wait(handle.seq)
        return 0.0

    def drain(self) -> None:
        """Wait until the worker has done everything submitted (before reading host state)."""
        self._need_worker()
        self.send_all()
        with self._guard():
            self.timer.stall(self.runner.wait())

    def check(self) -> None:
        """Raise if the worker died mid-work or the dispatch thread failed (replace a worker that
        died idle); send whatever has landed since the last call."""
        self._need_worker()
        with self._guard():
            self.runner.check()
        self.send_landed()

    def close(self) -> None:
        _stop_outbox(self._outbox, self._creator_pid)
        if self._thread is not None and os.getpid() == self._creator_pid:
            self._thread.join()
        self.runner.close()
