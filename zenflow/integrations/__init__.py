"""ZenFlow inside training frameworks: current weights at evaluation and saving, and the optimizer
behind the frameworks' wrappers.

    # Hugging Face Trainer (TrainingArguments(optim=...) only knows HF's own optimizers; pass
    # the class, and the Trainer builds it with its usual no-weight-decay groups)
    from zenflow.integrations import ZenFlowTrainerCallback
    trainer = Trainer(..., optimizer_cls_and_kwargs=(zenflow.ZenFlowAdamW, {"lr": 2e-5}),
                      callbacks=[ZenFlowTrainerCallback()])

    # PyTorch Lightning
    from zenflow.integrations import ZenFlowLightningCallback
    trainer = lightning.pytorch.Trainer(..., callbacks=[ZenFlowLightningCallback()])

    # Accelerate (or any wrapper): reach synchronize()/stats()/close()
    zenflow.find_optimizer(accelerated_optimizer).stats()

With `overlap_step`, a window's host update is installed one window later; the callbacks call
`synchronize()` right before the framework evaluates or saves, so what is evaluated and written is
the current model. Training itself keeps the overlap.

The callback classes are built on first use, so importing this module needs neither framework.
"""
from __future__ import annotations

from zenflow.integrations.find import find_optimizer, find_optimizers, synchronize


def __getattr__(name: str):
    if name == "ZenFlowTrainerCallback":
        from zenflow.integrations.hf_trainer import ZenFlowTrainerCallback
        return ZenFlowTrainerCallback
    if name == "ZenFlowLightningCallback":
        from zenflow.integrations.lightning_callback import ZenFlowLightningCallback
        return ZenFlowLightningCallback
    raise AttributeError(f"module 'zenflow.integrations' has no attribute {name!r}")


__all__ = ["find_optimizer", "find_optimizers", "synchronize", "ZenFlowTrainerCallback",
           "ZenFlowLightningCallback"]
