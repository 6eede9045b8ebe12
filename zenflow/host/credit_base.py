"""What every deferred-credit rule shares (zenflow/host/credit.py lists the rules): the placement
of the window sums and a rule's device state, the fused steps the moving rules take, and
`Credit`, the base class, which is the "mean" rule."""
from __future__ import annotations

from collections.abc import Container, Iterable, Sequence

import torch

from zenflow.adamw import step_bound
from zenflow.host.device_sums import launch_runs, picker
from zenflow.host.layout import HostUpdate, shared_update

_CHUNK_ELEMENTS = 1 << 26   # the temporaries of one launch of the interim steps: 256 MiB fp32
_numel = torch.Tensor.numel


def choose_device_summed(numels: list[int], budget_bytes: int,
                         bytes_per_element: int = 4) -> list[int]:
    """The matrices (indices into `numels`, this rank's element counts) whose sums
    (`bytes_per_element` each element) fit `budget_bytes`, taken in order: every matrix saves the
    same bus bytes per byte of device memory, so the order does not matter and the split is easy
    to predict."""
    chosen, used = [], 0
    for i, numel in enumerate(numels):
        if numel and used + bytes_per_element * numel <= budget_bytes:
            chosen.append(i)
            used += bytes_per_element * numel
    return chosen


def choose_placement(numels: list[int], budget_bytes: int, moments_bytes: int = 0,
                     sum_bytes: int = 4) -> tuple[list[int], list[int]]:
    """(summed, moving): the matrices whose sums (`sum_bytes` per element: 4 for fp32, 2 for
    bf16) fit `budget_bytes`, and of those, with what is left, the ones that also fit
    `moments_bytes` per element more (the squares and rates of "moments"; 0: none) and an fp32
    sum (a "moments" matrix's sum is fp32). Every sum first: a matrix summed on the device saves
    the bus and the host a copy of its gradient every step, which a tight device cannot afford
    to trade for better windows."""
    summed = choose_device_summed(numels, budget_bytes, sum_bytes)
    if not moments_bytes:
        return summed, []
    spare = budget_bytes - sum_bytes * sum(numels[i] for i in summed)
    chosen = set(summed)
    moving = choose_device_summed([n if i in chosen else 0 for i, n in enumerate(numels)],
                                  spare, moments_bytes + 4 - sum_bytes)
    return summed, moving


def chunks_of(indices: list[int], tensors: dict[int, torch.Tensor]):
    """`indices` in runs of at most _CHUNK_ELEMENTS elements (at least one matrix each)."""
    if not indices:
        return []
    numels = dict(zip(indices, map(_numel, picker(indices)(tensors))))
    if sum(numels.values()) <= _CHUNK_ELEMENTS:   # (C-level: the common case, one run)
        return [indices]
    return launch_runs(indices, numels.__getitem__, _CHUNK_ELEMENTS)


def kept(grads: list[torch.Tensor], coef: torch.Tensor) -> list[torch.Tensor]:
    """`grads` where the step's factor `coef` (0-dim, on their device) is not 0, else zeros, in
    fp32 (the interim step's arithmetic, as the reference's: products of bf16 gradients and
    rates rounded to bf16 put a bf16 model's weights 2 ulps off it in a few steps). The interim
    step writes the weights, so a skipped step (coef 0), whose gradients may hold inf or NaN (and
    0 times those is NaN), must move them by exactly nothing; a kept step's gradients are finite
    and pass unchanged."""
    keep = coef != 0
    zero = torch.zeros((), device=coef.device)   # one, not a scalar tensor made per gradient
    return [torch.where(keep, g, zero).float() for g in grads]


def bounded_step(weights: list[torch.Tensor], steps: list[torch.Tensor], bound: float,
                  lr: float) -> None:
    """weights -= lr * clamp(steps, -bound, bound), in fp32 (the fp32 steps promote the add) and
    rounded once to the weights' dtype; `steps` is overwritten."""
    torch._foreach_clamp_min_(steps, -bound)
    torch._foreach_clamp_max_(steps, bound)
    torch._foreach_add_(weights, steps, alpha=-lr)


