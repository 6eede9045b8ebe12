"""The worker's update on a multi-socket host: one thread per NUMA node, each running its node's
share of the host state on that node's cores.

The host state of a worker whose cores span several nodes is cut into one share per node, each
on its node's memory (zenflow/host/numa.py). Torch's intra-op threads do not know where memory
is: one update kernel over a chunk runs on every core of the worker, half of them reading the
other socket's memory. So each node gets a thread of its own, pinned to the worker's cores on
that node, with as many torch intra-op threads as it has cores there (torch's OpenMP keeps the
count per calling thread, and the threads it starts inherit their caller's affinity): a kernel
that thread calls runs on that node alone. A team that runs out of its own share takes chunks
from the end of the fullest other share, so an uneven split of cores still finishes together.

`per_core=True` gives each node one thread per core instead, each with one torch thread: for work
that comes as many small operators (the "factored" update's blocks, zenflow/host/factored.py),
where an OpenMP fork and join per operator costs more than the operator (measured: two torch
threads made that update 1.6x slower than one).
"""
from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable

import torch


class NodeTeams:
    """Threads that run lists of tasks, list i on the cores `cores_by_node[i]`. A node without
    cores gets no thread: the others run its share. `per_core`: a thread per core of a node
    (pinned to it, one torch thread each), which take their node's tasks as they come free."""

    def __init__(self, cores_by_node: list[list[int]], per_core: bool = False):
        if not any(cores_by_node):
            raise ValueError(f"NodeTeams: cores_by_node must give some node a core, got "
                             f"{cores_by_node!r}")
        # torch threads per node: how many elements a chunk of that node's share should hold
        self.threads = [len(cpus) for cpus in cores_by_node]
        self.ran = [0] * len(cores_by_node)   # tasks each team has run (tests, diagnostics)
        self._work = threading.Condition()
        self._queues: list[deque] = [deque() for _ in cores_by_node]
        self._running = 0          # tasks taken, not finished
        self._error: BaseException | None = None
        self._generation = 0       # run() calls so far: a team wakes for each
        self._closed = False
        # (node, the cores a thread runs on): the node's, or one each
        placed = [(i, [cpu] if per_core else cpus) for i, cpus in enumerate(cores_by_node)
                  for cpu in (cpus if per_core else cpus[:1])]
        ready = threading.Barrier(len(placed) + 1)
        self._threads = [threading.Thread(target=self._serve, args=(i, cpus, ready), daemon=True,
                                          name=f"zenflow-node-team-{i}")
                         for i, cpus in placed]
        for thread in self._threads:
            thread.start()
        ready.wait()   # every team has its affinity and its torch thread count

    def run(self, shares: list[list[Callable[[], None]]]) -> None:
        """Run every task, share i's on team i (or whichever team is free when its share is
        done), each share's started in order; returns when all are done, raising the first error
        (the tasks not started by then are dropped)."""
        if len(shares) != len(self._queues):
            raise ValueError(f"NodeTeams.run: shares must have one list per node "
                             f"({len(self._queues)}), got {len(shares)}")
        with self._work:
            if self._closed:
                raise RuntimeError("NodeTeams: used after close()")
            self._queues = [deque(share) for share in shares]
            self._error = None
            self._generation += 1
            self._work.notify_all()
            self._work.wait_for(lambda: not any(self._queues) and not self._running)
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _take(self, i: int) -> Callable[[], None] | None:
        """The next task for team i (called holding the lock): its own share's next, else the
        last of the fullest other share (the far end: the owner works from the front)."""
        if self._queues[i]:
            return self._queues[i].popleft()
        fullest = max(self._queues, key=len)
        return fullest.pop() if fullest else None

    def _serve(self, i: int, cpus: list[int], ready: threading.Barrier) -> None:
        try:
            os.sched_setaffinity(0, cpus)   # this thread only; the OpenMP team it starts inherits
        except (AttributeError, OSError):
            pass   # affinity is an optimisation
        torch.set_num_threads(len(cpus))
        ready.wait()
        seen = 0
        with self._work:
            while True:
                self._work.wait_for(lambda: self._closed or self._generation != seen)
                if self._closed:
                    return
                seen = self._generation
                while (task := self._take(i)) is not None:
                    self._running += 1
                    self._work.release()
                    try:
                        task()
                        error = None
                    except BaseException as exc:   # handed to run()'s caller
                        error = exc
                    finally:
                        self._work.acquire()
                    self._running -= 1
                    self.ran[i] += 1
                    if error is not None and self._error is None:
                        self._error = error
                        for queue in self._queues:
                            queue.clear()
                self._work.notify_all()

    def close(self) -> None:
        """Stop and join the team threads; idempotent."""
        with self._work:
            self._closed = True
            self._work.notify_all()
        for thread in self._threads:
            thread.join()
