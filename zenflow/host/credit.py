"""The deferred-credit rules (`deferred_credit`, docs/semantics.md "Deferred credit"): what a
window's deferred columns are credited with, from the window's end until its update is installed.

    mean      the host's AdamW takes the window's mean gradient as one step; an update installed
              a window late leads by `install_lookahead` of a step (DeepSpeed's rule, plus the
              lookahead)
    window    the same step with the learning rate times the window's gradients
    moments   the host's moments take the window as that many AdamW steps would; the device moves
              the deferred columns every step at the host's last rates, and an install corrects
              the host's values for the window's gradients the host has not applied. It needs
              the matrix's window sum on the device, and beside it the sum of squares and the
              rates: a matrix that does not fit the device budget takes "mean"

A rule is a `Credit`, called by the pipeline and the installs at fixed points of a step; the base
class is "mean", whose every hook does nothing. Adding a rule is a subclass here, its name in
`CREDITS`, the name in config/rules.py's DeferredCredit, and a test.
"""
from __future__ import annotations

import torch

from zenflow.adamw import step_bound
from zenflow.host.device_sums import launch_runs
from zenflow.host.layout import HostUpdate, rate_dtype

_CHUNK_ELEMENTS = 1 << 26   # the temporaries of one launch of the interim steps: 256 MiB fp32


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


def _chunks(indices: list[int], tensors: dict[int, torch.Tensor]):
    """`indices` in runs of at most _CHUNK_ELEMENTS elements (at least one matrix each)."""
    return launch_runs(indices, lambda i: tensors[i].numel(), _CHUNK_ELEMENTS)


def _kept(grads: list[torch.Tensor], coef: torch.Tensor) -> list[torch.Tensor]:
    """`grads` where the step's factor `coef` (0-dim, on their device) is not 0, else zeros, in
    fp32 (the interim step's arithmetic, as the reference's: products of bf16 gradients and
    rates rounded to bf16 put a bf16 model's weights 2 ulps off it in a few steps). The interim
    step writes the weights, so a skipped step (coef 0), whose gradients may hold inf or NaN (and
    0 times those is NaN), must move them by exactly nothing; a kept step's gradients are finite
    and pass unchanged."""
    keep = coef != 0
    return [torch.where(keep, g, 0.0).float() for g in grads]


