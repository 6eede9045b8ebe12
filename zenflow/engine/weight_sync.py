"""Current weights wherever someone reads them.

With `overlap_step`, ZenFlowAdamW installs each window's host update one window later, so between
a window's end and the next one the model's weights lack that update. Training wants exactly that
(it is what hides the host's work); anyone *reading* the weights (evaluation, an exported model, a
checkpoint's model file) wants the update installed. `optimizer.synchronize()` installs it.

`WeightSync` calls it where the engine's model is read: before a forward pass in eval mode or
without autograd, and before `state_dict()`. It does so only in a single process: under data
parallel, installing is a collective every rank must join, and evaluation on one rank alone
(common) would hang; there the engine synchronizes at its own collective points (save_checkpoint,
save_16bit_model) and says once that evaluation needs `engine.synchronize()` on every rank.

`synchronized_state` gives a checkpoint both things it needs without changing the run that
saves it: the synchronized weights (for anyone loading the model) and the weights training runs
on until the pending update lands (for an exact resume together with the optimizer state).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch

log = logging.getLogger("zenflow.engine")


class WeightSync:
    """Hooks on `module` that call `synchronize()` before its weights are read."""

    def __init__(self, module: torch.nn.Module, synchronize: Callable[[], None],
                 data_parallel: Callable[[], bool], defers_updates: bool):
        """`defers_updates`: the optimizer can have an update in flight (ZenFlow with
        overlap_step); without that there is nothing to install and no hook is registered."""
        self._synchronize = synchronize
        self._data_parallel = data_parallel
        self.defers_updates = defers_updates
        self._paused = 0
        self._warned = False
        self._handles = [module.register_forward_pre_hook(self._before_forward),
                         module.register_state_dict_pre_hook(self._before_state_dict)
                         ] if defers_updates else []

    def _maybe_sync(self, why: str) -> None:
        if self._paused:
            return
        if self._data_parallel():
            if not self._warned:
                self._warned = True
                log.warning("data parallel: %s uses weights that may lack the host update "
                            "still in flight; call engine.synchronize() on every rank first to "
                            "install it (done automatically only in a single process, since "
                            "installing is collective)", why)
            return
        self._synchronize()

    def _before_forward(self, module, args):
        # Evaluation is a forward pass in eval mode or without autograd (DeepSpeed's CIFAR
        # example tests in train mode under torch.no_grad()). Training forwards are untouched.
        if not module.training or not torch.is_grad_enabled():
            self._maybe_sync("a forward pass in eval mode or under no_grad")

    def _before_state_dict(self, module, prefix, keep_vars):
        self._maybe_sync("state_dict()")

    @contextlib.contextmanager
    def paused(self):
        """Read the raw weights (the engine's own checkpoint code does, deliberately)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def synchronized_state(module: torch.nn.Module, optimizer, sync: WeightSync
                       ) -> tuple[dict, dict, dict]:
    """(synchronized weights, pending training weights, optimizer state), leaving the run as it was.

    The optimizer state is taken first and still carries the pending update. Then the update is
    installed to read the synchronized weights, and the weights it changed are put back and the
    optimizer state reloaded, so the saving run continues exactly as if it had not saved.
    `pending` holds, for the tensors the update changes, the values training uses until the update
    lands; loading them together with the optimizer state resumes exactly. The cost, at save time
    only: one host copy of the model, plus one of each tensor the update changes.
    """
    with sync.paused():  # this function's own state_dict() calls must not synchronize
        optimizer_state = optimizer.state_dict()
        if not sync.defers_updates:  # nothing can be in flight
            return module.state_dict(), {}, optimizer_state
        training = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
        optimizer.synchronize()
        live = module.state_dict()
        current, pending = {}, {}
        for k, value in live.items():
            if torch.equal(value, training[k].to(value.device)):
                current[k] = training[k]
            else:
                current[k] = value.detach().to("cpu", copy=True)
                pending[k] = training[k]
        if pending:
            with torch.no_grad():
                for k, value in pending.items():
                    live[k].copy_(value)
            optimizer.load_state_dict(optimizer_state)
    return current, pending, optimizer_state
