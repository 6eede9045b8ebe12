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
from collections.abc import Callable

import torch

log = logging.getLogger("zenflow")

# The device types whose steps take compiled kernels. A test adds "cpu" to check the compiled
# function against the op-by-op path with the CPU's C++ backend (a compile takes 15-20 s there,
# which every process of the suite would pay).
COMPILE_ON = {"cuda"}


def compiled_for(fn: Callable, device: torch.device) -> Callable | None:
    """`fn` compiled for `device` (dynamic shapes: one compile serves every matrix of a dtype),
    or None where it is not compiled (a device type outside COMPILE_ON: the caller takes its
    op-by-op path)."""
    if torch.device(device).type not in COMPILE_ON:
        return None
    log.info("%s is compiled for %s at its first call (once per process: seconds to a minute; "
             "TORCHDYNAMO_DISABLE=1 runs it uncompiled)", fn.__name__, device)
    return torch.compile(fn, dynamic=True, fullgraph=True)


def scalar(value: float, device: torch.device) -> torch.Tensor:
    """`value` as a 0-dim fp32 tensor on `device`: a compiled kernel takes a learning rate as a
    tensor argument, where a Python float would be compiled in as a constant and a scheduler's
    every new value would compile again. One fill launch, never a sync."""
    return torch.full((), value, dtype=torch.float32, device=device)