def _bounded_step(weights: list[torch.Tensor], steps: list[torch.Tensor], bound: float,
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

    # -- the host's update ----------------------------------------------------------------------
    def host_update(self, i: int, adamw: tuple[float, float, float, float, float],
                    num_grads: int, delayed: bool, lookahead: float) -> HostUpdate:
        """The host AdamW of matrix i for a window of `num_grads` gradients, from its group's
        (lr, beta1, beta2, eps, weight_decay); `delayed`: it is installed one window later, and
        leads by `lookahead` of a step (nothing else is stale)."""
        return HostUpdate(*adamw, lookahead=lookahead if delayed else 0.0)

    def host_steps(self, i: int, num_grads: int) -> int:
        """The host AdamW count a window of `num_grads` gradients adds to matrix i."""
        return 1

    # -- the device's state ---------------------------------------------------------------------
    def place(self, numels: list[int], budget_bytes: int, sum_bytes: int,
              dtypes: list[torch.dtype]) -> tuple[list[int], list[int]]:
        """(summed on the device, moving): which matrices' sums, and which of those the rule's
        own device state, fit `budget_bytes`."""
        return choose_device_summed(numels, budget_bytes, sum_bytes), []

    def allocate(self, moving: dict[int, tuple[int, int, torch.dtype]],
                 device: torch.device) -> None:
        """The rule's device state of the matrices `moving` (index -> rows, cols, dtype)."""

    def moves(self, i: int) -> bool:
        """Whether matrix i takes the rule's device work (its values change every step)."""
        return False

    def nbytes(self) -> int:
        return 0

    # -- each step ------------------------------------------------------------------------------
    def step_sizes(self, groups: dict[int, dict]) -> dict[int, tuple[float, float]] | None:
        """Each matrix's (learning rate, AdamW's step bound) for the interim steps and the
        install's correction, from its param group (index -> group); None: the rule takes none."""
        return None

    def add(self, rows: dict[int, torch.Tensor], fresh: list[int], coef: torch.Tensor) -> None:
        """After the window's sums took this step's `rows` (times `coef`): the rule's own sums
        (`fresh`: the window's first gradient)."""

    def interim(self, weights: dict[int, torch.Tensor], rows: dict[int, torch.Tensor],
                coef: torch.Tensor, sizes: dict[int, tuple[float, float]] | None) -> None:
        """The interim step of the values the device does not update itself."""

    def clear(self) -> None:
        """A window with a skipped step: the rule's sums count for nothing."""

    # -- windows and installs -------------------------------------------------------------------
    def copy_out(self, matrices: list[int], targets) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(host destination, device source) pairs that go to the host with the window's sums
        for the jobs `matrices`; `targets(i)` is where matrix i's go."""
        return []

    def install_pairs(self, i: int, host_rate: torch.Tensor) -> list[tuple]:
        """(device destination, host source) pairs that an install of matrix i copies besides
        its values."""
        return []

    def correct(self, weights: dict[int, torch.Tensor], sums: dict[int, torch.Tensor],
                sizes: dict[int, tuple[float, float]], counts: dict[int, int]) -> None:
        """An install's correction of the installed values `weights` for the `counts[i]`
        gradients summed (in the window's device `sums`) since its update was handed off."""

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


class WindowCredit(Credit):
    """The host step of a window of n gradients takes n times the learning rate."""

    name = "window"

    def host_update(self, i, adamw, num_grads, delayed, lookahead):
        lr, *rest = adamw
        return HostUpdate(lr * num_grads, *rest, lookahead=lookahead if delayed else 0.0)


class MomentsCredit(Credit):
    """The window as that many AdamW steps, with interim steps on the device at the host's last
    rates and an install's correction. Its device state per moving matrix: the window's sum of
    squares (fp32) and the rates (bf16 for 16-bit weights: fp16 cannot hold 1 / eps)."""

    name = "moments"
    host_rates = True

    def __init__(self):
        self.squares: dict[int, torch.Tensor] = {}
        self.rates: dict[int, torch.Tensor] = {}
        self._restored: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # loaded before placed
        self._placed = False

    def host_update(self, i, adamw, num_grads, delayed, lookahead):
        if not self.moves(i):
            return super().host_update(i, adamw, num_grads, delayed, lookahead)
        lr, *rest = adamw
        # the window's n steps at once; the interim steps answer the delay instead of a lookahead
        return HostUpdate(lr * num_grads, *rest, lookahead=0.0, moments=True)

    def host_steps(self, i, num_grads):
        return num_grads if self.moves(i) else 1

    def place(self, numels, budget_bytes, sum_bytes, dtypes):
        extra = 4 + max((rate_dtype(d).itemsize for d in dtypes), default=0)
        return choose_placement(numels, budget_bytes, extra, sum_bytes)

    def allocate(self, moving, device):
        self.squares = {i: torch.zeros(rows, cols, dtype=torch.float32, device=device)
                        for i, (rows, cols, _) in moving.items()}
        self.rates = {i: torch.zeros(rows, cols, dtype=rate_dtype(dtype), device=device)
                      for i, (rows, cols, dtype) in moving.items()}
        for i, (squares, rate) in self._restored.items():
            if i in self.rates:
                self.squares[i].copy_(squares)
                self.rates[i].copy_(rate)
        self._restored = {}
        self._placed = True

    def moves(self, i):
        return i in self.rates

    def nbytes(self):
        return sum(t.numel() * t.element_size()
                   for part in (self.squares, self.rates) for t in part.values())

    def step_sizes(self, groups):
        return {i: (float(g["lr"]), step_bound(*g["betas"])) for i, g in groups.items()}

    def add(self, rows, fresh, coef):
        squared = [i for i in rows if i in self.squares]
        if not squared:
            return
        zeroed = [self.squares[i] for i in fresh if i in self.squares]
        if zeroed:
            torch._foreach_zero_(zeroed)
        for chunk in _chunks(squared, rows):   # (coef * g)^2 from an fp32 product, as the reference
            scaled = torch._foreach_mul([rows[i].float() for i in chunk], coef)
            torch._foreach_addcmul_([self.squares[i] for i in chunk], scaled, scaled)

    def interim(self, weights, rows, coef, sizes):
        """weights[i] -= lr * clamp(coef * rows[i] * rate[i], -bound, bound), (lr, bound) =
        sizes[i]: the interim step of every value the device does not update itself (its own
        columns are written over afterwards). `bound` is AdamW's own bound on a step, in units
        of lr (zenflow.adamw.step_bound): it keeps a value whose rate is stale from moving
        further than AdamW could, where a row that saw no gradient for long (an embedding's rare
        token) has v near 0 and a rate near 1 / eps. On a skipped step (coef 0) the step is 0.
        A few fused launches per (lr, bound) and chunk."""
        groups: dict[tuple, list[int]] = {}
        for i in rows:
            if i in self.rates:
                groups.setdefault(sizes[i], []).append(i)
        for (lr, bound), indices in groups.items():
            for chunk in _chunks(indices, rows):
                moves = torch._foreach_mul(_kept([rows[i] for i in chunk], coef),
                                           [self.rates[i] for i in chunk])
                torch._foreach_mul_(moves, coef)
                _bounded_step([weights[i] for i in chunk], moves, bound, lr)

    def clear(self):
        if self.squares:
            torch._foreach_zero_(list(self.squares.values()))

    def copy_out(self, matrices, targets):
        return [(targets(i), self.squares[i]) for i in matrices if i in self.squares]

    def install_pairs(self, i, host_rate):
        return [(self.rates[i], host_rate)] if i in self.rates else []

    def correct(self, weights, sums, sizes, counts):
        """weights[i] -= lr * clamp(sums[i] * rate[i], -counts[i] * bound, counts[i] * bound):
        the install's step for the counts[i] gradients summed since the update it installs was
        handed off (weights[i] holds the installed values), each bounded as interim() bounds
        one."""
        groups: dict[tuple, list[int]] = {}
        for i in weights:
            groups.setdefault((*sizes[i], counts[i]), []).append(i)
        for (lr, bound, count), indices in groups.items():
            for chunk in _chunks(indices, sums):
                moves = torch._foreach_mul([sums[i] for i in chunk],
                                           [self.rates[i] for i in chunk])
                _bounded_step([weights[i] for i in chunk], moves, count * bound, lr)

    def device_owns(self, i, columns):
        if i in self.rates:
            self.rates[i].index_fill_(1, columns, 0.0)

    @property
    def interim_taken(self):
        return bool(self.rates)

    def saved(self, i, like):
        if i in self.rates:
            return (self.squares[i].to("cpu", copy=True),
                    self.rates[i].to("cpu", torch.float32, copy=True))
        if i in self._restored:   # loaded, and no step has placed them yet
            return tuple(t.to(torch.float32, copy=True) for t in self._restored[i])
        return super().saved(i, like)

    def load(self, i, squares, rate, grad_sum, num_grads):
        if num_grads and not squares.any() and grad_sum.any():
            # Saved where this matrix took another rule (its sums on the host, or another
            # placement): no squares were summed. Taking zero squares for the window's second
            # moment would make its host step huge; take each gradient as the window's mean
            # (the least the squares can be), as a state older than the squares does.
            squares = grad_sum.float().square() / num_grads
        if i in self.rates:
            self.squares[i].copy_(squares)
            self.rates[i].copy_(rate)
        elif not self._placed:   # placed at the first step
            self._restored[i] = (squares.clone(), rate.clone())


CREDITS = {rule.name: rule for rule in (Credit, WindowCredit, MomentsCredit)}


def takes_moments(name: str, budget: int | str, cuda: bool, splits_rows: bool) -> bool:
    """Whether deferred_credit `name` can put any matrix under "moments" (credit_for says why)."""
    return isinstance(credit_for(name, budget, cuda, splits_rows), MomentsCredit)


def credit_for(name: str, budget: int | str, cuda: bool, splits_rows: bool) -> Credit:
    """The rule `name` (deferred_credit). "moments" cannot apply under data parallel, where each
    rank sums only its rows and every replica must move alike (the interim steps would need every
    rank's sums and rates), nor where no sum can be on the device (a budget of 0; "auto" on a CPU
    "device", which has none to spare): there every matrix takes "mean", and the host keeps no
    rates."""
    if name == "moments" and (splits_rows or budget == 0 or (budget == "auto" and not cuda)):
        return Credit()
    return CREDITS[name]()
