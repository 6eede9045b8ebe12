"""What every check of `zenflow selftest` shares: the result (`Check`), what the checks run with
(`_Ctx`: the device, the dtype, the transfer path), and the models' values, gradients and
tolerances. The sections are selftest_correctness.py, selftest_transfers.py, selftest_worker.py
and selftest_gpu.py; zenflow/tools/selftest.py runs them."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

SHAPES = [(16, 12), (16,), (10, 16), (10,), (6, 5, 2), (24, 10), (24,)]  # incl. a 3-D weight
HP = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


@dataclass
class Check:
    name: str
    status: str            # "pass", "fail" or "skip"
    detail: str = ""
    seconds: float = 0.0
    measured: dict = field(default_factory=dict)


@dataclass
class _Ctx:
    device: torch.device
    dtype: torch.dtype
    transfers: object      # factory(device) -> Transfers, or None for the package's own
    cuda: bool


def _values(shapes, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) * 0.5 for s in shapes]


def _grads(shapes, steps: int, seed: int) -> list[list[torch.Tensor]]:
    """Random gradients whose columns differ in scale, so the selection is well defined."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    return [[torch.randn(s, generator=gen) * (1 + 3 * torch.rand(s[-1:], generator=gen))
             for s in shapes] for _ in range(steps)]


def _params(values, ctx: _Ctx, dtype=None) -> list[torch.Tensor]:
    return [v.to(device=ctx.device, dtype=dtype or ctx.dtype, copy=True).requires_grad_()
            for v in values]


def _use_transfers(opt, factory) -> None:
    """Swap the optimizer's transfer path (keeping its page-lock registrations to undo)."""
    if factory is None:
        return
    old, new = opt._pipeline.transfers, factory(opt.device)
    new._locks, old._locks = old._locks, new._locks
    opt._pipeline.use_transfers(new)


def _tol(ctx: _Ctx, dtype=torch.float32) -> dict:
    if dtype == torch.bfloat16:   # both sides round the same fp32 master: at most an ulp apart
        return dict(rtol=2.0 ** -7, atol=1e-5)
    return dict(rtol=1e-4, atol=1e-5) if ctx.cuda else dict(rtol=1e-5, atol=1e-6)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().cpu().float() - b.detach().cpu().float()).abs().max()) if a.numel() \
        else 0.0


def _timed(name: str, check, *args) -> Check:
    start = time.perf_counter()
    c = check(*args)
    c.name, c.seconds = name, time.perf_counter() - start
    return c


def _close(a, b, tol) -> bool:
    return torch.allclose(a.detach().cpu().float(), b.detach().cpu().float(), **tol)
