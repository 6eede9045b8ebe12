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

from helpers.integrations import ZF, LitModule, TokenDataset, mlp, tiny_bert, xy


def assert_same_weights(a: nn.Module, b: nn.Module, atol=0.0):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=atol, msg=f"parameter {k} differs")


def weights_changed(before: dict, model: nn.Module) -> bool:
    return any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


# ----------------------------------------------------------------------------- HF Trainer
transformers = pytest.importorskip("transformers")


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
