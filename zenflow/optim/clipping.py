"""The step's gradient norms and clipping factor (docs/semantics.md, "Clipping")."""
from __future__ import annotations

import torch


def gradient_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of each gradient, as fp32 scalar tensors (computed in fp32 for any dtype)."""
    if all(g.dtype == torch.float32 for g in grads):
        return list(torch._foreach_norm(grads))
    return [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]


def clip_coefficient(norms: list[torch.Tensor], max_grad_norm: float | None,
                     grad_scale: float = 1.0) -> float | None:
    """The factor to multiply every gradient by: 1 / grad_scale (a loss scale still in the
    gradients) times what clip_grad_norm_ would scale the unscaled gradients by; or None when the
    global gradient norm is not finite and the step must be skipped."""
    total = torch.linalg.vector_norm(torch.stack(norms))
    if not torch.isfinite(total):
        return None
    if grad_scale != 1.0:
        total = total / grad_scale
    if max_grad_norm is None:
        return 1.0 / grad_scale
    # The same fp32 tensor arithmetic as torch.nn.utils.clip_grad_norm_, so results match it.
    return float(torch.clamp(max_grad_norm / (total + 1e-6), max=1.0)) / grad_scale
