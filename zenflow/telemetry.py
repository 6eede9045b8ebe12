"""Per-step timings of the training process: time inside step() and time blocked on the host."""
from __future__ import annotations

import statistics
import time
from collections import deque


class StepTimer:
    """Records, for each step, the seconds spent in step() and the part of it spent stalled
    (blocked waiting for the host). Keeps the last `history` steps for timelines."""

    def __init__(self, history: int = 10_000):
        self.records: deque[dict] = deque(maxlen=history)
        self._start = None
        self._stall = 0.0
        self.total_step_s = 0.0
        self.total_stall_s = 0.0
        self.timed_steps = 0

    def begin(self) -> None:
        self._start = time.perf_counter()
        self._stall = 0.0

    def stall(self, seconds: float) -> None:
        """Add blocked time; outside a step (state_dict, synchronize) it counts in the totals."""
        self._stall += seconds
        if self._start is None:
            self.total_stall_s += seconds
            self._stall = 0.0

    def end(self, skipped: bool = False) -> None:
        end = time.perf_counter()
        step_s = end - self._start
        self.records.append({"start": self._start, "end": end, "step_s": step_s,
                             "stall_s": self._stall, "skipped": skipped})
        self.total_step_s += step_s
        self.total_stall_s += self._stall
        self.timed_steps += 1
        self._start = None
        self._stall = 0.0

    def summary(self) -> dict:
        steps = [r["step_s"] for r in self.records]
        stalls = [r["stall_s"] for r in self.records]
        return {
            "timed_steps": self.timed_steps,
            "step_s_total": self.total_step_s,
            "stall_s_total": self.total_stall_s,
            "step_s_median": statistics.median(steps) if steps else 0.0,
            "stall_s_median": statistics.median(stalls) if stalls else 0.0,
            "stall_s_mean": statistics.fmean(stalls) if stalls else 0.0,
        }
