"""Installs that land while the next forward runs: each layer waits only for its own weights.

An install copies a window's new values of the deferred columns into the parameters (on CUDA on
a side stream, on a CPU on the copy thread: zenflow/host/transfers.py). Before anything reads a
matrix its install must be *finished*: the device ordered after its copy, then the fix-ups that
need the copied values (the "moments" correction, the device's own newer columns written back
over them, the rates of those columns zeroed, the matrix's fingerprint for OutsideWrites).

Without `ZenFlowAdamW.attach(model)` every install is finished in the step() that queued it, so
the device waits for the whole copy before the next forward (the behaviour without this module).
With it, a matrix that a module of the model owns (holds in `module._parameters`; a tied weight
has several owners, and each one's forward waits for it) is finished in a forward pre-hook of
its owner, as late as possible; on a GPU the copies of the later layers overlap the forward of
the earlier ones. Everything still pending is finished at the next point that must see every
weight: the next step(), synchronize(), the optimizer's state_dict(), load_state_dict() and
close(), the attached model's state_dict() and load_state_dict(), and `wait_for_install()`,
which user code that reads or writes the weights outside the model's forward calls first (an
EMA of the weights, a hand-written evaluation that reads `layer.weight` without calling the
layer).

FSDP2-sharded parameters are read by FSDP's own all-gather before their modules' forward: their
installs are finished in the step that queues them, as without attach.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from zenflow.host.pipeline import QueuedInstall


class PendingInstalls:
    """The queued installs not finished yet, one per matrix (host index), and the models whose
    forward finishes them."""

    def __init__(self, finish: Callable[[list[QueuedInstall]], None]):
        self._finish = finish            # the optimizer's: the pipeline's half, then its own
        self._pending: dict[int, QueuedInstall] = {}
        self._attached: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> hooks
        self._waited_in_forward: set[int] = set()   # matrices some attached forward finishes

    def __contains__(self, matrix: int) -> bool:
        return matrix in self._pending

    def pending(self, matrices: list[int] | None = None) -> bool:
        """Whether any install of `matrices` (None: any at all) is pending. Takes no lock: one
        dict read per matrix, which the training thread's add() and finish() never tear."""
        if matrices is None:
            return bool(self._pending)
        return any(i in self._pending for i in matrices)

    def add(self, installs: list[QueuedInstall]) -> None:
        """Installs just queued. Those no attached forward waits for are finished now."""
        assert not any(q.matrix in self._pending for q in installs), "finish() the last first"
        self._pending.update((q.matrix, q) for q in installs)
        self.finish([q.matrix for q in installs if q.matrix not in self._waited_in_forward])

    def finish(self, matrices=None) -> None:
        """Finish the pending installs of `matrices` (default: all) in the order queued."""
        if not self._pending:
            return
        if matrices is None:
            due = list(self._pending.values())
        else:
            due = [self._pending[i] for i in matrices if i in self._pending]
        for q in due:
            del self._pending[q.matrix]
        if due:
            self._finish(due)

    def attach(self, model: torch.nn.Module, owned: dict[torch.nn.Module, list[int]],
               finish_in_forward: Callable[[list[int] | None], None]) -> ModelHooks:
        """Register `model`'s hooks (once per model): each module of `owned` finishes its
        matrices before its forward; `finish_in_forward(None)` finishes all."""
        hooks = self._attached.get(model)
        if hooks is None:
            hooks = ModelHooks(model, owned, finish_in_forward, self._detached)
            self._attached[model] = hooks
            self._waited_in_forward |= hooks.matrices
        return hooks

    def _detached(self, model: torch.nn.Module) -> None:
        self._attached.pop(model, None)
        self._waited_in_forward = set().union(*(h.matrices for h in self._attached.values()))


class ModelHooks:
    """The hooks attach() put on one model; `remove()` takes them off (idempotent)."""

    def __init__(self, model: torch.nn.Module, owned: dict[torch.nn.Module, list[int]],
                 finish: Callable[[list[int] | None], None], on_remove):
        self.matrices = {i for indices in owned.values() for i in indices}
        self._model = weakref.ref(model)
        # The model must not keep a dropped optimizer (and its worker) alive.
        finish = _weakly(finish)
        self._on_remove = on_remove
        # prepend: before any hook of the model's own, which may read the weights.
        self._handles = [module.register_forward_pre_hook(
            lambda module, args, indices=indices: finish(indices), prepend=True)
            for module, indices in owned.items()]
        self._handles.append(model.register_state_dict_pre_hook(lambda *_: finish(None)))
        # A load writes the weights: a copy landing after it would undo it.
        register_load_hook = getattr(model, "register_load_state_dict_pre_hook", None) or \
            model._register_load_state_dict_pre_hook   # torch < 2.5
        self._handles.append(register_load_hook(lambda *_: finish(None)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        model = self._model()
        if model is not None:
            self._on_remove(model)


def _weakly(method) -> Callable:
    """`method` (bound), without keeping its object alive: a no-op once it is collected."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        if bound is not None:
            bound(*args)
    return call


def owners(model: torch.nn.Module, matrices: dict[torch.Tensor, int],
           sharded: bool) -> dict[torch.nn.Module, list[int]]:
    """Module -> the matrices (host indices, from `matrices`: parameter -> index) it holds
    directly. A tied weight belongs to each module that holds it. `sharded` (FSDP2): none, so
    every install is finished in the step that queues it: FSDP's own hooks all-gather the weights
    before their modules' forward, and the module whose forward is called first need not be the
    model attached (a LightningModule's training_step calls its layers, not itself)."""
    if sharded:
        return {}
    owned: dict[torch.nn.Module, list[int]] = {}
    for module in model.modules():
        held = [matrices[p] for p in module._parameters.values() if p is not None and p in matrices]
        if held:
            owned.setdefault(module, []).extend(held)
    return {module: sorted(set(indices)) for module, indices in owned.items()}
