"""Host-summed gradients start their copy during backward.

A matrix whose window sum lives on the host (zenflow/host/device_sums.py decides which at the
first step) sends its gradient rows to a staging buffer every step. Started in stage(), that copy
waits for the whole backward; started in the parameter's post-accumulate-grad hook, it runs on the
copy stream (on a CPU "device", the copy thread) while the backward goes on, and step() finds it
done. The hooks are the optimizer's, registered on its own parameters and removed by close().

The user may change a gradient between backward and step(): clip_grad_norm_, GradScaler.unscale_,
a manual in-place scaling, another micro-batch's backward, zero_grad, `p.grad = ...`. So an early
copy counts only if, at step(), the gradient is the same tensor at the same version
(`Tensor._version`, which every in-place write bumps) as when its copy was queued; otherwise
stage() copies it again, late, exactly as without hooks, and the staging bytes are the same
either way. Two writes do not bump the version: GradScaler.unscale_ (its kernel,
torch._amp_foreach_non_finite_check_and_unscale_, does not), which the optimizer tells from what
scaler.step() hands it (step_began(unscaled_in_place=True): every copy of that step is late), and
a write through `.data`, numpy or a `.data` hook (`p.grad.data.mul_()` in older code). Those are
looked for by fingerprint (the gradient's bits summed on the device when its copy is queued and
again at step()) in the first window that copies early and every CHECK_EVERY-th window after,
and read at the window's end, where the optimizer reads anyway: a training loop does the same
thing every step, so a sample finds it at a few passes over the copied gradients per sampled
step. Once found, the window's sums hold gradients as backward left them, a warning says so and
what to do, and every copy is late from then on. Write to the gradient itself. clip_grad_norm_ or
unscale_ after backward makes every copy late; use max_grad_norm=, which folds the clipping and
the unscaling into the factor the host applies instead of rewriting the gradients.

When a hook copies. Accumulating micro-batches fires a hook once per backward; copying at every
firing would multiply the bus traffic, so each matrix copies only at the firing that was its last
in the last step that staged it (step_began() counts the firings of each step(), take() keeps the
counts of the matrices it staged). The first step has no counts, so it copies nothing early, and
a matrix the host gets no gradient rows of (all its columns on the device) never copies. A
backward that no step follows (an evaluation), two backwards before a step, a zero_grad in
between: each costs at most a copy the version check rejects, never a wrong result.

A hook never blocks the Python thread: it writes the staging slot the next stage() uses only if
no host command reads that slot now (asked without waiting), and only if it gets the optimizer's
lock without waiting (a step(), or a state_dict() on another thread, owns the pipeline then).
Otherwise it leaves the copy to step().

Ordering is the late copies': an early copy's ticket joins the step's own, so the worker reads
the slot only once it has landed, and step()'s fence orders later device work (an in-place
zero_grad, the next backward) after it. Started during backward, it has usually landed by then,
so the fence rarely waits. Copies land in the order queued (one stream, one thread), so a late
copy of a gradient overwrites a rejected early one.

Only where a copy runs beside compute (a CUDA side stream, or the CPU's copy thread with the
worker), and in one process: under data parallel a hook sees the gradient before it is averaged
across ranks, and DDP averages in place in its buckets, which the version counter may not see.
"""
from __future__ import annotations

import functools
import logging
import threading
import weakref
from dataclasses import dataclass

import torch

from zenflow.host.staging import Staging
from zenflow.host.transfers import Ticket, all_of

log = logging.getLogger("zenflow")

CHECK_EVERY = 16   # windows between two that look for gradients written through .data
_INTEGERS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bit_sum(grad: torch.Tensor) -> torch.Tensor:
    """The gradient's bits summed as int32 (exact modulo 2**32), on its device: any write shows."""
    return grad.detach().view(_INTEGERS[grad.element_size()]).sum(dtype=torch.int32)


@dataclass(frozen=True)
class _EarlyCopy:
    """What a hook copied: which gradient tensor, at which version, into which staging slot, and
    in a window that looks for writes through .data, the fingerprint of what it copied."""
    grad: weakref.ref     # weak: a gradient replaced since (zero_grad, p.grad = ...) is freed
    version: int
    slot: int
    fingerprint: torch.Tensor | None


def _gradient_ready(copies: weakref.ref, index: int, param: torch.Tensor) -> None:
    """The post-accumulate-grad hook. It holds its owner weakly, so a parameter never keeps a
    dropped optimizer's pipeline alive."""
    owner = copies()
    if owner is not None:
        owner.gradient_ready(index, param)


