"""OffloadAdamW: the synchronous ZeRO-Offload baseline, on the same host pipeline as ZenFlow.

Every step ships every gradient to the host, runs AdamW over every parameter there and ships the
weights back before step() returns: the device waits for all of it. It is ZenFlowAdamW with no
column on the device, vectors on the host too, windows of one step and no overlap, so the two
share every copy, buffer and kernel and differ only in what ZenFlow adds. By default the host
AdamW runs in the training process on all of its threads, as DeepSpeed's ZeRO-Offload does
(worker=True moves it to a worker process, which only adds a hand-off when nothing overlaps).
"""
from __future__ import annotations

from zenflow.config.settings import ADAMW_DEFAULTS, DEFAULTS
from zenflow.optim.optimizer import ZenFlowAdamW


class OffloadAdamW(ZenFlowAdamW):
    """AdamW with fp32 master weights and moments in host memory, updated synchronously."""

    _NAME = "OffloadAdamW"
    _VECTORS_ON_HOST = True

    def __init__(self, params, lr: float = ADAMW_DEFAULTS.lr,
                 betas: tuple[float, float] = ADAMW_DEFAULTS.betas,
                 eps: float = ADAMW_DEFAULTS.eps, weight_decay: float = ADAMW_DEFAULTS.weight_decay,
                 amsgrad: bool = False, *, max_grad_norm: float | None = DEFAULTS.max_grad_norm,
                 worker: bool = False, process_group=None,
                 # torch.optim.AdamW's flags, as ZenFlowAdamW takes them.
                 maximize: bool = False, foreach: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, topk_ratio=0.0,
                         select_strategy="step", select_interval=1, update_interval=1,
                         overlap_step=False, max_grad_norm=max_grad_norm, worker=worker,
                         device_sum_budget=0, deferred_credit="mean",
                         process_group=process_group, maximize=maximize, foreach=foreach,
                         capturable=capturable, differentiable=differentiable, fused=fused)
