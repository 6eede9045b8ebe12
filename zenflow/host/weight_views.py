"""The views of parameters that the optimizer writes its updates through.

The optimizer writes through `.data` aliases: such writes bump no version counter, so that
zenflow.optim.outside_writes can tell the optimizer's writes from anyone else's. `.data` builds
a new tensor object at each call (about 10 us of the Python thread), and a step writes every
matrix: the aliases are made once per parameter and kept while the parameter keeps its storage
(`p.data = t` gives it another, and the next call makes a new alias).
"""
from __future__ import annotations

import math

import torch

from zenflow.distributed import is_sharded, local
from zenflow.host.fingerprints import bits

_data_ptr = torch.Tensor.data_ptr
_NONE_TYPE = type(None)


class WeightViews:
    """The [rows, cols] write aliases of `params` (a vector: one row) as this rank holds them:
    every row of a plain parameter, an FSDP2 shard's own."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self._views: list[torch.Tensor | None] = [None] * len(params)
        self._pointers: list[int | None] = [None] * len(params)   # each view's storage
        self._bits: list[torch.Tensor | None] = [None] * len(params)
        self._sharded = any(map(is_sharded, params))   # (their local tensors: asked at each use)

    def __getitem__(self, i: int) -> torch.Tensor:
        weights = local(self.params[i])
        pointer = weights.data_ptr()
        if self._pointers[i] != pointer:
            self._views[i] = host_view(weights.data)
            self._pointers[i] = pointer
            self._bits[i] = None
        return self._views[i]

    def all(self) -> list[torch.Tensor]:
        """Every parameter's view, by position: one C-level pass over the parameters' storage
        pointers, and a new view only for those given new storage (a step writes every matrix;
        asking one by one is Python bytecode per matrix, thousands of an MoE's experts)."""
        held = [local(p) for p in self.params] if self._sharded else self.params
        pointers = list(map(_data_ptr, held))
        if pointers != self._pointers:
            for i, (now, seen) in enumerate(zip(pointers, self._pointers)):
                if now != seen:
                    self[i]   # (makes its view)
        return self._views

    def all_bits(self) -> list[torch.Tensor]:
        """bits() of every view, by position (as all())."""
        views = self.all()
        if _NONE_TYPE in list(map(type, self._bits)):   # (not `None in`: Tensor.__eq__ each)
            for i, seen in enumerate(self._bits):
                if seen is None:
                    self._bits[i] = bits(views[i])
        return self._bits

    def bits(self, i: int) -> torch.Tensor:
        """The [rows, cols] view's values as integers (zenflow.host.fingerprints.bits), for the
        fingerprints a window end takes of every matrix."""
        view = self[i]
        seen = self._bits[i]
        if seen is None:
            seen = self._bits[i] = bits(view)
        return seen


def host_view(t: torch.Tensor) -> torch.Tensor:
    """The [rows, cols] view the host keeps of a parameter or gradient (vectors: one row). A
    shard may hold no rows (FSDP2, fewer rows than ranks): its view is [0, cols]."""
    if t.ndim == 2:   # (a view is an operator dispatched per matrix and step)
        return t
    if t.ndim > 2:
        return t.reshape(t.shape[0], math.prod(t.shape[1:]))
    return t.reshape(1, t.numel())
