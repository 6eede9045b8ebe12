"""The fork server that starts host workers without re-importing the user's script.

multiprocessing's spawn and forkserver start methods import the main script again in the child,
which breaks scripts without an `if __name__ == "__main__":` guard, `python - < script.py` and
notebooks; forking the training process itself is unsafe beside CUDA and threads. So the first
optimizer that needs a worker starts this server: a fresh interpreter (`python -c ...`) that
imports torch once, never touches CUDA (CUDA_VISIBLE_DEVICES is empty for it), and then, per
request on its control socket, forks one worker in milliseconds and hands it three file
descriptors received with SCM_RIGHTS: the optimizer's host memory file, its end of a command
socket and a memory file holding its start-up data (the host layout, which grows with the number
of matrices, so it never travels in the size-limited control message). The server's interpreter
gets the training process's sys.path, so a zenflow importable only through sys.path (a vendored
copy, a notebook's sys.path.append) is importable there too. The server reaps its children and
reports each exit status, so the training process can say how a worker died. It exits when the
training process closes the control socket or dies.
"""
from __future__ import annotations

import atexit
import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import time

from zenflow.host.arena import anonymous_file
from zenflow.host.worker_main import process_state

_POLL_S = 0.05
_CLOSE_TIMEOUT_S = 5.0
_MESSAGE_BYTES = 1 << 16
_IMPORT_TIMEOUT_S = 120.0   # the server's first import of torch (a cold disk can be slow)
_FORK_TIMEOUT_S = 30.0      # a fork, once the server is up, takes milliseconds


def _init_file(init: dict) -> int:
    """A memory file holding pickle(init), rewound, for the worker to read (its descriptor)."""
    data = pickle.dumps(init)
    fd = anonymous_file("zenflow-worker-init")
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_init_file(fd: int) -> dict:
    with os.fdopen(fd, "rb") as f:
        f.seek(0)
        return pickle.load(f)


def _server_main(control_fd: int) -> None:
    """The server process (started by _ForkServer): fork one worker per request on the control socket; report
    each worker's exit status; exit when the training process closes the socket (or dies)."""
    from zenflow.host.worker_main import _ignore_shutdown_signals, _worker_main
    _ignore_shutdown_signals()
    import torch  # noqa: F401  (imported once here, so every forked worker starts warm)

    import zenflow.host.buffers  # noqa: F401

    control = socket.socket(fileno=control_fd)
    children: set[int] = set()

    def tell(message) -> bool:
        try:
            control.send(pickle.dumps(message))
            return True
        except OSError:   # the training process is gone (or gave up on us): exit quietly
            return False

    if not tell(("ready",)):
        return
    while True:
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                tell(("exited", pid, os.waitstatus_to_exitcode(status)))
        control.settimeout(0.05 if children else 1.0)
        try:
            data, fds, _, _ = socket.recv_fds(control, _MESSAGE_BYTES, 3)
        except TimeoutError:
            continue
        except OSError:
            return
        if not data:
            return  # the training process is gone; its workers see end-of-file themselves
        token = pickle.loads(data)
        conn_fd, arena_fd, init_fd = fds
        init = _read_init_file(init_fd)
        pid = os.fork()
        if pid == 0:
            control.close()
            _worker_main(conn_fd, arena_fd, init)
        os.close(conn_fd)
        os.close(arena_fd)
        children.add(pid)
        if not tell(("started", token, pid)):
            return


