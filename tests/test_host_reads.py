"""How often step() reads a value back from the device: each read makes the Python thread wait
for every kernel queued before it (on a GPU, for the whole backward). A step strictly inside a
window reads nothing: its clipping factor and skip flag stay on the device and every kernel takes
them; the flags are read at the window's end, in one read with the others. A window's first step
reads once (selecting columns needs finite gradients), and so does its last. Drift checks read
once per check, not once per matrix."""
from __future__ import annotations

import math
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zenflow
from zenflow.optim.reference import ReferenceZenFlow
from zenflow.optim.windows import DelayedAgreement

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")
aten = torch.ops.aten
SYNCING_OPS = {aten._local_scalar_dense, aten.is_nonzero, aten.equal, aten.nonzero,
               aten.masked_select, aten.unique_dim, aten._unique2, aten.repeat_interleave}


@pytest.fixture
def device_reads(monkeypatch):
    """Counts reads of tensor values into Python, and blocking copies from one device to another
    (none can happen on a CPU-only machine, where the device is the host: the count is there for
    machines with an accelerator). Reads made inside an operator count too: a 0-dim tensor passed
    where an operator takes a number (`torch._foreach_add_(tensors, flag)` picks the Scalar
    overload) is read by `aten._local_scalar_dense`, which on CUDA waits for the device; so do the
    operators in `SYNCING_OPS`, whose output size depends on the data."""
    count = [0]
    in_counted = threading.local()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            count[0] += 1
            in_counted.depth = getattr(in_counted, "depth", 0) + 1
            try:
                return _original(self, *args, **kwargs)
            finally:
                in_counted.depth -= 1
        monkeypatch.setattr(torch.Tensor, name, counted)

    class OperatorReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in SYNCING_OPS and not getattr(in_counted, "depth", 0):
                count[0] += 1
            return func(*args, **(kwargs or {}))

    def crosses(src: torch.Tensor, dst_device, non_blocking: bool) -> bool:
        return dst_device is not None and torch.device(dst_device).type != src.device.type \
            and not non_blocking

    original_to, original_copy = torch.Tensor.to, torch.Tensor.copy_

    def to(self, *args, **kwargs):
        device = next((a for a in args if isinstance(a, (str, torch.device))),
                      kwargs.get("device"))
        count[0] += crosses(self, device, kwargs.get("non_blocking", False))
        return original_to(self, *args, **kwargs)

    def copy_(self, src, non_blocking=False):
        count[0] += crosses(src, self.device, non_blocking)
        return original_copy(self, src, non_blocking)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    with OperatorReads():
        yield count


def _model(dtype):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(32, 32) for _ in range(6)]
    return torch.nn.Sequential(*layers).to(dtype)


VARIANTS = {
    "clipped": dict(max_grad_norm=1.0),
    "grad-scaler": dict(max_grad_norm=1.0),          # step() handed grad_scale and found_inf
    "moments": dict(deferred_credit="moments"),      # the device's interim steps
    "bf16-sums": dict(max_grad_norm=1.0, deferred_credit="mean", device_sum_dtype="bfloat16"),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device_sums", [0, 10 ** 9], ids=["host-sums", "device-sums"])
def test_a_step_inside_a_window_reads_the_device_zero_times(variant, dtype, device_sums,
                                                            device_reads):
    if variant in ("moments", "bf16-sums") and not device_sums:
        pytest.skip(f"{variant} applies only to sums on the device")
    model = _model(dtype)
    opt = zenflow.ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval=4,
                               overlap_step=True, device_sum_budget=device_sums, worker=False,
                               **VARIANTS[variant])
    loss_scale = 2.0 ** 8
    reads = []
    for step in range(10):
        loss = model(torch.randn(4, 32, dtype=dtype)).float().square().mean()
        if variant == "grad-scaler":   # what torch.amp.GradScaler hands a step that unscales
            (loss * loss_scale).backward()
            opt.grad_scale = torch.tensor(loss_scale)
            opt.found_inf = torch.zeros(())
        else:
            loss.backward()
        windows, inside = opt.num_windows, opt.counters.window_steps > 0
        before = device_reads[0]
        opt.step()
        if inside and opt.num_windows == windows:   # neither a window's first step nor its last
            reads.append(device_reads[0] - before)
        opt.zero_grad()
    opt.close()
    assert len(reads) == 5 and all(n == 0 for n in reads), reads


SHAPES = [(7, 9), (5, 3, 2), (11,), (4, 12), (6,)]


