"""deferred_credit="factored" on DDP's replicas (zenflow/distributed.py: `splits_rows`): each
rank fits its own row block, as FSDP2's ranks fit their shards (docs/semantics.md, "Deferred
credit"), so DDP's "factored" is one process's whose factors are fitted per row block of
ceil(rows / ranks) rows (zenflow.optim.reference's `row_blocks`).

What a rank sums is as in one process, over its own rows: the window sum S and the squares' row
and column sums, and its host fits alpha of its rows and beta of its block (zenflow/host/
factored.py, unchanged). What differs is that every replica must move alike, and every row:

- The device holds alpha of every row [R] and beta of every rank's block [ranks, C] (block k
  applies to rank k's rows), beside its own rows' statistics: 4 own rows + 4 R + 8 C + 4 ranks C
  bytes a matrix. The interim step moves the whole replica at every rank's factors, from the
  whole (averaged) gradient: identical on every rank.
- An install brings each rank's new factors on its host; one all-gather per install puts every
  rank's into every device (`gather_rates`). The install's correction needs the window sum,
  which each rank has of its own rows only: each rank corrects its own rows at its own factors
  before the ranks gather them (zenflow/optim/installs.py), so the gather spreads corrected rows.
- The ranks agree on the matrices the rule moves (a rank's "auto" budget is its own, and the
  last rank holds fewer rows): a matrix moves where every rank placed its state.
- On a GPU a step of a matrix is one compiled kernel (factored_kernels.replica_step_: the sums of
  its own rows, the move of every row at its block's factors), as one process's is.
- A rank's state saves its own rows' and block's factors, as one process's; after a load (and at
  the first placement) the next step gathers every rank's into the device (`gather_loaded`).
"""
from __future__ import annotations

import torch

from zenflow.distributed import Partition
from zenflow.host.credit_factored import FactoredCredit
from zenflow.host.factored_kernels import replica_step_, replica_steps_


def replica_factor_bytes(rows: int, whole_rows: int, cols: int, ranks: int) -> int:
    """Device bytes of a matrix's factored state beside its sum on a DDP replica: the row sums
    of this rank's `rows` and alpha of all `whole_rows` (fp32), the column sums and the mask
    (fp32 [C]) and beta of every rank's block (fp32 [ranks, C])."""
    return 4 * rows + 4 * whole_rows + 8 * cols + 4 * ranks * cols


