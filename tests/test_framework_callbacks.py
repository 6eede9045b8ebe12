"""The shipped framework callbacks: with them, everything HF Trainer and Lightning evaluate or save
is the synchronized model (installing the pending update right then changes nothing); without
them it would not be (checked, so the tests cannot pass vacuously). Also find_optimizer behind
the frameworks' wrappers. Models, data and settings come from helpers/integrations.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zenflow

transformers = pytest.importorskip("transformers")
L = pytest.importorskip("lightning.pytorch")
accelerate = pytest.importorskip("accelerate")

from helpers.integrations import ZF, LitModule, TokenDataset, mlp, tiny_bert, xy  # noqa: E402


def _weights(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _pending_tensors(model: nn.Module, opt) -> list[str]:
    """Names of the tensors that installing the in-flight update would change (it installs it)."""
    before = _weights(model)
    opt.synchronize()
    return [k for k, v in model.state_dict().items() if not torch.equal(before[k], v)]


class EvalSaveRecorder(transformers.TrainerCallback):
    """Runs after evaluation and saving: what was evaluated/saved vs the synchronized weights."""

    def __init__(self, opt):
        self.opt, self.stale_at_eval, self.stale_at_save, self.events = opt, [], [], []

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        self.events.append(("evaluate", state.global_step))
        self.stale_at_eval += _pending_tensors(model, self.opt)

    def on_save(self, args, state, control, model=None, **kwargs):
        from safetensors.torch import load_file
        self.events.append(("save", state.global_step))
        saved = load_file(f"{args.output_dir}/checkpoint-{state.global_step}/model.safetensors")
        self.opt.synchronize()
        current = model.state_dict()
        self.stale_at_save += [k for k in saved if not torch.equal(saved[k], current[k])]


def trainer_with_recorder(out_dir, with_callback: bool):
    from zenflow.integrations import ZenFlowTrainerCallback
    model = tiny_bert()
    opt = zenflow.ZenFlowAdamW(model.parameters(), **ZF)
    recorder = EvalSaveRecorder(opt)
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), max_steps=12, eval_strategy="steps", eval_steps=5,
        save_strategy="steps", save_steps=6, per_device_train_batch_size=4,
        per_device_eval_batch_size=8, report_to=[], use_cpu=True, seed=0, logging_steps=100,
        disable_tqdm=True, dataloader_num_workers=0)
    callbacks = ([ZenFlowTrainerCallback(attach=True)] if with_callback else []) + [recorder]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(),
                                   eval_dataset=TokenDataset(n=8, seed=1),
                                   optimizers=(opt, None), callbacks=callbacks)
    return trainer, model, opt, recorder


@pytest.mark.slow
def test_hf_trainer_callback_evaluates_and_saves_synchronized_weights(tmp_path):
    from safetensors.torch import load_file
    trainer, model, opt, recorder = trainer_with_recorder(tmp_path / "with", True)
    try:
        trainer.train()
        assert model in opt._installs._attached   # each layer waits for its own install
        assert ("evaluate", 5) in recorder.events and ("save", 6) in recorder.events
        assert recorder.stale_at_eval == [] and recorder.stale_at_save == []
        trainer.save_model(str(tmp_path / "final"))
        saved = load_file(tmp_path / "final" / "model.safetensors")
        assert _pending_tensors(model, opt) == []
        current = model.state_dict()
        assert saved.keys() == current.keys()
        for k in current:
            assert torch.equal(saved[k], current[k]), k
    finally:
        opt.close()

    trainer, model, opt, recorder = trainer_with_recorder(tmp_path / "without", False)
    try:
        trainer.train()
        assert recorder.stale_at_eval, "without the callback, evaluation sees stale weights"
        assert recorder.stale_at_save, "without the callback, checkpoints hold stale weights"
    finally:
        opt.close()


class LitWithValidation(LitModule):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)


class LitRecorder(L.Callback):
    def __init__(self):
        self.stale_at_validation, self.stale_in_checkpoint, self.validations = [], [], 0

    def on_validation_start(self, trainer, pl_module):
        self.validations += 1
        self.stale_at_validation += _pending_tensors(pl_module, pl_module.optimizer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        pl_module.optimizer.synchronize()
        current = pl_module.state_dict()
        self.stale_in_checkpoint += [k for k, v in checkpoint["state_dict"].items()
                                     if not torch.equal(v, current[k])]


def lit_fit_recorded(root, with_callback: bool):
    from zenflow.integrations import ZenFlowLightningCallback
    module, recorder = LitWithValidation(), LitRecorder()
    callbacks = ([ZenFlowLightningCallback(attach=True)] if with_callback else []) + [recorder]
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(root),
                        num_sanity_val_steps=0, callbacks=callbacks)
    train = torch.utils.data.DataLoader(xy(), batch_size=4, shuffle=False)
    val = torch.utils.data.DataLoader(xy(n=8, seed=1), batch_size=8)
    trainer.fit(module, train, val)
    return module, trainer, recorder


@pytest.mark.slow
def test_lightning_callback_validates_and_checkpoints_synchronized_weights(tmp_path):
    module, trainer, recorder = lit_fit_recorded(tmp_path, with_callback=True)
    try:
        trainer.save_checkpoint(tmp_path / "final.ckpt")
        assert module in module.optimizer._installs._attached
        assert recorder.validations == 2 and recorder.stale_at_validation == []
        assert recorder.stale_in_checkpoint == []
        saved = torch.load(tmp_path / "final.ckpt", weights_only=False)["state_dict"]
        assert _pending_tensors(module, module.optimizer) == []
        current = module.state_dict()
        assert saved.keys() == current.keys()
        for k in current:
            assert torch.equal(saved[k], current[k]), k
    finally:
        module.optimizer.close()

    module, trainer, recorder = lit_fit_recorded(tmp_path, with_callback=False)
    try:
        assert recorder.stale_at_validation, "without the callback, validation sees stale weights"
    finally:
        module.optimizer.close()


def test_find_optimizer_through_wrappers():
    from zenflow.integrations import synchronize
    model = mlp()
    opt = zenflow.ZenFlowAdamW(model.parameters(), worker=False, **ZF)
    try:
        assert zenflow.find_optimizer(opt) is opt
        acc = accelerate.Accelerator(cpu=True)
        _, wrapped = acc.prepare(model, opt)
        assert type(wrapped).__name__ == "AcceleratedOptimizer"
        assert zenflow.find_optimizer(wrapped) is opt
        assert synchronize(wrapped) == 1
        from lightning.pytorch.core.optimizer import LightningOptimizer
        assert zenflow.find_optimizer(LightningOptimizer(opt)) is opt
        assert zenflow.find_optimizer(types_namespace(trainer=types_namespace(
            optimizers=[opt]))) is opt
        with pytest.raises(ValueError, match="no ZenFlowAdamW/OffloadAdamW found in a SGD"):
            zenflow.find_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        second = zenflow.OffloadAdamW(mlp().parameters())
        with pytest.raises(ValueError, match="2 ZenFlowAdamW/OffloadAdamW found"):
            zenflow.find_optimizer([opt, second])
        assert zenflow.find_optimizers([opt, second]) == [opt, second]
    finally:
        opt.close()


def types_namespace(**kw):
    import types
    return types.SimpleNamespace(**kw)


@pytest.mark.slow
def test_hf_trainer_builds_zenflow_from_optimizer_cls_and_kwargs(tmp_path):
    """The documented route (TrainingArguments(optim=...) knows only HF's optimizers): the Trainer
    builds ZenFlowAdamW itself, and the callback finds it behind Accelerate's wrapper."""
    from safetensors.torch import load_file

    from zenflow.integrations import ZenFlowTrainerCallback
    model = tiny_bert()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=5, save_strategy="no", report_to=[], use_cpu=True,
        per_device_train_batch_size=4, seed=0, disable_tqdm=True, dataloader_num_workers=0,
        weight_decay=0.05)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=TokenDataset(),
        optimizer_cls_and_kwargs=(zenflow.ZenFlowAdamW, dict(ZF)),
        callbacks=[ZenFlowTrainerCallback()])
    trainer.train()
    opt = zenflow.find_optimizer(trainer.optimizer)
    try:
        assert trainer.optimizer is not opt  # wrapped by Accelerate
        # HF's groups: no weight decay for biases and LayerNorm weights
        assert sorted(g["weight_decay"] for g in opt.param_groups) == [0.0, 0.05]
        trainer.save_model(str(tmp_path / "final"))
        saved = load_file(tmp_path / "final" / "model.safetensors")
        assert _pending_tensors(model, opt) == []
        for k, v in model.state_dict().items():
            assert torch.equal(saved[k], v), k
    finally:
        opt.close()
