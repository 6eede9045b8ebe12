"""AdamW arithmetic shared by the device and host sides.

Every AdamW update in the package goes through `adamw_`, which calls PyTorch's fused kernel
(CPU and CUDA). The kernel updates fp32 tensors in place; the caller owns the integer step count
and passes the count *after* this update, so counts never live in a low-precision float.
"""
from __future__ import annotations

import math

import torch

# What AdamW keeps per parameter, by the names every part saves and moves them under.
MOMENTS = ("exp_avg", "exp_avg_sq")
FP32_STATE = ("master", *MOMENTS)   # with the fp32 master value

def adamw_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
           exp_avg_sqs: list[torch.Tensor], step: int | list[torch.Tensor], *, lr: float,
           beta1: float, beta2: float, eps: float, weight_decay: float,
           grad_divisor: float | torch.Tensor = 1.0, skip: torch.Tensor | None = None) -> None:
    """One AdamW update of same-device fp32 tensors (`step`: the 1-based count after this update,
    shared, or each tensor's count as a 0-dim fp32 tensor on the device).

    `grad_divisor` divides every gradient first (the host passes the window length to turn a
    gradient sum into its mean without a separate pass); a caller that updates many chunks may
    pass it, and the counts, as 0-dim fp32 tensors made once. With `skip` (a 0-dim fp32 device flag,
    1.0 to skip) the update changes nothing when the flag is set, decided on the device, as
    torch.optim's fused AdamW does with GradScaler's found_inf. Gradients may be overwritten.
    """
    if not params:
        return
    device = params[0].device
    if isinstance(step, int):
        # Filled on the device (a fill kernel), not copied from host memory: no transfer to wait for.
        steps = [torch.full((), float(step), dtype=torch.float32, device=device)] * len(params)
    else:
        steps = step
    divisor = None
    if isinstance(grad_divisor, torch.Tensor):
        divisor = grad_divisor
    elif grad_divisor != 1.0:
        divisor = torch.full((), float(grad_divisor), dtype=torch.float32, device=device)
    if _has_fused(device):
        torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1,
                            beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False,
                            maximize=False, grad_scale=divisor, found_inf=skip)
        return
    # Devices without the fused kernel: the same arithmetic with foreach ops; the counts and the
    # skip flag are read here (such devices are not the data path this project times).
    if skip is not None and bool(skip):
        return
    for group_step, indices in _by_count(steps).items():
        _adamw_foreach([params[i] for i in indices], [grads[i] for i in indices],
                       [exp_avgs[i] for i in indices], [exp_avg_sqs[i] for i in indices],
                       group_step, lr, beta1, beta2, eps, weight_decay, float(grad_divisor))


def _by_count(steps: list[torch.Tensor]) -> dict[int, list[int]]:
    """The positions of `steps`, grouped by their count (one read of the device)."""
    groups: dict[int, list[int]] = {}
    for i, count in enumerate(torch.stack(steps).tolist()):
        groups.setdefault(int(count), []).append(i)
    return groups


def _adamw_foreach(params, grads, exp_avgs, exp_avg_sqs, step: int, lr: float, beta1: float,
                   beta2: float, eps: float, weight_decay: float, grad_divisor: float) -> None:
    if grad_divisor != 1.0:
        torch._foreach_div_(grads, grad_divisor)
    torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    bias1 = 1.0 - beta1 ** step
    bias2_sqrt = math.sqrt(1.0 - beta2 ** step)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, -lr / bias1)


