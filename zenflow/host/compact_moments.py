"""host_moments_dtype="bfloat16": Adam's two moments kept on the host in bf16, 2 bytes each
instead of 4. That is 4 bytes less host memory per parameter (Llama-2-7B: 27 GB), and 8 bytes
less memory traffic per parameter in each host update (of about 28 with fp32 moments).

The arithmetic stays fp32. An update widens a chunk's moments into fp32 scratch (exactly), runs
the same fp32 code as with fp32 moments, and rounds them back to bf16. The second moment is
rounded **stochastically**: up with a probability equal to how far the value lies towards the next
bf16 number. Rounding it to nearest would stall it. It moves (1 - beta2^n) of the way to the
window's mean square, 0.1% a step with the default beta2, and bf16 keeps 8 significant bits: a
change under 2^-9 of the value rounds away, so v could sit at twice or half its value. Stochastic
rounding keeps it unbiased. The first moment moves 10% of the way a step, so rounding to nearest
stalls it only within about 2% of its value; it is rounded to nearest, one vectorized conversion
where stochastic rounding costs four passes (this CPU: 0.9 ns a value, against a fused AdamW's 2).

The random bits are the low 16 bits of the same parameter's new fp32 master value, which changes
with every update. They depend only on the state, so no generator state goes into a checkpoint,
and a resumed run, the worker and the in-process runner all round alike (tests recompute them).
An element whose master value does not change (lr 0) rounds the same way each time, as truncation
would.
"""
from __future__ import annotations

import torch

_LOW_BITS = 0xFFFF


SCRATCH = 5   # thread_scratch buffers a pass takes with bf16 moments: its own two, then these three


def fp32_moments(m: torch.Tensor, v: torch.Tensor, scratch: tuple[torch.Tensor, ...]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The moments `m`, `v` as fp32 tensors of their shape: themselves where they are fp32, else
    widened (exactly) into scratch[2] and scratch[3] (thread_scratch(n, SCRATCH))."""
    if m.dtype == torch.float32:
        return m, v
    return _widen(m, scratch[2]), _widen(v, scratch[3])


def store_moments_(m: torch.Tensor, v: torch.Tensor, m32: torch.Tensor, v32: torch.Tensor,
                   master: torch.Tensor, scratch: tuple[torch.Tensor, ...]) -> None:
    """After the update: nothing where fp32_moments returned the moments themselves; else the
    bf16 `m`, `v` := `m32` (to nearest) and `v32` (overwritten; stochastically, with bits of the
    updated fp32 `master`): module doc."""
    if m32 is m:
        return
    m.copy_(m32)
    round_stochastic_(v, v32, master, scratch[4].view(torch.int32))


def _widen(moment: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    return scratch[:moment.numel()].view(moment.shape).copy_(moment)


def round_stochastic_(out: torch.Tensor, values: torch.Tensor, source: torch.Tensor,
                      noise: torch.Tensor) -> None:
    """out (bf16) := `values` (fp32, same shape, contiguous; overwritten) rounded
    stochastically, the random bits being the low 16 of the fp32 `source`'s (same shape; a bf16
    value is the high half of an fp32's bits). `noise`: flat int32 scratch of at least
    values.numel() elements."""
    bits = values.view(-1).view(torch.int32)
    draw = noise[:values.numel()]
    torch.bitwise_and(source.reshape(-1).view(torch.int32), _LOW_BITS, out=draw)
    # Adding below the kept 16 bits carries into them with the probability the dropped bits
    # give; sign and magnitude are apart in a float, so a negative value rounds its magnitude
    # the same way (unbiased too).
    bits.add_(draw)
    # The high 16 bits, by an arithmetic shift: a value in int16's range, which a (vectorized)
    # int32 -> int16 copy keeps exactly (a strided copy of the bf16 halves is 1.5x slower)
    out.view(-1).view(torch.int16).copy_(bits.bitwise_right_shift_(16))

