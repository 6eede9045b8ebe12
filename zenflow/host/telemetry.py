"""Per-step telemetry of the training process: time inside step(), the part of it spent on offload
work (queuing copies, handing work to the host), the part spent blocked on the host (the stall),
and bytes copied device->host and host->device, in the parameters' dtype. Records carry
perf_counter() times, which are system-wide on Linux, so they line up with the worker's (start,
end) pairs on one timeline."""
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
        self._offload = 0.0
        self._d2h = 0
        self._h2d = 0
        self.total_d2h_bytes = 0
        self.total_h2d_bytes = 0
        self.total_step_s = 0.0
        self.total_stall_s = 0.0
        self.total_offload_s = 0.0
        self.timed_steps = 0

    def begin(self) -> None:
        self._start = time.perf_counter()
        self._stall = 0.0
        self._offload = 0.0
        self._d2h = self._h2d = 0

    def moved(self, d2h: int = 0, h2d: int = 0) -> None:
        """Count bytes copied device->host / host->device (outside a step: totals only)."""
        self.total_d2h_bytes += d2h
        self.total_h2d_bytes += h2d
        if self._start is not None:
            self._d2h += d2h
            self._h2d += h2d

    def stall(self, seconds: float) -> None:
        """Add blocked time; outside a step (state_dict, synchronize) it counts in the totals."""
        self._stall += seconds
        if self._start is None:
            self.total_stall_s += seconds
            self._stall = 0.0

    def offload(self, seconds: float) -> None:
        """Add training-thread time spent on offload work (not blocked: queuing and handing off)."""
        self._offload += seconds
        if self._start is None:
            self.total_offload_s += seconds
            self._offload = 0.0

    def end(self, skipped: bool = False) -> None:
        end = time.perf_counter()
        step_s = end - self._start
        self.records.append({"start": self._start, "end": end, "step_s": step_s,
                             "stall_s": self._stall, "offload_s": self._offload,
                             "d2h_bytes": self._d2h,
                             "h2d_bytes": self._h2d, "skipped": skipped})
        self.total_step_s += step_s
        self.total_stall_s += self._stall
        self.total_offload_s += self._offload
        self.timed_steps += 1
        self._start = None
        self._stall = 0.0
        self._offload = 0.0

    def summary(self) -> dict:
        steps = [r["step_s"] for r in self.records]
        stalls = [r["stall_s"] for r in self.records]
        offload = [r["offload_s"] for r in self.records]
        return {
            "timed_steps": self.timed_steps,
            "step_s_total": self.total_step_s,
            "stall_s_total": self.total_stall_s,
            "step_s_median": statistics.median(steps) if steps else 0.0,
            "stall_s_median": statistics.median(stalls) if stalls else 0.0,
            "stall_s_mean": statistics.fmean(stalls) if stalls else 0.0,
            "offload_s_total": self.total_offload_s,
            "offload_s_median": statistics.median(offload) if offload else 0.0,
            "d2h_bytes_total": self.total_d2h_bytes,
            "h2d_bytes_total": self.total_h2d_bytes,
            "d2h_bytes_per_step": self.total_d2h_bytes / max(1, self.timed_steps),
            "h2d_bytes_per_step": self.total_h2d_bytes / max(1, self.timed_steps),
        }