def adamw_moments_(params: list[torch.Tensor], grad_sums: list[torch.Tensor],
                   square_sums: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                   exp_avg_sqs: list[torch.Tensor], step: int, num_grads: int, *, lr: float,
                   beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """A window of `num_grads` gradients as one AdamW step (deferred_credit="moments",
    docs/semantics.md): the moments become what `num_grads` AdamW steps on gradients with the
    window's mean and mean square would leave, m <- b1^n m + (1 - b1^n) mean(g) and
    v <- b2^n v + (1 - b2^n) mean(g^2), and the value takes one step of `lr` (the caller passes
    n times the group's) with the bias corrections at `step`, the count after the window's
    gradients. Same-device fp32 tensors, updated in place in cache-sized chunks; the sums are
    left as they were."""
    for x, s, q, m, v in zip(params, grad_sums, square_sums, exp_avgs, exp_avg_sqs):
        for part in _chunks(x.numel()):
            adamw_moments_chunk_(x.view(-1)[part], s.view(-1)[part], q.view(-1)[part],
                                 m.view(-1)[part], v.view(-1)[part], step, num_grads, lr=lr,
                                 beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)


def adamw_moments_chunk_(x: torch.Tensor, s: torch.Tensor, q: torch.Tensor, m: torch.Tensor,
                         v: torch.Tensor, step: int, num_grads: int, *, lr: float, beta1: float,
                         beta2: float, eps: float, weight_decay: float,
                         scratch: torch.Tensor | None = None) -> torch.Tensor:
    """adamw_moments_ on one chunk of flat fp32 tensors (small enough for the cache: it makes
    several passes). Returns the update's denominator, sqrt(v / (1 - beta2^step)) + eps, in
    `scratch` when given (its first x.numel() elements): its reciprocal is the value's AdamW rate
    (adam_rate), so a caller that wants the rate too need not compute it again."""
    n = float(num_grads)
    decay1, decay2 = beta1 ** num_grads, beta2 ** num_grads
    bias1 = 1.0 - beta1 ** step
    bias2_sqrt = math.sqrt(1.0 - beta2 ** step)
    m.mul_(decay1).add_(s, alpha=(1.0 - decay1) / n)
    v.mul_(decay2).add_(q, alpha=(1.0 - decay2) / n)
    denom = torch.sqrt(v, out=scratch[:v.numel()]) if scratch is not None else v.sqrt()
    denom.div_(bias2_sqrt).add_(eps)
    x.mul_(1.0 - lr * weight_decay).addcdiv_(m, denom, value=-lr / bias1)
    return denom


def step_bound(beta1: float, beta2: float) -> float:
    """The largest step AdamW takes, in units of lr (Kingma & Ba, section 2.1):
    (1 - beta1) / sqrt(1 - beta2) where that exceeds 1 (3.16 with the default betas), else 1."""
    return max(1.0, (1.0 - beta1) / math.sqrt(1.0 - beta2)) if beta2 < 1 else 1.0


def adam_rate(out: torch.Tensor, exp_avg_sq: torch.Tensor, step: int, *, beta2: float,
              eps: float) -> None:
    """out = 1 / (sqrt(v / (1 - beta2^step)) + eps), in out's dtype: how far one AdamW step
    moves a value per unit of gradient, without momentum (the device's interim steps)."""
    bias2_sqrt = math.sqrt(1.0 - beta2 ** step)
    for part in _chunks(out.numel()):
        denom = exp_avg_sq.view(-1)[part].sqrt().div_(bias2_sqrt).add_(eps)
        out.view(-1)[part].copy_(denom.reciprocal_())


_CHUNK = 1 << 18   # elements per pass of the chunked kernels: their temporaries stay in cache


def _chunks(numel: int):
    return (slice(start, min(numel, start + _CHUNK)) for start in range(0, numel, _CHUNK))


def adamw_lookahead(out: torch.Tensor, param: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, step: int, *, lr: float, beta1: float,
                    beta2: float, eps: float, weight_decay: float, fraction: float,
                    scratch: torch.Tensor | None = None) -> None:
    """out = param moved `fraction` of the way along the AdamW step its moments point to now
    (the next step's direction with no new gradient), in out's dtype. param and moments are fp32
    and unchanged; `step` is the count the moments were last updated with. `scratch`: an fp32
    tensor of at least out.numel() elements for the temporary (else one is allocated)."""
    bias1 = 1.0 - beta1 ** step
    bias2_sqrt = math.sqrt(1.0 - beta2 ** step)
    flat = exp_avg_sq.reshape(-1)
    direction = (torch.sqrt(flat, out=scratch[:flat.numel()]).view(exp_avg_sq.shape)
                 if scratch is not None else exp_avg_sq.sqrt())
    direction.div_(bias2_sqrt).add_(eps)
    torch.div(exp_avg, direction, out=direction).div_(bias1)
    direction.add_(param, alpha=weight_decay)
    out.copy_(direction.mul_(-fraction * lr).add_(param))


def _has_fused(device: torch.device) -> bool:
    return device.type in ("cpu", "cuda")


def moment_rescale(beta: float, from_step: int, to_step: int) -> float:
    """Factor that keeps a bias-corrected Adam moment unchanged when its step count changes.

    A moment m with count a has the bias-corrected value m / (1 - beta^a). Handing it to a side
    whose count is b, it must become m * (1 - beta^b) / (1 - beta^a). A moment that was never
    updated (a == 0) is zero and stays zero; a side that has never stepped (b == 0) cannot hold a
    bias-corrected value, so the moment is dropped there (the optimizer avoids this case by
    starting the device count at the host count).
    """
    if from_step == 0 or to_step == 0:
        return 0.0
    if from_step == to_step:
        return 1.0
    return (1.0 - beta ** to_step) / (1.0 - beta ** from_step)
