"""Device work compiled into fused kernels where the device is a GPU (torch.compile: Triton on
CUDA). A deferred-credit rule's step reads and writes several tensors of every deferred value;
run op by op it passes over them ten times or more, which on a GPU makes the step's time (the
model in zenflow/tools/estimate_terms.py counts the bytes). Compiled, each matrix takes one or two
passes. The eager function stays the definition: it is what runs on a CPU "device" (where the
batched op-by-op path is bit for bit the reference's) and what a failed compile falls back to.

`TORCHDYNAMO_DISABLE=1` in the environment runs every compiled function eagerly (torch's own
switch); a compile that fails is logged once and the rule goes back to its op-by-op path.
"""
from __future__ import annotations

import logging
import threading
import types
from collections.abc import Callable

import torch

log = logging.getLogger("zenflow")

# The device types whose steps take compiled kernels. A test adds "cpu" to check the compiled
# function against the op-by-op path with the CPU's C++ backend (a compile takes 15-20 s there,
# which every process of the suite would pay).
COMPILE_ON = {"cuda"}
# torch.compile's backend. A test takes "eager" (Dynamo's tracing and guards, no code made: a
# compile in well under a second) to count compiles across many signatures.
BACKEND = "inductor"


def compiled_for(fn: Callable, device: torch.device, batch: bool = False) -> Callable | None:
    """`fn` compiled for `device` (dynamic shapes: one compile serves every matrix of a dtype
    signature), or None where it is not compiled (a device type outside COMPILE_ON: the caller
    takes its op-by-op path). `batch`: `fn` takes lists of matrices, and each call names their
    shapes and dtypes (`signature=`): static shapes, one compile per signature."""
    if torch.device(device).type not in COMPILE_ON:
        return None
    log.info("%s is compiled for %s at its first call (once per process and %s: seconds to "
             "a minute; TORCHDYNAMO_DISABLE=1 runs it uncompiled)", fn.__name__, device,
             "set of matrices" if batch else "dtypes")
    return _Kernel(fn, dynamic=not batch)


class _Kernel:
    """`fn` compiled once per process for each dtype signature of its tensor arguments, and
    called without autograd.

    Dynamo keeps a function's compiled variants on its code object, at most
    torch._dynamo.config.recompile_limit (8) of them, and with fullgraph=True one more is an
    error: fp32 and bf16 weights and sums, and a call with autograd on or off, each make one, so
    a process with a few optimizers (the selftest, a sweep) ran out on a GPU. So each signature
    compiles a copy of `fn` with a code object of its own (its variants: the few that shapes
    make), shared by every optimizer of the process, and every call runs under no_grad (one
    grad mode, the one a step has). A batch's signature (its matrices' shapes and dtypes, which
    its caller knows) takes the place of the dtypes, and its shapes are compiled in."""

    _compiled: dict[tuple, Callable] = {}   # (fn, signature) -> compiled copy, per process
    _lock = threading.Lock()

    def __init__(self, fn: Callable, dynamic: bool = True):
        self.fn, self.dynamic = fn, dynamic

    def __call__(self, *args, signature: tuple | None = None) -> None:
        key = (self.fn, signature if signature is not None else
               tuple(getattr(a, "dtype", None) for a in args))
        kernel = self._compiled.get(key)
        if kernel is None:
            with self._lock:
                kernel = self._compiled.get(key)
                if kernel is None:
                    kernel = self._compiled[key] = torch.compile(
                        _copy(self.fn, len(self._compiled)), backend=BACKEND,
                        dynamic=self.dynamic, fullgraph=True)
        with torch.no_grad():
            kernel(*args)


def _copy(fn: Callable, n: int) -> Callable:
    """`fn` with a code object of its own (named `fn`_n in traces and Dynamo's logs)."""
    name = f"{fn.__name__}_{n}"
    names = {"co_name": name, **({"co_qualname": name} if hasattr(fn.__code__, "co_qualname")
                                 else {})}
    return types.FunctionType(fn.__code__.replace(**names), fn.__globals__, name,
                              fn.__defaults__, fn.__closure__)


def scalar(value: float, device: torch.device) -> torch.Tensor:
    """`value` as a 0-dim fp32 tensor on `device`: a compiled kernel takes a learning rate as a
    tensor argument, where a Python float would be compiled in as a constant and a scheduler's
    every new value would compile again. One fill launch, never a sync."""
    return torch.full((), value, dtype=torch.float32, device=device)