class Credit:
    """The "mean" rule, and the hooks every rule has (each a no-op here). `i` is a matrix's host
    index; `moving` rules keep device state for some matrices (`moves(i)`)."""

    name = "mean"
    host_rates = False    # the host layout keeps a rate buffer per dtype (zenflow/host/layout.py)
    host_factors = False  # ... and the factors buffer ("factored")
    fp32_sums = False     # the moving matrices' window sums are fp32 whatever device_sum_dtype
    fuses = False         # fused_step() takes a compiled kernel where the device has one

    # -- the host's update ----------------------------------------------------------------------
    def host_update(self, i: int, adamw: tuple[float, float, float, float, float],
                    num_grads: int, delayed: bool, lookahead: float) -> HostUpdate:
        """The host AdamW of matrix i for a window of `num_grads` gradients, from its group's
        (lr, beta1, beta2, eps, weight_decay); `delayed`: it is installed one window later, and
        leads by `lookahead` of a step (nothing else is stale)."""
        return shared_update(*adamw, lookahead=lookahead if delayed else 0.0)

    def host_steps(self, i: int, num_grads: int) -> int:
        """The host AdamW count a window of `num_grads` gradients adds to matrix i."""
        return 1

    # -- the device's state ---------------------------------------------------------------------
    def place(self, numels: list[int], budget_bytes: int, sum_bytes: int,
              dtypes: list[torch.dtype], shapes: list[tuple[int, int]]
              ) -> tuple[list[int], list[int]]:
        """(summed on the device, moving): which matrices' sums, and which of those the rule's
        own device state, fit `budget_bytes` (`shapes`: each matrix's (rows, cols))."""
        return choose_device_summed(numels, budget_bytes, sum_bytes), []

    def allocate(self, moving: dict[int, tuple[int, int, torch.dtype]],
                 device: torch.device) -> None:
        """The rule's device state of the matrices `moving` (index -> rows, cols, dtype)."""

    # The matrices that take the rule's device work (their values change every step): a
    # moving rule's own dict of them.
    moving: Container[int] = ()

    def moves(self, i: int) -> bool:
        return i in self.moving

    def moving_among(self, indices: Iterable[int]) -> list[int]:
        """Those of `indices` that move, in their order (one C-level pass, no Python each)."""
        return list(filter(self.moving.__contains__, indices))

    def nbytes(self) -> int:
        return 0

    # -- each step ------------------------------------------------------------------------------
    def step_sizes(self, groups: dict[int, dict]) -> dict[int, tuple[float, float]] | None:
        """Each matrix's (learning rate, AdamW's step bound) for the interim steps and the
        install's correction, from its param group (index -> group); None: the rule takes none."""
        return None

    def fused_step(self, rows: dict[int, torch.Tensor], whole: dict[int, torch.Tensor],
                   sums: dict[int, torch.Tensor], weights: Sequence[torch.Tensor],
                   fresh: list[int], coef: torch.Tensor,
                   sizes: dict[int, tuple[float, float]] | None) -> set[int]:
        """Before the sums' add: the matrices of `rows` (this rank's rows of each gradient;
        `whole`: every row the device holds, which interim() moves) whose window sum (`sums`),
        add() and interim() (`weights[i]`: the [rows, cols] view the interim step writes) the
        rule took in one fused kernel each (none here), which the step then leaves out of the
        three."""
        return set()

    @property
    def prints_moves(self) -> bool:
        """Whether fused_step() fingerprints the host's columns of the matrices it moves, before
        and after (zenflow/optim/outside_writes.py then reads none of them around the move)."""
        return False

    def take_prints(self) -> tuple[list[int], torch.Tensor] | None:
        """The last fused_step()'s fingerprints, once: (indices, [n, 2] int32, before and
        after the move), or None."""
        return None

    def take_correct_prints(self) -> tuple[list[int], torch.Tensor] | None:
        """The last correct()'s fingerprints of the matrices it corrected in fused kernels,
        once: (indices, [n] int32, after the correction), or None."""
        return None

    def add(self, rows: dict[int, torch.Tensor], fresh: list[int], coef: torch.Tensor) -> None:
        """After the window's sums took this step's `rows` (times `coef`): the rule's own sums
        (`fresh`: the window's first gradient)."""

    def interim(self, weights: dict[int, torch.Tensor], grads: dict[int, torch.Tensor],
                coef: torch.Tensor, sizes: dict[int, tuple[float, float]] | None) -> None:
        """The interim step of the values the device does not update itself: `weights` and
        `grads` are the [rows, cols] views of every row the device holds (a DDP replica's
        every rank's)."""

    def clear(self) -> None:
        """A window with a skipped step: the rule's sums count for nothing."""

    def owned_columns(self, i: int, columns: torch.Tensor | None) -> None:
        """The device owns `columns` of matrix i from now on (None: none, before a selection)."""

    # -- windows and installs -------------------------------------------------------------------
    def copy_out(self, matrices: list[int], host, sum_slot: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(host destination, device source) pairs that go to the host (a HostState) with the
        window's sums (into slot `sum_slot`) for the jobs `matrices`."""
        return []

    def install_pairs(self, i: int, host) -> list[tuple]:
        """(device destination, host source) pairs that an install of matrix i copies besides
        its values, from `host` (a HostState)."""
        return []

    def gather_rates(self, matrices: list[int], host) -> None:
        """DDP: an install brings `matrices` new rates from `host` (a HostState), which holds
        this rank's share of them; the rule's device state takes every rank's. A collective:
        every rank calls it at the same install with the same matrices."""

    def gather_loaded(self) -> None:
        """DDP: after a load (or the first placement), the rule's device state that spans every
        rank's rows from each rank's own. At every HostPipeline.place(), on every rank alike,
        before anything of the step reads or installs that state."""

    def correct(self, weights: dict[int, torch.Tensor], sums: dict[int, torch.Tensor],
                sizes: dict[int, tuple[float, float]], counts: dict[int, int]) -> None:
        """An install's correction of the installed values `weights` of this rank's rows (all
        of them but under DDP, where each rank corrects its own before they are gathered) for
        the `counts[i]` gradients summed (in the window's device `sums`) since its update was
        handed off."""

    def device_owns(self, i: int, columns: torch.Tensor) -> None:
        """The device steps `columns` of matrix i itself (they were just written over)."""

    @property
    def interim_taken(self) -> bool:
        """Whether the device moved installed values since (synchronize() then reinstalls the
        host's values)."""
        return False

    # -- checkpoints ----------------------------------------------------------------------------
    def saved(self, i: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Matrix i's (sum of squares, rates), fp32 on the CPU (zeros where the rule keeps none,
        shaped `like`)."""
        return torch.zeros_like(like), torch.zeros_like(like)

    def load(self, i: int, squares: torch.Tensor, rate: torch.Tensor, grad_sum: torch.Tensor,
             num_grads: int) -> None:
        """Restore what saved() returned (before the first step: kept until allocate()), beside
        the window's `grad_sum` of `num_grads` gradients."""

    def saved_factors(self, i: int, host, num_grads: int) -> dict:
        """Matrix i's own saved tensors beyond saved()'s ("factored": "row_factors",
        "col_factors"; none where the rule keeps none), from the device and `host` (a HostState)
        with `num_grads` gradients in the window."""
        return {}

    def load_factors(self, i: int, piece: dict, host) -> None:
        """Restore what saved_factors() returned (`piece`: the matrix's saved host piece, which
        may hold none of them: a state saved where it took another rule)."""


class MovingCredit(Credit):
    """A rule that moves the deferred columns on the device between installs ("moments",
    "factored"): the window counts as its gradients' AdamW steps on the host, and the device
    takes an interim step every step and an install's correction, each at the rule's own rates.
    A subclass says what its rates are (`rated`) and which matrices it moves (`moves`)."""

    def rated(self, values: list[torch.Tensor], chunk: list[int]) -> list[torch.Tensor]:
        """`values` (of the matrices `chunk`, every row the device holds) times their rates: new
        fp32 tensors."""
        raise NotImplementedError

    def own_rated(self, values: list[torch.Tensor], chunk: list[int]) -> list[torch.Tensor]:
        """rated() of this rank's own rows of the matrices (an install's correction): the same
        where a rank's rows are all it holds; DDP's replicas hold every rank's."""
        return self.rated(values, chunk)

    def host_update(self, i, adamw, num_grads, delayed, lookahead):
        if not self.moves(i):
            return super().host_update(i, adamw, num_grads, delayed, lookahead)
        lr, *rest = adamw
        # the window's n steps at once; the interim steps answer the delay instead of a lookahead
        return shared_update(lr * num_grads, *rest, lookahead=0.0, moments=True,
                          factored=self.host_factors)

    def host_steps(self, i, num_grads):
        return num_grads if self.moves(i) else 1

    def step_sizes(self, groups):
        # per param group, then per matrix in C-level passes (a step asks for them all)
        ids = list(map(id, groups.values()))
        sizes = {key: (float(g["lr"]), step_bound(*g["betas"]))
                 for key, g in dict(zip(ids, groups.values())).items()}
        return dict(zip(groups, map(sizes.__getitem__, ids)))

    def interim(self, weights, grads, coef, sizes):
        """weights[i] -= lr * clamp(coef * grads[i] * rate[i], -bound, bound), (lr, bound) =
        sizes[i], computed in fp32 and rounded once: the interim step of every value the device
        does not update itself (its own columns are written over afterwards). `bound` is AdamW's
        own bound on a step, in units of lr (zenflow.adamw.step_bound): it keeps a value whose
        rate is stale from moving further than AdamW could, where a row that saw no gradient for
        long (an embedding's rare token) has v near 0 and a rate near 1 / eps. On a skipped step
        (coef 0) the step is 0. A few fused launches per (lr, bound) and chunk."""
        moving = self.moving_among(grads)
        keys = picker(moving)(sizes)
        groups: dict[tuple, list[int]] = {keys[0]: moving} if len(set(keys)) == 1 else {}
        if len(groups) != 1:   # (C-level passes above: the common case, one lr for all)
            for i, key in zip(moving, keys):
                groups.setdefault(key, []).append(i)
        for (lr, bound), indices in groups.items():
            for chunk in chunks_of(indices, grads):
                pick = picker(chunk)
                moves = self.rated(kept(pick(grads), coef), chunk)
                torch._foreach_mul_(moves, coef)
                bounded_step(list(pick(weights)), moves, bound, lr)

    def correct(self, weights, sums, sizes, counts):
        """weights[i] -= lr * clamp(sums[i] * rate[i], -counts[i] * bound, counts[i] * bound):
        the install's step for the counts[i] gradients summed since the update it installs was
        handed off (weights[i] holds the installed values; a bf16 sum is read widened), each
        bounded as interim() bounds one."""
        groups: dict[tuple, list[int]] = {}
        for i in weights:
            groups.setdefault((*sizes[i], counts[i]), []).append(i)
        for (lr, bound, count), indices in groups.items():
            for chunk in chunks_of(indices, sums):
                moves = self.own_rated([sums[i].float() for i in chunk], chunk)
                bounded_step([weights[i] for i in chunk], moves, count * bound, lr)
