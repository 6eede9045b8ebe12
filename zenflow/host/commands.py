"""What the training process asks of the host, and the runner that does it in process.

Two commands, each carried out by `HostState` (zenflow/host/buffers.py) in the worker process or,
with `worker=False`, right away in the training process by `InlineHostRunner`:

    Accumulate   add a staging buffer's gradients, times the factor copied with them, into a
                 window's fp32 sums
    Update       AdamW on each matrix's window sum, new values into the install buffer
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from zenflow.host.buffers import HostState
from zenflow.host.layout import HostJobs


@dataclass(frozen=True)
class Accumulate:
    """grad_sum[sum_slot] += coef * staging[staging_slot] for the `added` matrices; = for the
    `fresh` ones (the window's first gradient: their sums hold stale bytes). coef is the step's
    factor, copied from the device into the slot's step_coef with the gradients: the training
    thread never reads it (0 on a skipped step, which adds nothing)."""
    staging_slot: int
    sum_slot: int
    added: tuple[int, ...]
    fresh: tuple[int, ...]

    def matrices(self) -> list[int]:
        """The matrices whose host state this writes (torn if the worker dies half-way)."""
        return [*self.added, *self.fresh]

    def run(self, host: HostState) -> None:
        host.accumulate(self.staging_slot, self.sum_slot, list(self.added), list(self.fresh))


@dataclass(frozen=True)
class Update:
    """A window's host AdamW: each job's matrix on the mean of grad_sum[sum_slot]."""
    sum_slot: int
    jobs: HostJobs

    def matrices(self) -> list[int]:
        return list(self.jobs.matrices)

    def run(self, host: HostState) -> None:
        host.update(list(self.jobs), self.sum_slot)


HostCommand = Accumulate | Update


class InlineHostRunner:
    """Runs host commands in the calling process, at once. The worker runner has the same methods
    (zenflow/host/worker.py)."""

    def __init__(self, host: HostState):
        self.host = host
        self.busy_seconds = 0.0
        self.updates: list[tuple[float, float]] = []  # (start, end) of each update, last 10k
        self._seq = 0

    def send(self, command: HostCommand) -> int:
        start = time.perf_counter()
        command.run(self.host)
        end = time.perf_counter()
        self.busy_seconds += end - start
        if isinstance(command, Update):
            self.updates.append((start, end))
            del self.updates[:-10_000]
        self._seq += 1
        return self._seq

    post = send   # in process, nothing reads messages: sending is posting

    def done(self, seq: int) -> bool:
        return True

    def wait(self, seq: int | None = None) -> float:
        return 0.0

    @property
    def last_update_seconds(self) -> float:
        # In process, nothing overlaps the update: there is no host time to hide.
        return 0.0

    def check(self) -> None:
        """Raise if the runner can no longer run commands (never, in process)."""

    def unfinished(self) -> list[HostCommand]:
        return []

    def close(self) -> None:
        pass
