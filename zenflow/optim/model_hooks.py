"""When an attached model's layers wait for their installs (ZenFlowAdamW.attach).

A matrix that a module of the model owns (holds in `module._parameters`; a tied weight has several
owners, and each one's forward waits for it) is finished in a forward pre-hook of its owner, as
late as possible; on a GPU the copies of the later layers overlap the forward of the earlier
ones. The model's state_dict() and load_state_dict() finish every install first. What finishing
is, and the rest of an install's life, is zenflow/optim/installs.py's.

A hook runs wherever the forward runs: on CUDA a forward that activation checkpointing recomputes
runs on autograd's device thread, so a hook with nothing to finish takes no lock
(Installs.finish_for_forward). Inside a graph that torch.compile traces the hooks do nothing
(see _before_layer).
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch


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
        self._traced = _Traced()
        before = functools.partial(_before_layer, finish, _eager_caller(), self._traced)
        self._handles = [module.register_forward_pre_hook(
            functools.partial(before, indices), prepend=True) for module, indices in owned.items()]
        self._handles.append(model.register_state_dict_pre_hook(lambda *_: finish(None)))
        # A load writes the weights: a copy landing after it would undo it.
        register_load_hook = getattr(model, "register_load_state_dict_pre_hook", None) or \
            model._register_load_state_dict_pre_hook   # torch < 2.5
        self._handles.append(register_load_hook(lambda *_: finish(None)))

    @property
    def compiled(self) -> bool:
        """Whether torch.compile has traced the model's forward: its hooks do nothing there."""
        return self._traced.compiled

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        model = self._model()
        if model is not None:
            self._on_remove(model)


class _Traced:
    """Whether torch.compile has traced a forward of the model: the hooks share this plain
    object, whose attribute the compiler reads and writes like any other."""
    compiled = False


def _before_layer(finish, eager, traced: _Traced, indices: list[int], module, args) -> None:
    """A layer's pre-hook: finish its own matrices' installs. Inside a graph torch.compile traces,
    a hook that finished installs would break the graph at every layer (226 breaks a forward,
    and no CUDA graph could be captured), so there it does nothing, and the optimizer finishes
    the installs of a compiled model in the step that queues them (on a GPU that only orders the
    device's later work after the copies). The first trace finishes what is pending then,
    eagerly (one graph break, once): nobody knew before that this model is compiled."""
    if torch.compiler.is_compiling():
        if not traced.compiled:
            traced.compiled = True
            eager(finish, None)
        return
    finish(indices)


_EAGER: Callable | None = None


def _eager_caller() -> Callable:
    """`call(f, x)` = f(x), run by torch.compile as it is instead of traced into (a graph break).
    Made at the first attach(): importing the compiler takes about a second."""
    global _EAGER
    if _EAGER is None:
        _EAGER = torch.compiler.disable(lambda f, x: f(x))
    return _EAGER


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
