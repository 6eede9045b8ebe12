"""The fork server that starts host workers without re-importing the user's script.

multiprocessing's spawn and forkserver start methods import the main script again in the child,
which breaks scripts without an `if __name__ == "__main__":` guard, `python - < script.py` and
notebooks; forking the training process itself is unsafe beside CUDA and threads. So the first
optimizer that needs a worker starts this server: a fresh interpreter (`python -c ...`) that
imports torch once, never touches CUDA (CUDA_VISIBLE_DEVICES is empty for it), and then, per
request on its control socket, forks one worker in milliseconds and hands it two file
descriptors received with SCM_RIGHTS: the optimizer's host memory file and its end of a
command socket. The server reaps its children and reports each exit status, so the training
process can say how a worker died. It exits when the training process closes the control
socket or dies.
"""
from __future__ import annotations

import atexit
import os
import pickle
import socket
import subprocess
import sys
import threading
import time

_POLL_S = 0.05
_CLOSE_TIMEOUT_S = 5.0
_MESSAGE_BYTES = 1 << 16


def _server_main(control_fd: int) -> None:
    """The server process (started by _ForkServer): fork one worker per request on the control socket; report
    each worker's exit status; exit when the training process closes the socket (or dies)."""
    from zenflow.host.worker_main import _ignore_shutdown_signals, _worker_main
    _ignore_shutdown_signals()
    import torch  # noqa: F401  (imported once here, so every forked worker starts warm)

    import zenflow.host.buffers  # noqa: F401

    control = socket.socket(fileno=control_fd)
    children: set[int] = set()
    while True:
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                try:
                    control.send(pickle.dumps(("exited", pid, code)))
                except OSError:
                    pass
        control.settimeout(0.05 if children else 1.0)
        try:
            data, fds, _, _ = socket.recv_fds(control, _MESSAGE_BYTES, 2)
        except TimeoutError:
            continue
        except OSError:
            return
        if not data:
            return  # the training process is gone; its workers see end-of-file themselves
        token, init = pickle.loads(data)
        conn_fd, arena_fd = fds
        pid = os.fork()
        if pid == 0:
            control.close()
            _worker_main(conn_fd, arena_fd, init)
        os.close(conn_fd)
        os.close(arena_fd)
        children.add(pid)
        control.send(pickle.dumps(("started", token, pid)))


class _ForkServer:
    """The training process's handle on its fork server (one per process, started lazily)."""

    _instance: _ForkServer | None = None
    _lock = threading.Lock()

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the server and workers never use CUDA
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from zenflow.host.forkserver import _server_main; "
             "_server_main(int(sys.argv[1]))", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self.socket = ours
        self.pid = os.getpid()
        self._exits: dict[int, int] = {}
        self._started: dict[int, int] = {}
        self._token = 0

    @classmethod
    def get(cls) -> _ForkServer:
        with cls._lock:
            server = cls._instance
            if server is None or server.pid != os.getpid() or server.process.poll() is not None:
                server = cls._instance = cls()
            return server

    def _read(self, timeout: float) -> bool:
        self.socket.settimeout(timeout)
        try:
            data = self.socket.recv(_MESSAGE_BYTES)
        except TimeoutError:
            return False
        if not data:
            raise RuntimeError(f"the ZenFlow worker server (pid {self.process.pid}) exited with "
                               f"code {self.process.poll()}")
        message = pickle.loads(data)
        if message[0] == "started":
            self._started[message[1]] = message[2]
        else:
            self._exits[message[1]] = message[2]
        return True

    def fork(self, conn_fd: int, arena_fd: int, init: dict) -> int:
        with self._lock:
            self._token += 1
            token = self._token
            socket.send_fds(self.socket, [pickle.dumps((token, init))], [conn_fd, arena_fd])
            deadline = time.monotonic() + 120.0   # the server may still be importing torch
            while token not in self._started:
                if self.process.poll() is not None:
                    raise RuntimeError("the ZenFlow worker server exited with code "
                                       f"{self.process.returncode} before starting a worker "
                                       "(see its output above)")
                if time.monotonic() > deadline:
                    raise RuntimeError("the ZenFlow worker server did not start a worker in 120 s")
                self._read(_POLL_S)
            return self._started.pop(token)

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
    if server is not None and server.pid == os.getpid():
        server.socket.close()
        try:
            server.process.wait(_CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.process.kill()