class _ForkServer:
    """The training process's handle on its fork server (one per process, started lazily)."""

    _instance: _ForkServer | None = None
    _lock = threading.Lock()

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the server and workers never use CUDA
        # This zenflow's own directory first, so the server imports the same zenflow however
        # the training process found it (a vendored copy, sys.path.append); the training
        # process's other sys.path entries after the interpreter's own (for torch and the
        # like), so that nothing in a script's directory shadows the standard library.
        package_parent = os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))))
        extra = [os.path.abspath(p) for p in sys.path if p]
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import json, sys; first, extra = json.loads(sys.argv[2]); "
             "sys.path[:0] = first; sys.path += [p for p in extra if p not in sys.path]; "
             "from zenflow.host.forkserver import _server_main; _server_main(int(sys.argv[1]))",
             str(theirs.fileno()), json.dumps([[package_parent], extra])],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self.socket = ours
        self.pid = os.getpid()
        self.ready = False
        self._exits: dict[int, int] = {}
        self._started: dict[int, int] = {}
        self._token = 0

    @classmethod
    def get(cls) -> _ForkServer:
        with cls._lock:
            server = cls._instance
            if (server is None or server.pid != os.getpid() or server.process.poll() is not None
                    or server.socket.fileno() < 0):
                server = cls._instance = cls()
            return server

    def _read(self, timeout: float) -> bool:
        if self.socket.fileno() < 0:
            raise RuntimeError(f"the ZenFlow worker server (pid {self.process.pid}) was stopped")
        self.socket.settimeout(timeout)
        try:
            data = self.socket.recv(_MESSAGE_BYTES)
        except TimeoutError:
            return False
        if not data:
            raise RuntimeError(f"the ZenFlow worker server (pid {self.process.pid}) exited with "
                               f"code {self.process.poll()}")
        message = pickle.loads(data)
        if message[0] == "ready":
            self.ready = True
        elif message[0] == "started":
            self._started[message[1]] = message[2]
        else:
            self._exits[message[1]] = message[2]
        return True

    def fork(self, conn_fd: int, arena_fd: int, init: dict) -> int:
        """Have the server fork a worker with these descriptors and start-up data; its pid.
        Raises RuntimeError, naming the server and how long it waited, when the server exits or
        does not answer in time (it is then stopped, so that the next optimizer starts a new
        one)."""
        with self._lock:
            self._token += 1
            token = self._token
            init_fd = _init_file(init)
            try:
                socket.send_fds(self.socket, [pickle.dumps(token)], [conn_fd, arena_fd, init_fd])
            except OSError as exc:
                self._give_up(f"could not be reached ({exc.strerror or exc})")
            finally:
                os.close(init_fd)
            start = time.monotonic()
            while token not in self._started:
                if self.process.poll() is not None:
                    raise RuntimeError("the ZenFlow worker server exited with code "
                                       f"{self.process.returncode} before starting a worker "
                                       "(see its output above)")
                waited = time.monotonic() - start
                limit = _FORK_TIMEOUT_S if self.ready else _IMPORT_TIMEOUT_S
                if waited > limit:
                    state = process_state(self.process.pid)
                    self._give_up(f"did not start a worker in {waited:.0f} s"
                                  + (f" (it is {state})" if state else "")
                                  + ("" if self.ready else " while importing torch"))
                self._read(_POLL_S)
            return self._started.pop(token)

    def _give_up(self, why: str) -> None:
        """Stop this server (a later optimizer starts a new one) and raise, saying `why`."""
        pid = self.process.pid
        self.socket.close()
        self.process.kill()
        self.process.wait()
        if _ForkServer._instance is self:
            _ForkServer._instance = None
        raise RuntimeError(f"the ZenFlow worker server (pid {pid}) {why}; it was stopped, and "
                           "the next optimizer starts a new one")

    def exit_code(self, pid: int, timeout: float) -> int | None:
        """The worker's exit code (negative: killed by that signal), once the server reaped it."""
        with self._lock:
            deadline = time.monotonic() + timeout
            while pid not in self._exits and time.monotonic() < deadline:
                try:
                    self._read(_POLL_S)
                except RuntimeError:
                    return None
            return self._exits.get(pid)


@atexit.register
def _stop_fork_server() -> None:
    server = _ForkServer._instance
    if server is not None and server.pid == os.getpid() and server.socket.fileno() >= 0:
        server.socket.close()
        try:
            server.process.wait(_CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.process.kill()