class ReplicaFactoredCredit(FactoredCredit):
    """"factored" on DDP replicas (module doc). `whole_rows`: every host matrix's rows in the
    replica, in the pipeline's order."""

    # the statistics sum this rank's rows, the interim step moves every rank's
    step_kernels = (replica_step_, replica_steps_)

    def __init__(self, partition: Partition, whole_rows: list[int]):
        if not partition.splits_rows:
            raise ValueError("ReplicaFactoredCredit is for DDP's replicas (a partition that "
                             "splits_rows); one process and FSDP2's shards take FactoredCredit")
        super().__init__()
        self.partition = partition
        self.whole_rows = list(whole_rows)
        # each moving matrix's (rank, that rank's rows) for every rank that holds some, and
        # the rank of each of its rows ([R] on the device: the step kernel's)
        self._blocks: dict[int, list[tuple[int, slice]]] = {}
        self._block_of_row: dict[int, torch.Tensor] = {}
        self._gather_due = False

    def _own_rows(self, i: int) -> slice:
        return self.partition.rows(self.whole_rows[i])

    # -- placement ------------------------------------------------------------------------------
    def state_bytes(self, i, rows, cols):
        return replica_factor_bytes(rows, self.whole_rows[i], cols, self.partition.world_size)

    def factor_shapes(self, i, rows, cols):
        return (self.whole_rows[i],), (self.partition.world_size, cols)

    def allocate(self, moving, device):
        """The matrices every rank placed (one small collective), then their state; every
        rank's factors are gathered at the next place() (a load may have restored them)."""
        votes = self.partition.gather_objects(sorted(moving), "agreeing on the matrices "
                                              "deferred_credit='factored' moves")
        agreed = set.intersection(*(set(v) for v in votes))
        super().allocate({i: shape for i, shape in moving.items() if i in agreed}, device)
        ranks = self.partition.world_size
        for i in self.alpha:
            blocks = [(k, Partition(rank=k, world_size=ranks).rows(self.whole_rows[i]))
                      for k in range(ranks)]
            self._blocks[i] = [(k, rows) for k, rows in blocks if rows.stop > rows.start]
            self._block_of_row[i] = torch.cat(
                [torch.full((rows.stop - rows.start,), k, dtype=torch.long)
                 for k, rows in self._blocks[i]]).to(device)
        self._gather_due = True

    def own_factors(self, i):
        return self.alpha[i][self._own_rows(i)], self.beta[i][self.partition.rank]

    # -- each step ------------------------------------------------------------------------------
    def step_columns(self, pick, rows, whole, sums, weights):
        """replica_step_'s tensors: every row's gradient and this rank's."""
        return (pick(weights), pick(whole), pick(rows), pick(sums), pick(self.row_sq),
                pick(self.col_sq), pick(self.alpha), pick(self.beta), pick(self._block_of_row),
                pick(self.deferred))

    def rated(self, values, chunk):
        """(values alpha_i) beta_j of whole replicas, with each rank's block at its own beta: a
        row block of a contiguous matrix is a contiguous view, so one launch for all blocks."""
        moves = torch._foreach_mul(values, [self._alpha_column[i] for i in chunk])
        blocks = [(move[rows], self.beta[i][k])
                  for move, i in zip(moves, chunk) for k, rows in self._blocks[i]]
        torch._foreach_mul_([b for b, _ in blocks], [beta for _, beta in blocks])
        return moves

    def own_rated(self, values, chunk):
        """(values alpha_i) beta_j of this rank's rows, at its block's factors."""
        moves = torch._foreach_mul(values, [self.own_factors(i)[0].unsqueeze(1) for i in chunk])
        torch._foreach_mul_(moves, [self.own_factors(i)[1] for i in chunk])
        return moves

    # -- installs and loads ---------------------------------------------------------------------
    def install_pairs(self, i, host):
        return []   # the factors come through gather_rates instead

    def gather_rates(self, matrices, host):
        """Every rank's new factors of `matrices` from its host (its rows' alpha, its block's
        beta) into every device's alpha and beta: one all-gather. The same matrices move on
        every rank, so every rank takes part or none does."""
        moving = [i for i in matrices if i in self.alpha]
        if moving:
            own = [t for i in moving for t in self._padded(i, *host.factors(i)[3:])]
            self._gather(moving, self.partition.from_host(torch.cat(own)),
                         "installing deferred_credit='factored' factors")

    def gather_loaded(self):
        """After a load, or the first placement: every rank's own factors, as its device holds
        them, into every device's (each rank loads its own state: every rank takes part)."""
        if not self._gather_due:
            return
        self._gather_due = False
        moving = sorted(self.alpha)
        if moving:
            own = [t for i in moving for t in self._padded(i, *self.own_factors(i))]
            self._gather(moving, torch.cat(own).to(self.partition.device),
                         "gathering loaded deferred_credit='factored' factors")

    def load_factors(self, i, piece, host):
        super().load_factors(i, piece, host)
        self._gather_due = True

    def _padded(self, i: int, alpha: torch.Tensor, beta: torch.Tensor) -> list[torch.Tensor]:
        """This rank's alpha (padded to every rank's row count) and beta of matrix i, as one
        rank's part of the all-gather."""
        pad = self.partition.rows_per_rank(self.whole_rows[i]) - alpha.shape[0]
        return [alpha, alpha.new_zeros(pad), beta]

    def _gather(self, moving: list[int], own: torch.Tensor, what: str) -> None:
        """alpha and beta of `moving` := every rank's part of `own` (_padded, in order)."""
        every = self.partition.gather_stacked(own, what)   # [ranks, own.numel()]
        start = 0
        for i in moving:
            per_rank, cols = self.partition.rows_per_rank(self.whole_rows[i]), self.beta[i].shape[1]
            self.alpha[i].copy_(every[:, start:start + per_rank].reshape(-1)[:self.whole_rows[i]])
            self.beta[i].copy_(every[:, start + per_rank:start + per_rank + cols])
            start += per_rank + cols
