"""What runs inside the worker process: attach to the host arena, then serve the training
process's commands (the protocol: zenflow/host/worker.py) until it closes the socket or dies."""
from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection


def _alive(pid: int) -> bool:
    """Whether `pid` still runs. A zombie (dead, not yet reaped by the fork server) is dead: its
    end of our socket may not read as closed yet, and commands sent to it would be lost."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:   # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


_STATES = {"T": "stopped (SIGSTOP, or Ctrl-Z in its terminal)", "t": "stopped by a debugger",
           "D": "waiting on disk or memory (uninterruptible sleep)"}


def process_state(pid: int) -> str:
    """What is unusual about process `pid`'s state, in words ("" when running or unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            code = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return _STATES.get(code, "")


def _ignore_shutdown_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _worker_main(conn_fd: int, arena_fd: int, init: dict) -> None:
    """Body of a forked worker; never returns."""
    code = 0
    try:
        _serve(Connection(conn_fd), arena_fd, init)
    except BaseException:
        traceback.print_exc()
        code = 1
    # Nothing is left to flush or save: skip the interpreter's teardown of torch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve(conn: Connection, arena_fd: int, init: dict) -> None:
    import torch

    from zenflow.host.buffers import HostState
    from zenflow.host.commands import Update
    from zenflow.host.teams import NodeTeams

    cores = init["cores"]
    if cores:
        try:
            os.sched_setaffinity(0, cores)
        except (AttributeError, OSError):
            pass  # affinity is an optimisation; a platform without it still works
    host = HostState.attach(init["layout"], init["regions"], init["size"], arena_fd)
    host.arena.close_fd()  # the mapping stays
    host.arena.nodes = list(init.get("nodes") or [])
    teams = init.get("teams") or []   # the worker's cores on each node (numa.cores_by_node)
    if sum(1 for cpus in teams if cpus) > 1:
        # The host state is shared out over the nodes: each node's share is updated on that
        # node's cores (zenflow/host/teams.py).
        host.teams = NodeTeams(teams)
    if cores and len(cores) > 1:
        host.lanes = NodeTeams(teams if host.teams is not None else [cores], per_core=True)
    if cores:
        # Set after the teams (each sets its own): every other thread's kernels (the
        # accumulates, a single node's update) use all the worker's cores.
        torch.set_num_threads(len(cores))
    send_lock = threading.Lock()

    def reply(message) -> None:
        with send_lock:
            conn.send(message)

    def run(seq: int, command) -> None:
        start = time.perf_counter()
        try:
            command.run(host)
            message = ("done", seq, start, time.perf_counter())
        except BaseException:  # report anything; the parent decides what is fatal
            message = ("error", seq, traceback.format_exc())
        try:
            reply(message)
        except (BrokenPipeError, OSError):
            pass

    updates: queue.Queue = queue.Queue()

    def update_loop() -> None:
        if cores:
            torch.set_num_threads(len(cores))   # torch keeps the count per thread
        while (message := updates.get()) is not None:
            run(*message)

    updater = threading.Thread(target=update_loop, name="zenflow-host-update", daemon=True)
    updater.start()
    reply(("ready", host.teams.threads if host.teams is not None else []))
    parent = init["parent_pid"]
    try:
        while True:
            try:
                if not conn.poll(1.0):
                    if not _alive(parent):
                        return   # the training process died; nobody will read our results
                    continue
                message = conn.recv()
            except (EOFError, OSError):
                return
            if message is None:   # close
                return
            seq, command = message
            if isinstance(command, Update):
                updates.put(message)
                continue
            # The parent never accumulates into the sum slot an update is reading (it alternates
            # slots with overlap and waits for the update without), so no lock is needed here.
            run(seq, command)
    finally:
        updates.put(None)
        updater.join()
        for pool in (host.teams, host.lanes):
            if pool is not None:
                pool.close()
