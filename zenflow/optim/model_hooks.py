"""When an attached model's layers wait for their installs (ZenFlowAdamW.attach).

The model is cut into units (install_units): the blocks of its repeated layers, and outside them
the model's children. Each unit finishes the installs of every matrix inside it in a forward
pre-hook, as late as possible; on a GPU the copies of the later blocks overlap the forward of the
earlier ones. The model's state_dict() and load_state_dict() finish every install first. What
finishing is, and the rest of an install's life, is zenflow/optim/installs.py's.

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
        self.missed_reads = False   # see Installs.check_forward_reads
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

    @property
    def finishes_in_step(self) -> bool:
        """Whether this model's installs are finished in the step that queues them, not in its
        forward: it is compiled, or a forward of it read an install its hooks did not finish."""
        return self.compiled or self.missed_reads

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


def install_units(model: torch.nn.Module, matrices: dict[torch.Tensor, int],
                  sharded: bool) -> dict[torch.nn.Module, list[int]]:
    """Module -> the matrices (host indices, from `matrices`: parameter -> index) finished in its
    forward pre-hook. The units are the model's blocks, the layers of its outermost repeated
    stack (a ModuleList or Sequential holding two or more parameter-holding modules of one class:
    a transformer's layers, the Linears of an MLP), for every matrix held anywhere inside one; and
    for every other matrix the model's child that holds it (the model itself for its own). A
    unit's forward may read its weights however it likes: nn.MultiheadAttention reads
    out_proj.weight without calling out_proj, a block may call F.linear(h, self.b.weight) before
    self.b. The contract left is that a weight is read in the forward of the unit that holds it
    (a weight one block holds and another reads, or a parent reads before calling the unit, is
    not covered). Calling children, not the model: a LightningModule's training_step calls its
    layers, not itself. A tied weight belongs to each unit that holds it. `sharded` (FSDP2): no
    unit, so every install is finished in the step that queues it: FSDP's own hooks all-gather
    the weights before their modules' forward."""
    if sharded:
        return {}
    units: dict[torch.nn.Module, list[int]] = {}
    placed: set[int] = set()
    for block in _blocks(model):
        held = [matrices[p] for p in block.parameters() if p in matrices]
        if held:
            units.setdefault(block, []).extend(held)
            placed.update(held)
    children = [model, *model.children()]
    for unit in children:
        params = unit.parameters(recurse=unit is not model) if unit is not model else \
            unit._parameters.values()
        held = [matrices[p] for p in params if p is not None and p in matrices
                and matrices[p] not in placed]
        if held:
            units.setdefault(unit, []).extend(held)
    return {unit: sorted(set(indices)) for unit, indices in units.items()}


def _blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of the outermost repeated stacks under `module` (itself included)."""
    if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
        held = list(dict.fromkeys(c for c in module.children()
                                  if next(c.parameters(), None) is not None))
        if len(held) >= 2 and len({type(c) for c in held}) == 1:
            return held
    return [block for child in module.children() for block in _blocks(child)]
