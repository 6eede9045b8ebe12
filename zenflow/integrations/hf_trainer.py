"""A Hugging Face `TrainerCallback` that installs ZenFlow's in-flight host update before the
Trainer evaluates or saves, and when training ends (so `trainer.save_model()` and a later
`trainer.evaluate()` see the current weights); with `attach=True`, when training begins it also
attaches the model to the optimizer (`ZenFlowAdamW.attach`: each block's forward waits only for
its own weights' install, and code that reads the weights between a step and the next forward
calls `wait_for_install()` first). Needs transformers."""
from __future__ import annotations

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError("ZenFlowTrainerCallback needs transformers, which is not installed: "
                      "pip install 'transformers>=4.41'") from exc

from zenflow.integrations.find import find_optimizers, synchronize


class ZenFlowTrainerCallback(TrainerCallback):
    """`Trainer(..., callbacks=[ZenFlowTrainerCallback()])`.

    The Trainer decides in on_step_end/on_epoch_end (its DefaultFlowCallback runs first) whether
    it will now evaluate or save; this callback runs after it, sees that decision, and installs the
    pending update only then, so steps that neither evaluate nor save keep the overlap.
    `attach`: see the module doc (off by default: every read after a step sees the installed
    weights).
    """

    def __init__(self, attach: bool = False):
        self.attach = attach

    def _sync_if_reading(self, state, control, optimizer) -> None:
        reading = (control.should_evaluate or control.should_save
                   or control.should_training_stop
                   or (state.max_steps and state.global_step >= state.max_steps))
        if reading and optimizer is not None:
            synchronize(optimizer)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is not None and self.attach:
            for zenflow_optimizer in find_optimizers(optimizer):
                zenflow_optimizer.attach(model)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self._sync_if_reading(state, control, optimizer)

    def on_epoch_end(self, args, state, control, optimizer=None, **kwargs):
        self._sync_if_reading(state, control, optimizer)

    def on_train_end(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None:
            synchronize(optimizer)