class EarlyCopies:
    """The hooks on one pipeline's host-summed parameters and what they copied since stage()."""

    def __init__(self, staging: Staging, params: list[torch.Tensor],
                 lock: threading.RLock | None, owner: str = "ZenFlowAdamW"):
        self._staging = staging
        self._owner = owner
        self._shapes = [tuple(p.shape) for p in params]
        self.checking = True                    # this window looks for writes through .data
        self._quiet_windows = 0
        self._compared: list[tuple[int, torch.Tensor]] = []   # (matrix, changed?) on the device
        self._lock = lock
        self._fired: dict[int, int] = {}        # hook firings of each matrix in this step
        self._step_fired: dict[int, int] = {}   # ... that led to the step() under way
        self._copy_at: dict[int, int] = {}      # ... in the last step that staged it
        self._copies: dict[int, _EarlyCopy] = {}
        self._tickets: list[Ticket] = []        # every early copy queued since stage(), used or not
        self._bytes = 0
        self._unscaled_in_place = False
        self.early = self.late = 0              # matrices staged early / late, over all steps
        watched = lock is not None and _copies_can_start_early(staging)
        owner = weakref.ref(self)
        self._hooks = {i: p.register_post_accumulate_grad_hook(
            functools.partial(_gradient_ready, owner, i))
            for i, p in enumerate(params) if watched and p.requires_grad}
        # Dropped without close(), the hooks still go (they hold no reference to undo it).
        self._unhook = weakref.finalize(self, _remove, list(self._hooks.values()))

    def stop_watching(self, indices) -> None:
        """No more early copies of `indices` (their sums are on the device: nothing to copy)."""
        for i in indices:
            hook = self._hooks.pop(i, None)
            if hook is not None:
                hook.remove()

    def close(self) -> None:
        self._hooks = {}
        self._unhook()

    def step_began(self, unscaled_in_place: bool = False) -> None:
        """A step() begins: the hook firings since the last one are this step's.
        `unscaled_in_place`: the gradients were rewritten since backward in a way their versions
        do not show (GradScaler.unscale_), so this step uses no early copy."""
        self._step_fired, self._fired = self._fired, {}
        self._unscaled_in_place = unscaled_in_place

    def gradient_ready(self, i: int, param: torch.Tensor) -> None:
        """Matrix i's gradient has just been accumulated (in backward): copy its rows now if this
        is the firing its copy waits for, and that needs no waiting. A gradient step() will
        refuse (sparse, elsewhere, misshapen) is left for step() to say so."""
        fired = self._fired[i] = self._fired.get(i, 0) + 1
        grad = param.grad
        if (fired != self._copy_at.get(i) or grad is None or grad.layout != torch.strided
                or grad.device != param.device or grad.shape != param.shape
                or not self._lock.acquire(blocking=False)):
            return
        try:
            if i not in self._hooks:   # closed, or summed on the device, since this began
                return
            slot = self._staging.free_staging_slot()
            if slot is None:
                return
            ticket, nbytes = self._staging.copy_to_staging(slot, {i: grad})
            self._copies[i] = _EarlyCopy(weakref.ref(grad), grad._version, slot,
                                         _bit_sum(grad) if self.checking else None)
            self._tickets.append(ticket)
            self._bytes += nbytes
        finally:
            self._lock.release()

    def take(self, grads: dict[int, torch.Tensor], slot: int) -> tuple[set[int], Ticket, int]:
        """At stage(), of `grads` (index -> the gradient to stage into `slot`), the indices whose
        early copy holds exactly that gradient (the same tensor at the same version, in that
        slot); with the ticket and bytes of every early copy queued since the last take(), the
        rejected ones included, so that the worker's read and the fence wait for them too. The
        next step copies `grads` at the firing this step's were at."""
        fired = self._step_fired
        self._copy_at = {i: fired[i] for i in grads if i in fired} if fired else {}
        copies, self._copies = self._copies, {}
        tickets, self._tickets = self._tickets, []
        nbytes, self._bytes = self._bytes, 0
        early = set()
        if copies and not self._unscaled_in_place:
            for i, grad in grads.items():
                copy = copies.get(i)
                if (copy is not None and copy.slot == slot and copy.grad() is grad
                        and copy.version == grad._version):
                    early.add(i)
                    if copy.fingerprint is not None:
                        self._compared.append((i, _bit_sum(grad) != copy.fingerprint))
        self.early += len(early)
        self.late += len(grads) - len(early)
        return early, all_of(*tickets), nbytes


    def window_ended(self) -> None:
        """A window ends (the optimizer reads the device here anyway): if it looked for
        gradients written through .data after their early copy, one read says whether any was;
        the next look is CHECK_EVERY windows later, or never once one was found (every copy is
        late from then on)."""
        if not self.checking:
            self._quiet_windows += 1
            self.checking = self._quiet_windows >= CHECK_EVERY
            return
        if not self._compared:   # nothing copied early yet: look in the next window
            return
        compared, self._compared = self._compared, []
        changed = torch.stack([c for _, c in compared]).tolist()
        written = sorted({i for (i, _), c in zip(compared, changed) if c})
        self.checking, self._quiet_windows = False, 0
        if written:
            self.stop_watching(list(self._hooks))
            log.warning("%s: the gradient of %d matri%s (the first: %s) changed after backward "
                        "without a version bump (through .data, numpy or a .data hook, e.g. "
                        "p.grad.data.mul_()), after its early copy to the host: this window's "
                        "host sums hold the gradient as backward left it. Every copy is late "
                        "from now on (exact, but the copy no longer overlaps backward); write to "
                        "the gradient itself (p.grad.mul_()) to keep early copies.", self._owner,
                        len(written), "x" if len(written) == 1 else "ces",
                        f"shape {self._shapes[written[0]]}")


def _copies_can_start_early(staging: Staging) -> bool:
    """Whether a copy queued in backward runs beside it (else it only moves work into backward),
    and the gradient a hook sees is the one step() gets (one process, unsharded)."""
    partition = staging.partition
    return (staging.transfers.copies_overlap_compute and partition.world_size == 1
            and not partition.rows_are_local)


def _remove(hooks: list) -> None:
    for hook in hooks:
        hook.remove()
