"""fp32 master weights for plain torch.optim optimizers on bf16/fp16 models, and the
normalisation of `model_parameters` into groups of trainable tensors (both used by the engine)."""
from __future__ import annotations

import torch


class FP32Masters:
    """fp32 master copies for plain AdamW on bf16/fp16 weights (our optimizers have their own).

    The torch optimizer works on the masters; after each step their values are copied back into
    the low-precision model weights. Weights written outside the optimizer since (a checkpoint's
    weights loaded with load_module_only or without the optimizer state, module.load_state_dict,
    an in-place edit) are adopted as the masters before the next step, so it never reverts them.
    """

    def __init__(self, model_params: list[torch.Tensor]):
        self.model_params = model_params
        self.masters = [p.detach().clone().float().requires_grad_(True) for p in model_params]

    @torch.no_grad()
    def adopt_outside_writes(self) -> None:
        """masters := the weights wherever a weight no longer holds its master's rounded value
        (element by element: the fp32 digits of the untouched elements are kept)."""
        for p, m in zip(self.model_params, self.masters):
            changed = p != m.to(p.dtype)
            if changed.any():
                m.copy_(torch.where(changed, p.float(), m))

    def load_grads(self, inv_scale: float) -> None:
        self.adopt_outside_writes()
        for p, m in zip(self.model_params, self.masters):
            if p.grad is None:
                m.grad = None
            else:
                m.grad = p.grad.float().mul_(inv_scale) if inv_scale != 1.0 else p.grad.float()

    @torch.no_grad()
    def store_weights(self) -> None:
        for p, m in zip(self.model_params, self.masters):
            p.copy_(m)

    def state_dict(self) -> list[torch.Tensor]:
        return [m.detach().clone() for m in self.masters]

    @torch.no_grad()
    def load_state_dict(self, masters: list[torch.Tensor]) -> None:
        for m, saved in zip(self.masters, masters):
            m.copy_(saved)
        self.store_weights()


def trainable_param_groups(params) -> tuple[list, list[torch.Tensor]]:
    """Normalise model_parameters (tensors or group dicts) to groups of trainable tensors."""
    params = list(params)
    if params and isinstance(params[0], dict):
        groups = [dict(g, params=[p for p in g["params"] if p.requires_grad]) for g in params]
    else:
        groups = [{"params": [p for p in params if p.requires_grad]}]
    groups = [g for g in groups if g["params"]]
    flat = [p for g in groups for p in g["params"]]
    if not flat:
        raise ValueError("model_parameters: no parameter requires grad, nothing to train")
    return groups, flat
