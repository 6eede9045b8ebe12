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
    factored  "moments" with the squares as their row and column sums and the rates as a row
              factor times a column factor (zenflow/host/credit_factored.py): O(rows + cols)
              beside the window sum, which may be bf16. Under FSDP2 each rank fits its own row
              shard's factors, as if the shard were the whole matrix; under DDP each rank its
              own row block's (zenflow/host/credit_replicas.py)

A rule is a `Credit` (zenflow/host/credit_base.py), called by the pipeline and the installs at
fixed points of a step; the base class is "mean", whose every hook does nothing. Adding a rule is
a subclass (here, or in a module of its own as "factored"), its name in `CREDITS`, the name in
config/rules.py's DeferredCredit, and a test.
"""
from __future__ import annotations

import torch

from zenflow.host.credit_base import (
    Credit,
    MovingCredit,
    choose_device_summed,
    choose_placement,
    chunks_of,
)
from zenflow.host.credit_factored import FactoredCredit
from zenflow.host.credit_replicas import ReplicaFactoredCredit
from zenflow.host.device_sums import picker
from zenflow.host.layout import rate_dtype, shared_update

__all__ = ["CREDITS", "Credit", "FactoredCredit", "MomentsCredit", "ReplicaFactoredCredit",
           "WindowCredit", "choose_device_summed", "choose_placement", "credit_for",
           "on_replicas", "takes_moments"]


class WindowCredit(Credit):
    """The host step of a window of n gradients takes n times the learning rate."""

    name = "window"

    def host_update(self, i, adamw, num_grads, delayed, lookahead):
        lr, *rest = adamw
        return shared_update(lr * num_grads, *rest, lookahead=lookahead if delayed else 0.0)


class MomentsCredit(MovingCredit):
    """The window as that many AdamW steps, with interim steps on the device at the host's last
    rates and an install's correction. Its device state per moving matrix: the window's sum of
    squares (fp32) and the rates (bf16 for 16-bit weights: fp16 cannot hold 1 / eps)."""

    name = "moments"
    host_rates = True
    fp32_sums = True

    def __init__(self):
        self.squares: dict[int, torch.Tensor] = {}
        self.rates: dict[int, torch.Tensor] = {}
        self._restored: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # loaded before placed
        self._placed = False

    def place(self, numels, budget_bytes, sum_bytes, dtypes, shapes):
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

    @property
    def moving(self):
        return self.rates

    def nbytes(self):
        return sum(t.numel() * t.element_size()
                   for part in (self.squares, self.rates) for t in part.values())

    def add(self, rows, fresh, coef):
        squared = list(filter(self.squares.__contains__, rows))
        if not squared:
            return
        zeroed = [self.squares[i] for i in fresh if i in self.squares]
        if zeroed:
            torch._foreach_zero_(zeroed)
        for chunk in chunks_of(squared, rows):   # (coef * g)^2 from an fp32 product, as the reference
            pick = picker(chunk)
            scaled = torch._foreach_mul(list(map(torch.Tensor.float, pick(rows))), coef)
            torch._foreach_addcmul_(list(pick(self.squares)), scaled, scaled)

    def clear(self):
        if self.squares:
            torch._foreach_zero_(list(self.squares.values()))

    def copy_out(self, matrices, host, sum_slot):
        return [(host.square_sum(sum_slot, i), self.squares[i]) for i in matrices
                if i in self.squares]

    def install_pairs(self, i, host):
        return [(self.rates[i], host.rate(i))] if i in self.rates else []

    def rated(self, values, chunk):
        return torch._foreach_mul(values, list(picker(chunk)(self.rates)))

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


CREDITS = {rule.name: rule for rule in (Credit, WindowCredit, MomentsCredit, FactoredCredit)}


def takes_moments(name: str, budget: int | str, cuda: bool, splits_rows: bool) -> bool:
    """Whether deferred_credit `name` can put any matrix under a rule that moves the deferred
    columns on the device ("moments", "factored"; credit_for says why not)."""
    return credit_for(name, budget, cuda, splits_rows).name in ("moments", "factored")


def credit_for(name: str, budget: int | str, cuda: bool, splits_rows: bool) -> Credit:
    """The rule `name` (deferred_credit). "moments" and "factored" cannot apply where no sum can
    be on the device (a budget of 0; "auto" on a CPU "device", which has none to spare): there
    every matrix takes "mean", and the host keeps no rates.

    Each rank runs the rule on its own rows. Under FSDP2 a rank's rows are its whole local
    shard: "moments" per value, and "factored" as if the shard were the whole matrix (the row
    and column sums of its squares over its own rows, its own alpha for its rows and beta for
    its shard). Under DDP (`splits_rows`) each rank sums its share of every replica's rows and
    every replica must move alike: "factored" fits each rank's row block the same way, and the
    ranks gather the factors (O(rows + ranks * cols) a matrix per window; on_replicas() makes
    the pipeline's rule of it); "moments" takes "mean" there, since its rates are per value and
    gathering them would move a whole matrix per window. Fitted per block is finer than one
    factorization of the whole matrix: "factored" on several ranks equals one process's whose
    factors are fitted per row block of ceil(rows / ranks) rows, not one process's
    (docs/semantics.md)."""
    no_room = budget == 0 or (budget == "auto" and not cuda)
    if (name in ("moments", "factored") and no_room) or (name == "moments" and splits_rows):
        return Credit()
    return CREDITS[name]()


def on_replicas(credit: Credit, partition, whole_rows: list[int]) -> Credit:
    """`credit` as the host pipeline of `partition` runs it, whose matrices have `whole_rows`
    rows: under DDP (`partition.splits_rows`) "factored" fits each rank's row block and gathers
    every rank's factors (ReplicaFactoredCredit); everything else as it is. "moments" cannot
    run on replicas (credit_for gives "mean" there)."""
    if not partition.splits_rows:
        return credit
    if type(credit) is FactoredCredit:
        return ReplicaFactoredCredit(partition, whole_rows)
    if isinstance(credit, MomentsCredit):
        raise ValueError("deferred_credit='moments' cannot run on DDP replicas, whose ranks each "
                         "sum their share of every matrix's rows (credit_for gives 'mean' there)")
    return credit
