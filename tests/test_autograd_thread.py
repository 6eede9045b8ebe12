"""The hooks with the backward where CUDA runs it: on autograd's own thread
(tests/helpers/autograd_thread.py).

On a GPU the backward, its hooks and any forward that activation checkpointing recomputes run on
autograd's device thread while the caller waits in `backward()`. Inside `step(closure)` the
caller is the optimizer itself: a hook there that waited for the optimizer's lock would wait
forever (Lightning's automatic optimization always passes a closure, and its callback attaches),
and a hook that only tries the lock would never get it (every early copy late).
"""
from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import zenflow

STEPS = 9


class CheckpointedMLP(torch.nn.Module):
    """Blocks whose forward activation checkpointing recomputes inside the backward."""

    def __init__(self, reentrant: bool | None):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(12, 12), torch.nn.Tanh()) for _ in range(3))
        self.head = torch.nn.Linear(12, 4)
        self.reentrant = reentrant

    def forward(self, x):
        for block in self.blocks:
            x = block(x) if self.reentrant is None else checkpoint(
                block, x, use_reentrant=self.reentrant)
        return self.head(x)


def _train(reentrant, attach: bool, closure: bool, **settings):
    model = CheckpointedMLP(reentrant)
    opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2,
                               overlap_step=True, **settings)
    if attach:
        opt.attach(model)
    gen = torch.Generator().manual_seed(1)
    with opt:
        for _ in range(STEPS):
            x = torch.randn(8, 12, generator=gen, requires_grad=reentrant is True)

            def loss_and_backward():
                opt.zero_grad()
                loss = model(x).square().mean()
                loss.backward()
                return loss
            if closure:
                opt.step(loss_and_backward)
            else:
                loss_and_backward()
                opt.step()
            # the worker has added the step before the next backward: the hooks always find
            # their staging buffer free, so the counts do not depend on timing
            opt._pipeline.drain()
        opt.synchronize()
        stats = opt.stats()
    return [p.detach().clone() for p in model.parameters()], stats


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_step_with_a_closure_and_checkpointing_does_not_hang(reentrant, autograd_thread):
    """The recomputed forward's pre-hooks run on the backward's thread while step() waits for the
    closure: they must not wait for the optimizer's lock. The weights equal the same training
    without attach, without checkpointing and without a closure, bit for bit."""
    weights, _ = _train(reentrant, attach=True, closure=True)
    assert len(autograd_thread) >= STEPS and threading.get_ident() not in autograd_thread
    plain, _ = _train(None, attach=False, closure=False)
    for a, b in zip(weights, plain):
        assert torch.equal(a, b)


def test_early_copies_start_in_a_closures_backward(autograd_thread):
    """Host-summed gradients start their copy in backward under step(closure) too: the closure
    runs without the optimizer's lock, so the hooks on the backward's thread can take it."""
    _, stats = _train(None, attach=False, closure=True, device_sum_budget=0, worker=True)
    # the first step has no counts to copy at; every matrix of every later step copies early
    assert stats["early_copies"] == 4 * (STEPS - 1) and stats["late_copies"] == 4


def test_a_pre_hook_with_nothing_pending_takes_no_lock():
    """An attached layer's forward with no install pending returns at once: it does not wait
    even while another thread holds the optimizer (a step or a checkpoint on another thread)."""
    model = CheckpointedMLP(None)
    opt = zenflow.ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2,
                               worker=False)
    opt.attach(model)
    held, release = threading.Event(), threading.Event()

    def hold_the_lock():
        with opt._lock:
            held.set()
            release.wait(30)
    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    try:
        assert held.wait(30)
        forward = threading.Thread(target=model, args=(torch.randn(2, 12),))
        forward.start()
        forward.join(10)
        assert not forward.is_alive(), "a forward with nothing pending waited for the lock"
    finally:
        release.set()
        holder.join()
        opt.close()


@pytest.mark.slow
def test_lightning_automatic_optimization_with_checkpointing(tmp_path, autograd_thread):
    """Lightning passes a closure to every step() and its callback attaches the model: with
    checkpointed blocks and the backward on its own thread, training ends, and the weights it
    saves equal the synchronized ones."""
    L = pytest.importorskip("lightning.pytorch")
    from zenflow.integrations import ZenFlowLightningCallback

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = CheckpointedMLP(reentrant=False)
            self.optimizer = None

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            self.optimizer = zenflow.ZenFlowAdamW(self.parameters(), lr=1e-2, topk_ratio=0.25,
                                                  update_interval=2)
            return self.optimizer

    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 12, generator=gen),
                                          torch.randn(32, 4, generator=gen))
    module = Lit()
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path),
                        callbacks=[ZenFlowLightningCallback(attach=True)])
    try:
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
        assert module.optimizer.counters.step == 16 and len(autograd_thread) == 16
        trainer.save_checkpoint(tmp_path / "final.ckpt")
        saved = torch.load(tmp_path / "final.ckpt", weights_only=False)["state_dict"]
        module.optimizer.synchronize()
        for k, v in module.state_dict().items():
            assert torch.equal(saved[k], v), k
    finally:
        module.optimizer.close()
