"""Weights written outside the optimizer become its master values (`OutsideWrites`)."""
from __future__ import annotations

import logging

import torch

from zenflow.optim import columns
from zenflow.optim.params import HostParam, VectorParam

log = logging.getLogger("zenflow")

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values as integers of the same width: compared or summed, they tell any change."""
    return t.view(_BITS[t.element_size()])


def column_bit_sums(matrix: torch.Tensor) -> torch.Tensor:
    """The bits of each column of a [rows, cols] matrix summed as int32 (exact modulo 2**32):
    the kernel of a window end's fingerprint (zenflow selftest measures its speed)."""
    return _bits(matrix).sum(dim=0, dtype=torch.int32)


class OutsideWrites:
    """Parameters written outside the optimizer since it last wrote them become the new master
    values, as if the optimizer had been built on them; the moments stay.

    Most writes are seen at the next step: anything that bumps a tensor's version counter
    (model.load_state_dict, an in-place edit under no_grad; the optimizer's own writes go
    through .data and do not) and a parameter given new storage (`p.data = t`,
    vector_to_parameters). In-place writes through `.data` (`p.data.clamp_()`) bump nothing; they
    are found at window ends, where a fingerprint of what the optimizer last wrote (an integer
    sum of the bits of each matrix's host-owned columns; bf16/fp16 vectors compared with their
    masters) costs two passes and one read per window. Such a write to
    a column the device updates is overwritten by the next step, so the first one found is
    reported with a warning.

    A saved state carries each parameter's `weight_bits` as they were when it was saved. Weights
    written after load_state_dict() and before the next step that are exactly those (the same
    checkpoint's weights loaded after the optimizer's state, as torch.distributed.checkpoint's
    set_state_dict does) belong with the state: they are taken as they are, and an update in
    flight stays; any other weights are adopted as above."""

    def __init__(self, host_params: list[HostParam], vector_params: list[VectorParam],
                 pipeline, selector, owner: str):
        self.host_params, self.vector_params = host_params, vector_params
        self.pipeline, self.selector, self.owner = pipeline, selector, owner
        self._warned = False
        self._saved_bits: dict = {}   # {param: weight_bits of a state just loaded}
        self.forget()

    @staticmethod
    def weight_bits(x: HostParam | VectorParam) -> torch.Tensor:
        """The parameter's (this rank's rows') fingerprint: each row's bits summed (int64,
        exact), a vector's elements one by one; one value per row, so that it is split across
        ranks as the rows are."""
        t = x.local.detach()
        rows = t.reshape(t.shape[0], -1) if t.ndim >= 2 else t.reshape(-1, 1)
        return _bits(rows).sum(dim=1, dtype=torch.int64)

    def adopt(self) -> None:
        """At each step: adopt what version counters and storage pointers show. The first time
        after a load, also what the fingerprints show (a load may write without bumping a
        version counter), less the weights that are exactly the loaded state's own."""
        held = (*self.host_params, *self.vector_params)
        changed = {x.param for x in held if x.local._version != self._versions[x.param]
                   or x.local.data_ptr() != self._pointers[x.param]}
        if self._saved_bits:
            changed |= self._written_through_data()
            own = {x.param for x in held if x.param in changed and x.param in self._saved_bits
                   and torch.equal(self.weight_bits(x), self._saved_bits[x.param])}
            changed -= own
            self._saved_bits = {}   # only weights loaded before the first step go with a state
            if own and not changed:
                self.forget()   # the state's own weights: nothing to adopt
                return
        self._adopt([m for m in self.host_params if m.param in changed],
                    [v for v in self.vector_params if v.param in changed])

    def _written_through_data(self) -> set:
        """The parameters whose fingerprint changed (one read of the device for all). Matrices
        the device steps every step (a credit rule that moves them, as "moments" does) change by
        design: only their version counters tell."""
        chosen = self.selector.has_chosen
        hosts = [m for m in self.host_params if not self.pipeline.credit.moves(m.host_index)]
        watched = [v for v in self.vector_params
                   if v.state.master.data_ptr() != v.local.data_ptr()]
        flags = [*(self._host_sum(m, chosen) != self._sums[m.param] for m in hosts),
                 *(self._vector_differs(v) for v in watched)]
        if not flags:
            return set()
        changed = torch.stack(flags).tolist()   # the one read
        return {x.param for x, c in zip((*hosts, *watched), changed) if c}

    def adopt_data_writes(self) -> None:
        """At window ends: adopt writes through .data, found by the fingerprints."""
        changed = self._written_through_data()
        if changed and not self._warned:
            self._warned = True
            log.warning("%s: parameter(s) were written through .data (found at a window end) "
                        "and are adopted as the new master values; a write through .data to "
                        "the columns and vectors the device updates every step is overwritten "
                        "by the next step. Write under torch.no_grad() without .data (p.clamp_() "
                        "rather than p.data.clamp_()) and the optimizer sees it at once.",
                        self.owner)
        self._adopt([m for m in self.host_params if m.param in changed],
                    [v for v in self.vector_params if v.param in changed])

    def _adopt(self, host: list[HostParam], vectors: list[VectorParam]) -> None:
        if not host and not vectors:
            return
        log.info("%s: adopting the new values of %d parameter(s) changed outside the optimizer",
                 self.owner, len(host) + len(vectors))
        self.pipeline.adopt([m.host_index for m in host])
        chosen = self.selector.has_chosen
        for m in host:
            if chosen and m.k > 0:
                m.selected_from_param()
        for v in vectors:
            v.master_from_param()
        self.forget()

    def forget(self, saved_bits: dict | None = None) -> None:
        """Take the parameters as they are now as the optimizer's own; `saved_bits`: the
        weight_bits of a state just loaded, whose weights may still be loaded."""
        self._saved_bits = saved_bits or {}
        held = (*self.host_params, *self.vector_params)
        self._versions = {x.param: x.local._version for x in held}
        self._pointers = {x.param: x.local.data_ptr() for x in held}
        self.fingerprint()

    def fingerprint(self, matrices: list[int] | None = None) -> None:
        """Remember the host-owned columns as the optimizer last wrote them (after installs,
        selections and adoptions), of the host matrices `matrices` (default: all)."""
        chosen = self.selector.has_chosen
        if matrices is None:
            self._sums = {}
        watched = (self.host_params if matrices is None
                   else [self.host_params[i] for i in matrices])
        self._sums.update({m.param: self._host_sum(m, chosen) for m in watched
                           if not self.pipeline.credit.moves(m.host_index)})  # see _written_through_data

    @staticmethod
    def _host_sum(m: HostParam, chosen: bool) -> torch.Tensor:
        """The bits of the parameter's host-owned columns, summed: per-column sums in one
        contiguous pass (no column gather), less the device-owned columns'. int32 sums wrap
        around, exact modulo 2**32, and run as fast as a float sum (an int64 sum is 25x slower
        on a CPU, where it would cost more than the step)."""
        if not (chosen and m.k > 0):
            return _bits(m.local.detach()).sum(dtype=torch.int32)
        per_column = column_bit_sums(columns.as_matrix(m.local.detach()))
        return per_column.sum(dtype=torch.int32) - per_column[m.selected.column_indices].sum(
            dtype=torch.int32)

    @staticmethod
    def _vector_differs(v: VectorParam) -> torch.Tensor:
        return (_bits(v.local.detach()) != _bits(v.state.master.to(v.local.dtype))).any()


