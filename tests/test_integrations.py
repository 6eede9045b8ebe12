"""ZenFlowAdamW inside the frameworks people train with: Hugging Face Trainer, PyTorch Lightning and
Hugging Face Accelerate. Each test runs a few steps of a tiny model with the asynchronous path on
(overlap_step, update_interval > 1, a real top-k split), and checks that ZenFlow's state survives
the framework's own checkpointing: a resumed run ends with exactly the weights of an
uninterrupted one."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zenflow

ZF = dict(lr=1e-2, weight_decay=0.01, topk_ratio=0.25, update_interval=2, overlap_step=True,
          select_strategy="step", select_interval=4)


def assert_same_weights(a: nn.Module, b: nn.Module, atol=0.0):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=atol, msg=f"parameter {k} differs")


def weights_changed(before: dict, model: nn.Module) -> bool:
    return any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


# ----------------------------------------------------------------------------- HF Trainer
transformers = pytest.importorskip("transformers")


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n=32, length=12, vocab=64, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(4, vocab, (n, length), generator=g)
        self.labels = (self.ids[:, 0] % 2).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]),
                "labels": self.labels[i]}


def tiny_bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=16, num_labels=2,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg)


def run_trainer(out_dir, resume_from=None, max_steps=8):
    model = tiny_bert()
    opt = zenflow.ZenFlowAdamW([p for p in model.parameters() if p.requires_grad], **ZF)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), max_steps=max_steps, save_steps=4, save_strategy="steps",
        per_device_train_batch_size=4, report_to=[], use_cpu=True, seed=0, logging_steps=100,
        disable_tqdm=True, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(),
                                   optimizers=(opt, sched))
    try:
        before = copy.deepcopy(model.state_dict())
        trainer.train(resume_from_checkpoint=resume_from)
        opt.synchronize()
        assert weights_changed(before, model)
        return model, opt.state_dict(), sched.get_last_lr()
    finally:
        opt.close()


@pytest.mark.slow
def test_hf_trainer_resume_matches_uninterrupted(tmp_path):
    full, full_state, full_lr = run_trainer(tmp_path / "a")
    ckpt = tmp_path / "a" / "checkpoint-4"
    assert (ckpt / "optimizer.pt").is_file() and (ckpt / "scheduler.pt").is_file()
    # The Trainer reloads optimizer.pt with torch.load(weights_only=True): ZenFlow's state must
    # be plain tensors and containers for that to work.
    torch.load(ckpt / "optimizer.pt", weights_only=True)
    resumed, resumed_state, resumed_lr = run_trainer(tmp_path / "b", resume_from=str(ckpt))
    assert resumed_lr == full_lr
    assert_same_weights(full, resumed)


# ----------------------------------------------------------------------------- Lightning
L = pytest.importorskip("lightning.pytorch")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def xy(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long())


class LitModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = mlp()
        self.closure_calls = 0
        self.optimizer = None

    def training_step(self, batch, batch_idx):
        # Lightning runs this inside the closure it passes to optimizer.step(closure=...).
        self.closure_calls += 1
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        self.optimizer = zenflow.ZenFlowAdamW(self.parameters(), **ZF)
        return self.optimizer


def lit_trainer(root, max_epochs):
    return L.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=str(root))


def lit_fit(root, max_epochs, ckpt_path=None):
    module = LitModule()
    trainer = lit_trainer(root, max_epochs)
    loader = torch.utils.data.DataLoader(xy(), batch_size=4, shuffle=False)
    try:
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        module.optimizer.synchronize()
        return module, trainer
    finally:
        if module.optimizer is not None:
            module.optimizer.close()


@pytest.mark.slow
def test_lightning_calls_closure_and_resumes(tmp_path):
    full, _ = lit_fit(tmp_path, max_epochs=2)
    # 32 samples / batch 4 = 8 steps per epoch; each step's loss came from Lightning's closure,
    # which only ZenFlowAdamW.step(closure) calls.
    assert full.closure_calls == 16
    assert full.trainer.global_step == 16

    first = LitModule()
    trainer = lit_trainer(tmp_path, max_epochs=1)
    loader = torch.utils.data.DataLoader(xy(), batch_size=4, shuffle=False)
    try:
        trainer.fit(first, loader)
        trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    finally:
        first.optimizer.close()
    saved = torch.load(tmp_path / "epoch1.ckpt", weights_only=False)
    assert len(saved["optimizer_states"]) == 1 and saved["optimizer_states"][0]["state"]

    resumed, _ = lit_fit(tmp_path, max_epochs=2, ckpt_path=str(tmp_path / "epoch1.ckpt"))
    assert resumed.closure_calls == 8
    assert_same_weights(full.net, resumed.net)


# ----------------------------------------------------------------------------- Accelerate
accelerate = pytest.importorskip("accelerate")


def accelerate_run(steps_micro, accum, ckpt_dir=None, save_at=None, resume=False):
    """`steps_micro` micro-batches with gradient accumulation `accum` under Accelerate."""
    from accelerate.utils import set_seed
    set_seed(0)
    acc = accelerate.Accelerator(gradient_accumulation_steps=accum, cpu=True)
    model = mlp()
    opt = zenflow.ZenFlowAdamW(model.parameters(), **ZF)
    model, opt = acc.prepare(model, opt)
    data = xy(n=4 * steps_micro)
    start = 0
    if resume:
        acc.load_state(str(ckpt_dir))
        start = save_at
    try:
        for i in range(start, steps_micro):
            x, y = data[4 * i: 4 * i + 4]
            with acc.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            if save_at is not None and not resume and i + 1 == save_at:
                acc.save_state(str(ckpt_dir))
        opt.optimizer.synchronize()
        return acc.unwrap_model(model), opt.optimizer
    finally:
        opt.optimizer.close()


def manual_run(steps_micro, accum):
    """The same training by hand: sum micro-batch gradients (each loss scaled by 1/accum, as
    Accelerate does), one ZenFlow step per `accum` micro-batches."""
    model = mlp()
    opt = zenflow.ZenFlowAdamW(model.parameters(), **ZF)
    data = xy(n=4 * steps_micro)
    try:
        for i in range(steps_micro):
            x, y = data[4 * i: 4 * i + 4]
            (nn.functional.cross_entropy(model(x), y) / accum).backward()
            if (i + 1) % accum == 0:
                opt.step()
                opt.zero_grad()
        opt.synchronize()
        return model
    finally:
        opt.close()


@pytest.mark.slow
def test_accelerate_gradient_accumulation_keeps_zenflow_semantics():
    model, _ = accelerate_run(steps_micro=16, accum=2)
    assert_same_weights(model, manual_run(steps_micro=16, accum=2), atol=1e-6)


@pytest.mark.slow
def test_accelerate_save_and_load_state_resumes(tmp_path):
    full, _ = accelerate_run(steps_micro=16, accum=2)
    accelerate_run(steps_micro=16, accum=2, ckpt_dir=tmp_path / "state", save_at=8)
    assert (tmp_path / "state").is_dir()
    resumed, _ = accelerate_run(steps_micro=16, accum=2, ckpt_dir=tmp_path / "state",
                                save_at=8, resume=True)
    assert_same_weights(full, resumed)


# ----------------------------------------------------------------------------- current weights
# With the shipped callbacks, everything a framework evaluates or saves is the synchronized model:
# installing the pending update right then changes nothing. Without them it would (checked, so
# the tests cannot pass vacuously).

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
    callbacks = ([ZenFlowTrainerCallback()] if with_callback else []) + [recorder]
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
    callbacks = ([ZenFlowLightningCallback()] if with_callback else []) + [recorder]
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