@pytest.mark.parametrize("settings", [
    dict(overlap_step=True, max_grad_norm=1.0),
    dict(overlap_step=False, device_sum_budget=10 ** 9, install_lookahead=0.0,
         deferred_credit="mean"),
    dict(overlap_step=True, deferred_credit="moments", device_sum_budget=10 ** 9,
         max_grad_norm=2.0, install_lookahead=0.0),
], ids=["host-sums-overlap-clipped", "device-sums", "moments"])
def test_a_skip_inside_a_window_reads_nothing_and_is_settled_at_its_end(settings, device_reads):
    """Steps 5 (inf) and 6 (GradScaler's found_inf) of the window of steps 4 to 7 are skipped:
    they read nothing and change no weight; the window's end counts them, divides its mean by
    the 2 kept steps, and the result is the reference's (given NaN gradients at those steps). A
    state saved right after the skips resumes bit for bit."""
    gen = torch.Generator().manual_seed(3)
    values = [torch.randn(s, generator=gen) for s in SHAPES]
    params = [v.clone().requires_grad_() for v in values]
    ref_params = [v.clone() for v in values]
    kwargs = dict(lr=0.02, betas=(0.9, 0.995), eps=1e-8, weight_decay=0.1, topk_ratio=0.3,
                  update_interval=4, **settings)
    opt = zenflow.ZenFlowAdamW(params, **kwargs, worker=False)
    ref_kwargs = {k: v for k, v in kwargs.items() if k != "device_sum_budget"}
    ref = ReferenceZenFlow(ref_params, **ref_kwargs)
    saved = None
    for t in range(12):
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        if t == 5:
            grads[0][1, 2] = math.inf
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.found_inf = torch.ones(()) if t == 6 else None
        before, weights = device_reads[0], [p.detach().clone() for p in params]
        opt.step()
        if t in (5, 6):
            assert device_reads[0] == before
            assert all(torch.equal(p, w) for p, w in zip(params, weights)), t
            assert opt.counters.skipped_steps == 0 and opt.counters.window_steps == t - 3
        ref.step([torch.full(g.shape, math.nan) if t in (5, 6) else g.clone() for g in grads])
        for i, (p, r) in enumerate(zip(params, ref_params)):
            torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {t}, param {i}: {m}")
        if t == 6:
            saved = ([p.detach().clone() for p in params], opt.state_dict())
            assert opt.counters.skipped_steps == 2
            grads_after = []
        if t > 6:
            grads_after.append(grads)
    assert opt.skipped_steps == ref.skipped == 2 and opt.counters.step == 12
    assert opt.num_windows == 3
    # resume after the skips, mid-window: the same steps give the same weights, bit for bit
    resumed = [w.clone().requires_grad_() for w in saved[0]]
    again = zenflow.ZenFlowAdamW(resumed, **kwargs, worker=False)
    again.load_state_dict(saved[1])
    for grads in grads_after:
        for p, g in zip(resumed, grads):
            p.grad = g.clone()
        again.step()
    for p, q in zip(params, resumed):
        assert torch.equal(p, q)
    opt.close()
    again.close()


class _TwoRanks:
    """A stand-in for two ranks' Partition: a vote's result is whether either rank's flag is
    set, known only once both ranks voted."""

    def __init__(self):
        self.votes: list[list[bool]] = []

    def rank(self, r: int):
        outer = self

        class _Rank:
            def start_any(self, flag, what):
                if r == 0:
                    outer.votes.append([flag])
                else:
                    outer.votes[-1].append(flag)
                vote = outer.votes[-1]
                return lambda: any(vote)
        return _Rank()


def test_the_rank_vote_ends_a_window_one_step_after_every_rank_was_ready():
    ranks = _TwoRanks()
    agreements = [DelayedAgreement(ranks.rank(0)), DelayedAgreement(ranks.rank(1))]
    ready = [[False, True, True, True, False, True, True],     # rank 0's rule, step by step
             [False, False, True, True, True, True, True]]     # rank 1's
    ends = [[], []]
    for step in range(7):
        for r in (0, 1):
            ended = agreements[r].ends(ready[r][step], forced=False)
            ends[r].append(ended)
            if ended:
                agreements[r].forget()
    # both ready at step 2: the window ends at step 3 on both; both again at 5: ends at 6
    assert ends[0] == ends[1] == [False, False, False, True, False, False, True]
    assert DelayedAgreement(ranks.rank(0)).ends(False, forced=True)   # max_steps: at once


def test_windows_dropped_one_after_the_other_are_warned_about(caplog):
    """An overflow in every window drops every window's deferred gradients: the host's columns
    do not train. Each skip alone is ordinary (INFO for GradScaler's); windows dropped in a row
    are a WARNING, at 2 and 4 in a row, and not for a lone dropped window."""
    import logging
    w = torch.nn.Parameter(torch.randn(8, 6))
    opt = zenflow.ZenFlowAdamW([w], topk_ratio=0.25, update_interval=2, worker=False)
    with caplog.at_level(logging.INFO, logger="zenflow"):
        for t in range(12):
            w.grad = torch.randn(8, 6)
            # a lone overflow in the first window, then one in each of the last four
            overflow = t == 1 or (t >= 5 and t % 2 == 1)
            opt.found_inf = torch.ones(()) if overflow else None
            opt.step()
    opt.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "2 windows in a row" in warnings[0] \
        and "4 windows in a row" in warnings[1], warnings
