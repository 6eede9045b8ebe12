"""The step's gradient norms and clipping factor (docs/semantics.md, "Clipping")."""
from __future__ import annotations

import math

import torch


def gradient_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of each gradient, as fp32 scalar tensors (computed in fp32 for any dtype), in
    one multi-tensor launch per device and dtype."""
    return list(torch._foreach_norm(grads, 2, dtype=torch.float32))


def clip_coefficient(norms: list[torch.Tensor], max_grad_norm: float | None,
                     grad_scale: float | torch.Tensor | None = None,
                     found_inf: torch.Tensor | None = None,
                     partition=None) -> tuple[float | None, bool]:
    """(factor, amp_overflow): the factor to multiply every gradient by, 1 / grad_scale (a loss
    scale still in the gradients) times what clip_grad_norm_ would scale the unscaled gradients
    by; None when the step must be skipped, because GradScaler found inf/NaN (`found_inf`, then
    amp_overflow is True) or the global gradient norm is not finite.

    Everything the step's host side needs from the device (the norm, the clipping factor, the
    scaler's flag and scale) comes back in one read: the step's only wait for the device.

    Where each rank holds only some rows of every gradient (FSDP2: `partition.shards_gradients`),
    `norms` are the local shards' norms: one all-reduce sums their squares (and GradScaler's
    flags) across ranks, so every rank clips by the same global norm and skips the same steps."""
    total = torch.linalg.vector_norm(torch.stack(norms))
    if partition is not None and partition.shards_gradients:
        parts = [total.square()]
        if isinstance(found_inf, torch.Tensor):
            parts.append(found_inf.to(total.device, torch.float32).reshape(()))
        summed = partition.sum_(torch.stack(parts), "summing the squared gradient norms")
        total = summed[0].sqrt()
        if isinstance(found_inf, torch.Tensor):
            found_inf = summed[1]
    scaled = total if grad_scale is None else total / grad_scale
    reads = {"norm": total}
    if max_grad_norm is not None:
        # The same fp32 tensor arithmetic as torch.nn.utils.clip_grad_norm_, so results match it.
        reads["clip"] = torch.clamp(max_grad_norm / (scaled + 1e-6), max=1.0)
    for name, extra in (("found_inf", found_inf), ("scale", grad_scale)):
        if isinstance(extra, torch.Tensor):
            reads[name] = extra.to(total.device, torch.float32).reshape(())
    values = dict(zip(reads, torch.stack(list(reads.values())).tolist()))
    if values.get("found_inf", 0.0) > 0:
        return None, True
    if not math.isfinite(values["norm"]):
        return None, False
    scale = 1.0 if grad_scale is None else values.get("scale", grad_scale)
    return values.get("clip", 1.0) / float(scale), False
