"""When a host window ends: after a fixed number of steps, or when the deferred gradients matter.

The "auto" criterion. Each step splits every matrix's gradient into the selected columns K (updated
now, on the device) and the deferred columns U (summed on the host). Per column, the deferred
gradient is small next to the selected one: that is why the columns were chosen. Let

    r_t = rms_column_norm(g_U at step t) / rms_column_norm(g_K at step t)

where rms_column_norm is sqrt(sum of squared column norms / number of columns), pooled over all
matrices. Summing r_t over the window measures how much gradient each deferred column has
gathered, in units of what an important column receives (and is applied) in one step. The
window ends when that sum reaches `threshold` (DeepSpeed's `auto_ratio`, default 0.99): the
deferred columns have, on average, as much pending gradient as one device update of an important
column carries. Because both sides are per-column averages, the criterion does not depend on
topk_ratio or on layer widths; with 10% selected and r_t ~ 0.3 it gives windows of ~4 steps. Every
quantity comes from norms the step already has (the clipping norm of each gradient and the norm
of the gathered selected columns), so no extra pass over the gradients is needed.

Bounds: windows are at least `min_steps` and at most `max_steps` long. With overlap, the window
is also at least as long as it takes to hide the host update behind the device's steps
(host seconds / step seconds, measured) and long enough that what a window costs whatever its
length (installing its result, a copy the device waits for, and its own work at its start and
end: the outside writes' fingerprints, the installs' corrections) takes at most WINDOW_BUDGET of
its time; and it ends early only if the host is ready: a longer window is chosen over a stall,
up to `max_steps`.

With `threshold=None` (ZenFlowAdamW's default) there is no importance criterion: a window ends as
soon as those bounds allow, so windows are as short as the host keeps up with. Short windows are
what fine-tuning quality asks for (a window's update reaches the device one window late, as one
AdamW step; benchmarks/finetune_quality.py), and waiting for the host keeps the step stall-free.
"""
from __future__ import annotations

import math
import time
from typing import Protocol

# The share of the device's time that a window's fixed costs may take (with overlap): its
# install and its own work at its start and end. On a GPU the install is a host-to-device copy
# of the deferred columns that compute waits for: one window of a 7B model in bf16 is ~12.6 GB,
# ~0.25-0.5 s over PCIe, so one-step windows would spend 15-30% of a 1.7 s step copying; on a
# CPU "device" the window's fingerprints (passes over every matrix) cost most. A longer window
# stalls less and learns less: each step a window is shorter is worth about a tenth of a point
# of held-out loss in bf16 (the fine-tune, benchmarks/README.md). 8% is the most that keeps the
# defaults' step within 1.10x of AdamW's on one H100 and four A100s (zenflow estimate,
# Llama-2-7B): 3-step windows with the model attached, 7 without; at 5% they were 5 and 10.
WINDOW_BUDGET = 0.08


