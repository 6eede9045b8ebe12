"""A Lightning `Callback` that installs ZenFlow's in-flight host update before validation, test
and prediction, at the end of training, and in every checkpoint Lightning writes; with
`attach=True`, when training starts it also attaches the LightningModule to the optimizer
(`ZenFlowAdamW.attach`: each block's forward waits only for its own weights' install, and code
that reads the weights between a step and the next forward, such as Lightning's
StochasticWeightAveraging, calls `wait_for_install()` first). Needs lightning (or
pytorch_lightning)."""
from __future__ import annotations

try:
    from lightning.pytorch import Callback
except ImportError:  # pragma: no cover - the older package name
    try:
        from pytorch_lightning import Callback
    except ImportError as exc:
        raise ImportError("ZenFlowLightningCallback needs Lightning, which is not installed: "
                          "pip install 'lightning>=2.2'") from exc

from zenflow.integrations.find import find_optimizers


class ZenFlowLightningCallback(Callback):
    """`lightning.pytorch.Trainer(..., callbacks=[ZenFlowLightningCallback()])`; `attach`: see
    the module doc (off by default: every read after a step sees the installed weights)."""

    def __init__(self, attach: bool = False):
        super().__init__()
        self.attach = attach

    @staticmethod
    def _sync(trainer) -> bool:
        optimizers = find_optimizers(list(trainer.optimizers))
        for optimizer in optimizers:
            optimizer.synchronize()
        return bool(optimizers)

    def on_train_start(self, trainer, pl_module):
        if self.attach:
            for optimizer in find_optimizers(list(trainer.optimizers)):
                optimizer.attach(pl_module)

    def on_validation_start(self, trainer, pl_module):
        self._sync(trainer)

    def on_test_start(self, trainer, pl_module):
        self._sync(trainer)

    def on_predict_start(self, trainer, pl_module):
        self._sync(trainer)

    def on_train_end(self, trainer, pl_module):
        self._sync(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        # Lightning calls this last, after it has collected the weights and optimizer states;
        # install the pending update and collect both again, so the file holds the current
        # weights with an optimizer state that has nothing pending (the run resumes from it
        # exactly as the saving run continues).
        if not self._sync(trainer):
            return
        checkpoint["state_dict"] = trainer.strategy.lightning_module_state_dict()
        if "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = [trainer.strategy.optimizer_state(o)
                                              for o in trainer.optimizers]
