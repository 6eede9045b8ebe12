"""When to choose each matrix's device columns again: every so many steps, when the selection has
drifted, or never (select once and keep).

`select_strategy` (docs/knobs.md) resolves to one of these, as DeepSpeed resolves its own
(deepspeed/runtime/zenflow/engine.py, configure_zenflow):

    "step"   every `select_interval` steps
    "epoch"  every `select_interval * steps_per_epoch` steps
    "auto"   every `steps_per_epoch` steps (DeepSpeed's "auto" is "epoch" with interval 1)
    "drift"  ours: when the selected columns hold less than `reselect_threshold` of the
             importance the best columns would hold

"epoch" and "auto" without an epoch length select once and keep the columns, as DeepSpeed does
without a dataloader, and say so in a warning (DeepSpeed says nothing).
"""
from __future__ import annotations

import logging

log = logging.getLogger("zenflow")


class SelectionSchedule:
    """Decides, at a window boundary, whether to choose the columns again.

    `every_steps` reselects at each step that is a multiple of it (as DeepSpeed does: steps 0,
    N, 2N, ..., counting only the steps taken), whatever the windows: the optimizer ends the
    window in progress one step before (`due_at`), so that the reselection sits on a window
    boundary. `drift_threshold` reselects, at a window boundary, when the selected columns hold
    less than this fraction of the importance the best columns would hold; checks back off while
    the selection stays good, since important columns are temporally local. Neither: the
    first selection is kept.
    """

    def __init__(self, every_steps: int | None = None, drift_threshold: float | None = None,
                 max_check_gap: int = 8, description: str = ""):
        if every_steps is not None and drift_threshold is not None:
            raise ValueError("give at most one of every_steps and drift_threshold")
        self.every_steps = every_steps
        self.drift_threshold = drift_threshold
        self.max_check_gap = max_check_gap
        self.description = description or self._describe()
        self.last_selection_step = 0
        self.check_gap = 1          # windows between drift checks
        self.windows_since_check = 0
        self.last_retained = 1.0

    def _describe(self) -> str:
        if self.every_steps is not None:
            return f"every {self.every_steps} steps"
        if self.drift_threshold is not None:
            return f"on drift (retained importance < {self.drift_threshold})"
        return "once (the first selection is kept)"

    @classmethod
    def resolve(cls, settings, owner: str) -> tuple[SelectionSchedule, str | None]:
        """The schedule that a ZenFlowSettings asks for, and a warning to give, if any (`owner`
        names the optimizer or the config block in it)."""
        strategy = settings.select_strategy
        if strategy == "drift":
            return cls(drift_threshold=settings.reselect_threshold), None
        if strategy == "step":
            return cls(every_steps=settings.select_interval), None
        epochs = 1 if strategy == "auto" else settings.select_interval
        if settings.steps_per_epoch is None:
            # DeepSpeed (select_interval = 0) selects once, silently; a run that never
            # reselects should know it.
            once = cls(description=f'once (select_strategy="{strategy}" with no epoch length; '
                       f"given one, every {epochs} epoch(s))")
            return once, (
                f'{owner}: select_strategy="{strategy}" reselects every {epochs} epoch(s), but '
                "no epoch length is known, so the columns are selected once and kept (as "
                "DeepSpeed does without a dataloader). Pass training_data to initialize or set "
                'steps_per_epoch; select_strategy="step" or "drift" need no epoch length')
        every = epochs * settings.steps_per_epoch
        return cls(every_steps=every, description=(
            f"every {every} steps ({epochs} epoch(s) of {settings.steps_per_epoch} steps)")), None

    @classmethod
    def for_settings(cls, settings, owner: str) -> SelectionSchedule:
        """`resolve`, with its warning logged."""
        schedule, warning = cls.resolve(settings, owner)
        if warning is not None:
            log.warning(warning)
        return schedule

    def due_at(self, step: int) -> bool:
        """Whether an interval schedule reselects at `step` (known in advance: the optimizer
        ends the window before it)."""
        return (self.every_steps is not None and step % self.every_steps == 0
                and step > self.last_selection_step)

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
            return self.due_at(step)
        if self.drift_threshold is not None:
            return self.windows_since_check >= self.check_gap
        return False

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