class WindowRule(Protocol):
    """Decides, after each step, whether the host window ends. Adding a rule: a class here, its
    setting in zenflow/config (settings and rules), `window_for`, and a test."""

    # Whether the rule's answer can differ between ranks (it reads timings): the optimizer then
    # ends the window only when every rank's rule says so (`DelayedAgreement`).
    needs_rank_agreement: bool
    # Whether observe() wants the deferred and selected columns' squared norms each step.
    watches_importance: bool
    last_interval: int | None   # length of the last window
    reason: str                 # why the last window ended, for the log

    def observe(self, deferred_sq: float, deferred_cols: int, selected_sq: float,
                selected_cols: int) -> None: ...

    def should_end(self, window_steps: int, host_ready: bool, host_seconds: float,
                   step_seconds: float, install_seconds: float = 0.0,
                   work_seconds: float = 0.0) -> bool:
        """`install_seconds`, `work_seconds`: the device's time in the last window's install
        and in its own work (Transfers.last_install_wait_seconds, last_window_work_seconds)."""
        ...

    def must_end(self, window_steps: int) -> bool:
        """Whether a window of `window_steps` steps ends whatever the timings (the same answer
        on every rank)."""
        ...

    def ended(self, steps: int) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class FixedWindow:
    """Windows of exactly `steps` steps."""

    needs_rank_agreement = False
    watches_importance = False

    def __init__(self, steps: int):
        self.steps = steps
        self.last_interval = None
        self.reason = ""

    def observe(self, deferred_sq: float, deferred_cols: int, selected_sq: float,
                selected_cols: int) -> None:
        pass

    def should_end(self, window_steps: int, host_ready: bool, host_seconds: float,
                   step_seconds: float, install_seconds: float = 0.0,
                   work_seconds: float = 0.0) -> bool:
        self.reason = f"fixed interval {self.steps}"
        return window_steps >= self.steps

    def must_end(self, window_steps: int) -> bool:
        return window_steps >= self.steps

    def ended(self, steps: int) -> None:
        """The window ended after `steps` steps."""
        self.last_interval = steps

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class AutoWindow:
    """Ends a window within its bounds once the host is ready and, with a threshold, once the
    deferred columns' summed gradient reaches one important step."""

    needs_rank_agreement = True   # host timings differ between ranks

    def __init__(self, threshold: float | None = 0.99, min_steps: int = 1, max_steps: int = 16,
                 overlap: bool = True):
        self.threshold = threshold
        self.watches_importance = threshold is not None
        self.min_steps = min_steps
        self.max_steps = max_steps
        self.overlap = overlap
        self.pending_importance = 0.0  # sum of r_t over the current window
        self.last_interval = None      # length of the last window
        self.reason = ""
        # Benchmark-only, never a setting: treat every host update as taking at least this many
        # device steps, so a CPU machine (whose host keeps up after one step) runs the windows a
        # GPU would (zenflow.tools.finetune.optim.make_optimizer's emulated_host_steps). Not saved
        # in state_dict().
        self.emulated_host_steps = 0

    def observe(self, deferred_sq: float, deferred_cols: int, selected_sq: float,
                selected_cols: int) -> None:
        """Add step t's r_t from the squared norms of the deferred and selected columns."""
        if deferred_cols == 0:
            return
        deferred = math.sqrt(max(deferred_sq, 0.0) / deferred_cols)
        if selected_cols == 0 or selected_sq <= 0.0:
            self.pending_importance = math.inf  # nothing on the device: defer as little as allowed
            return
        self.pending_importance += deferred / math.sqrt(selected_sq / selected_cols)

    def hide_steps(self, host_seconds: float, step_seconds: float, install_seconds: float = 0.0,
                   work_seconds: float = 0.0) -> int:
        """Steps a window needs (overlap only) to cover one host update with the device's steps
        and to keep its fixed costs (its install, and its own work) within WINDOW_BUDGET of the
        window's time. An emulated GPU's host counts no window work: this CPU's passes over
        every matrix are not a GPU's (a few milliseconds at Llama-2-7B: zenflow estimate)."""
        if not self.overlap:
            return 1
        if step_seconds <= 0.0:
            return max(1, self.emulated_host_steps)
        cover = max(math.ceil(host_seconds / step_seconds), self.emulated_host_steps)
        fixed = install_seconds + (0.0 if self.emulated_host_steps else work_seconds)
        return max(1, cover, math.ceil(fixed / (WINDOW_BUDGET * step_seconds)))

    def should_end(self, window_steps: int, host_ready: bool, host_seconds: float,
                   step_seconds: float, install_seconds: float = 0.0,
                   work_seconds: float = 0.0) -> bool:
        if window_steps >= self.max_steps:
            self.reason = f"reached max_steps={self.max_steps}"
            return True
        floor = max(self.min_steps, min(self.max_steps, self.hide_steps(
            host_seconds, step_seconds, install_seconds, work_seconds)))
        if window_steps < floor:
            return False
        if self.threshold is not None and self.pending_importance < self.threshold:
            return False
        if self.overlap and not host_ready:
            return False  # ending now would stall on the previous window; keep accumulating
        if self.threshold is None:
            self.reason = f"host ready after {window_steps} steps (floor {floor})"
        else:
            self.reason = (f"deferred importance {self.pending_importance:.3g} >= "
                           f"{self.threshold} after {window_steps} steps (floor {floor})")
        return True

    def must_end(self, window_steps: int) -> bool:
        return window_steps >= self.max_steps

    def ended(self, steps: int) -> None:
        """The window ended after `steps` steps: the deferred columns start afresh."""
        self.last_interval = steps
        self.pending_importance = 0.0

    def state_dict(self) -> dict:
        return {"pending_importance": self.pending_importance, "last_interval": self.last_interval}

    def load_state_dict(self, state: dict) -> None:
        self.pending_importance = state["pending_importance"]
        self.last_interval = state["last_interval"]


class DelayedAgreement:
    """Under data parallel, ends a window one step after every rank's rule said it may end,
    without making any step wait for the other ranks: each step starts an all-reduce of its
    rule's answer (`Partition.start_any`) and reads the one the step before started, long
    finished. Every rank reads the same votes, so every rank ends the same windows; a bound that
    every rank computes alike (`forced`: max_steps, a reselection) ends the window at once. A
    vote in flight is not saved with the state: a run resumed mid-window votes afresh."""

    def __init__(self, partition):
        self.partition = partition
        self._previous = None   # the last step's vote: () -> whether some rank was not ready

    def ends(self, ready: bool, forced: bool) -> bool:
        previous, self._previous = self._previous, None
        if forced or (previous is not None and not previous()):
            return True
        self._previous = self.partition.start_any(not ready, "agreeing on the end of a host "
                                                  "window")
        return False

    def forget(self) -> None:
        """Drop the vote in flight (the window it was about ended, or a state was loaded)."""
        self._previous = None


class StepPeriod:
    """The time between step() calls, a moving average: how fast the device covers a host
    update (AutoWindow.hide_steps)."""

    def __init__(self):
        self.seconds = 0.0
        self._last = None

    def tick(self) -> None:
        """A step starts now."""
        now = time.perf_counter()
        if self._last is not None:
            period = now - self._last
            self.seconds = period if self.seconds == 0.0 else 0.8 * self.seconds + 0.2 * period
        self._last = now


def window_for(settings) -> WindowRule:
    """The window that a ZenFlowSettings asks for."""
    if settings.update_interval == "auto":
        return AutoWindow(settings.auto_ratio, *settings.auto_update_bounds,
                          overlap=settings.overlap_step)
    return FixedWindow(settings.update_interval)
