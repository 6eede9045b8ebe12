"""Current weights wherever someone reads them.

With `overlap_step`, ZenFlowAdamW installs each window's host update one window later, so between
a window's end and the next one the model's weights lack that update. Training wants exactly that
(it is what hides the host's work); anyone *reading* the weights (evaluation, an exported model, a
checkpoint's model file) wants the update installed. `optimizer.synchronize()` installs it.

`WeightSync` calls it where the engine's model is read: `engine.eval()`, a forward pass in eval
mode or without autograd, and `state_dict()`. Under data parallel installing is a collective, and
DeepSpeed clients read on every rank together (`model.eval(); evaluate(); model.train()`) or on
one rank only; so the ranks first agree (zenflow/engine/rank_agreement.py, no collective, never a
wait past a short deadline) and install only when every rank reads. A read on some ranks only
keeps the training weights and says so once, with what to do: `engine.eval()` (or
`engine.synchronize()`) on every rank installs the update, and a rank-0-only evaluation after it
reads current weights without meeting anyone. A reading rank waits for the others only while it
cannot tell where they are: one that trains on (its backward), waits in a barrier of the served
`deepspeed.comm` or in a save, or has exited is not waited for.

`synchronized_state` gives a checkpoint both things it needs without changing the run that
saves it: the synchronized weights (for anyone loading the model) and the weights training runs
on until the pending update lands (for an exact resume together with the optimizer state).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch

from zenflow.engine.rank_agreement import StepAgreement

log = logging.getLogger("zenflow.engine")


# How long a reading rank waits for the others before it reads without them (ranks that train
# on, wait in a served barrier or a save, or have exited are noticed at once; this bounds waiting
# on a rank stuck where nothing says so, e.g. in torch.distributed.barrier() itself).
READ_DEADLINE_S = 10.0


class WeightSync:
    """Hooks on `module` that call `synchronize()` before its weights are read."""

    def __init__(self, module: torch.nn.Module, synchronize: Callable[[], None],
                 agreement: StepAgreement | None, defers_updates: bool):
        """`defers_updates`: the optimizer can have an update in flight (ZenFlow with
        overlap_step); without that there is nothing to install and no hook is registered.
        `agreement`: the ranks' meeting points under data parallel, None in a single process."""
        self._synchronize = synchronize
        self._agreement = agreement
        self.defers_updates = defers_updates
        self._paused = 0
        self._warned = False
        self._installed_period = 0   # the period whose weights are installed (none trained yet)
        self._tried_period = -1      # the last period whose readers met
        self._handles = [module.register_forward_pre_hook(self._before_forward),
                         module.register_state_dict_pre_hook(self._before_state_dict)
                         ] if defers_updates else []

    def read(self, why: str) -> None:
        """Someone reads the weights: install the update in flight first (on every rank)."""
        if self._paused or not self._handles:
            return
        agreement = self._agreement
        if agreement is None:
            self._synchronize()
            return
        period = agreement.period
        if period in (self._installed_period, self._tried_period):
            return   # installed already, or this period's readers met and some rank was missing
        self._tried_period = period
        if agreement.all_read(READ_DEADLINE_S):
            self._synchronize()
            self._installed_period = period
        elif not self._warned:
            self._warned = True
            log.warning("data parallel: %s on rank %d while other ranks did not read the model "
                        "(they trained on, waited elsewhere or exited, or did not come within "
                        "%g s): the weights read lack the host update still in flight "
                        "(installing it is collective). To evaluate current weights on one rank, "
                        "call engine.eval() (or engine.synchronize()) on every rank first, then "
                        "evaluate on that rank", why, agreement.rank, READ_DEADLINE_S)

    def _before_forward(self, module, args):
        # Evaluation is a forward pass in eval mode or without autograd (DeepSpeed's CIFAR
        # example tests in train mode under torch.no_grad()). Training forwards are untouched
        # (a save can follow one in the same step: only backward() says the rank trains on).
        if not module.training or not torch.is_grad_enabled():
            self.read("a forward pass in eval mode or under no_grad")

    def _before_state_dict(self, module, prefix, keep_vars):
        self.read("state_dict()")

    @contextlib.contextmanager
    def paused(self):
        """Read the raw weights (the engine's own checkpoint code does, deliberately)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def installed(self) -> None:
        """The engine installed the update itself, on every rank (a save does)."""
        if self._agreement is not None:
            self._installed_period = self._agreement.period

    def loaded(self) -> None:
        """A checkpoint was loaded: its update in flight waits to be installed at the next read."""
        self._installed_period = -1

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
