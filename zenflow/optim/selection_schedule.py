"""When to choose each matrix's device columns again: every so many steps, or when the selection
has drifted (the "auto" interval)."""
from __future__ import annotations


class SelectionSchedule:
    """Decides, at a window boundary, whether to choose the columns again.

    `every_steps` reselects when that many steps have passed since the last selection (at the
    first window boundary at or after it). `drift_threshold` (the "auto" interval) reselects when
    the selected columns hold less than this fraction of the importance the best columns would
    hold; checks back off while the selection stays good, since important columns are
    temporally local.
    """

    def __init__(self, every_steps: int | None = None, drift_threshold: float | None = None,
                 max_check_gap: int = 8):
        if (every_steps is None) == (drift_threshold is None):
            raise ValueError("give exactly one of every_steps and drift_threshold")
        self.every_steps = every_steps
        self.drift_threshold = drift_threshold
        self.max_check_gap = max_check_gap
        self.last_selection_step = 0
        self.check_gap = 1          # windows between drift checks
        self.windows_since_check = 0
        self.last_retained = 1.0

    @classmethod
    def for_settings(cls, settings, owner: str) -> SelectionSchedule:
        """The schedule that a ZenFlowSettings asks for (`owner` names the optimizer in errors)."""
        if settings.select_interval == "auto":
            return cls(drift_threshold=settings.reselect_threshold)
        if settings.select_strategy == "epoch":
            if settings.steps_per_epoch is None:
                raise ValueError(f"{owner}: select_strategy=\"epoch\" with select_interval="
                                 f"{settings.select_interval} needs steps_per_epoch")
            return cls(every_steps=settings.select_interval * settings.steps_per_epoch)
        return cls(every_steps=settings.select_interval)

    def selected(self, step: int) -> None:
        self.last_selection_step = step
        self.check_gap = 1
        self.windows_since_check = 0

    def window_passed(self) -> None:
        """Count a window boundary since the last drift check (the checks back off in windows)."""
        if self.drift_threshold is not None:
            self.windows_since_check += 1

    def check_due(self, step: int) -> bool:
        """Whether this window boundary should look at the selection (cheap, no tensors)."""
        if self.every_steps is not None:
            return step - self.last_selection_step >= self.every_steps
        return self.windows_since_check >= self.check_gap

    def reselection_due(self, retained: float | None) -> bool:
        """Given the retained-importance figure (None for interval schedules), is it time?"""
        return self.every_steps is not None or retained < self.drift_threshold

    def drift_checked(self, retained: float) -> None:
        """A drift check found `retained`: while the selection stays good, check less often."""
        self.windows_since_check = 0
        self.last_retained = retained
        if retained >= self.drift_threshold:
            self.check_gap = min(self.max_check_gap, self.check_gap * 2)

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("last_selection_step", "check_gap",
                                               "windows_since_check", "last_retained")}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
