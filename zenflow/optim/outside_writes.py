"""Weights written outside the optimizer become its master values (`OutsideWrites`)."""
from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Collection, Sequence
from itertools import accumulate, filterfalse
from typing import NamedTuple

import torch

from zenflow.distributed import is_sharded
from zenflow.host.device_sums import launch_runs
from zenflow.host.fingerprints import bits, column_sums_of_bits
from zenflow.host.weight_views import WeightViews
from zenflow.optim.device_adam import DeviceColumns, DeviceVector, Runs, picker, runs_of
from zenflow.optim.params import HostParam, VectorParam

log = logging.getLogger("zenflow")

# Lists of matrices whose index tensors a cache keeps (a few recur: all matrices, each layer's
# installs, the matrices a rule moves); the oldest is forgotten first.
_KEEP = 256
_version = operator.attrgetter("_version")
_data_ptr = torch.Tensor.data_ptr


def _kept(cache: dict, key, value):
    """cache[key] = value, as the newest entry, forgetting the oldest beyond _KEEP; `value`."""
    cache.pop(key, None)
    if len(cache) >= _KEEP:
        del cache[next(iter(cache))]
    cache[key] = value
    return value


_CHUNK_ELEMENTS = 1 << 24   # 16-bit values compared at once: at most ~200 MiB of temporaries


def adopt_written(weights: Sequence[torch.Tensor], selected: list[DeviceColumns], runs: Runs,
                  vectors: list[tuple[torch.Tensor, DeviceVector]]) -> None:
    """The device's masters := what was written into their parameters since the optimizer last
    wrote them: the matrices' (`weights` as [out, in] and their `selected` columns) and
    `vectors`' ((parameter, state) pairs).

    A write through `.data` (a WGAN's `p.data.clamp_()`) bumps no version counter, and the next
    step would write the masters over it; torch's AdamW keeps it, and so must the columns the
    device owns. Done at every step's start, before anything writes the weights, without reading
    the device: a master in the parameter's dtype is the parameter's values (one gather, a
    ColumnBlock's at once); a 16-bit parameter's fp32 master keeps its low bits where the
    parameter still holds it rounded, and takes the parameter's value elsewhere, in a few
    launches per run of matrices. `runs`: runs_of(selected), kept by the caller."""
    written = []   # (fp32 masters, the weights' values there, narrower)
    for run, block in zip(runs.stacked, runs.blocks):
        members = picker(run)(weights)
        if members[0].dtype == block.master.dtype:
            block.take(members, out=block.master)
        else:
            written.append((block.master, block.take(members)))
    for j in runs.single:
        w, cols = weights[j], selected[j]
        if w.dtype == cols.master.dtype:
            torch.index_select(w, 1, cols.column_indices, out=cols.master)
        else:
            written.append((cols.master, w.index_select(1, cols.column_indices)))
    written += [(state.master, param) for param, state in vectors]
    narrow = []
    for master, values in written:
        if master.dtype == values.dtype:
            if master.data_ptr() != values.data_ptr():
                master.copy_(values)
        else:
            narrow.append((master.view(-1), values.reshape(-1)))
    by_dtype: dict[torch.dtype, list] = {}
    for pair in narrow:
        by_dtype.setdefault(pair[1].dtype, []).append(pair)
    for pairs in by_dtype.values():
        for run in launch_runs(pairs, lambda pair: pair[0].numel(), _CHUNK_ELEMENTS):
            master = torch.cat([m for m, _ in run])
            values = torch.cat([v for _, v in run])
            kept = torch.where(master.to(values.dtype) == values, master, values.float())
            torch.split_with_sizes_copy(kept, [m.numel() for m, _ in run], 0,
                                        out=[m for m, _ in run])


class _HostColumnBitSums:
    """Fingerprints of many matrices at once: each matrix's host-owned columns' bits summed
    (int32, exact modulo 2**32). One launch per matrix (its per-column sums, one contiguous pass,
    no column gather; the members of a ColumnBlock one for all: device_adam.runs_of), then a handful
    for all of them: the device-owned columns' sums zeroed through one flat index and the rest
    summed per matrix by one index_add_. Per matrix a window end's check and its refingerprint
    each cost one launch at most, not six (a Python loop of 5,000 matrices' launches is a step's
    time on a GPU). The flat indices are built once per list of matrices and selection (a few
    lists recur: all matrices, each layer's installs)."""

    def __init__(self, weights: WeightViews, host_params: list[HostParam]):
        self._weights, self._host_params = weights, host_params
        self._plans: dict[tuple, _BitSumPlan] = {}

    def __call__(self, indices: Sequence[int], chosen: bool) -> torch.Tensor:
        """The fingerprints of host matrices `indices` (`chosen`: their device-owned columns
        are left out), as int32 [len(indices)]."""
        plan = self._plan(indices, chosen)
        bits = self._weights.all_bits()
        flat = torch.cat([column_sums_of_bits(torch.stack(pick(bits))).view(-1)
                          for pick in plan.run_picks]
                         + [column_sums_of_bits(b) for b in plan.single_pick(bits)])
        if plan.device_owned.numel():
            flat.index_fill_(0, plan.device_owned, 0)
        return flat.new_zeros(len(indices)).index_add_(0, plan.segments, flat)

    def _plan(self, indices: Sequence[int], chosen: bool) -> _BitSumPlan:
        """Kept per list of matrices, while each one's selected columns are unchanged (a
        reselection writes them in place, which bumps their versions)."""
        key = (chosen, tuple(indices))
        plan = self._plans.get(key)
        if plan is None or list(map(_version, plan.owned)) != plan.versions:
            plan = _kept(self._plans, key, self._planned(key[1], chosen))
        return plan

    def _planned(self, indices: tuple[int, ...], chosen: bool) -> _BitSumPlan:
        """The runs, and the flat indices: where the device-owned columns are in the flat
        per-column sums, and the position in `indices` of each of those sums (the sums come run
        by run, then the singles). A few launches for all the matrices, not one or two each."""
        matrices = [self._host_params[i] for i in indices]
        runs = runs_of([m.selected for m in matrices])
        bits = self._weights.all_bits()
        order = [j for run in runs.stacked for j in run] + runs.single
        widths = [bits[indices[j]].shape[1] for j in order]   # (a shard's: its own)
        starts = list(accumulate(widths, initial=0))
        device = bits[indices[0]].device
        segments = torch.tensor(order, dtype=torch.long, device=device).repeat_interleave(
            torch.tensor(widths, device=device))
        picked = [(matrices[j].selected.column_indices, start) for j, start in zip(order, starts)
                  if chosen and matrices[j].k > 0]
        device_owned = torch.zeros(0, dtype=torch.long, device=device)
        if picked:
            device_owned = torch.cat([i for i, _ in picked]) + torch.tensor(
                [start for _, start in picked], device=device).repeat_interleave(
                torch.tensor([i.numel() for i, _ in picked], device=device))
        owned = [i for i, _ in picked]
        return _BitSumPlan([picker([indices[j] for j in run]) for run in runs.stacked],
                           picker([indices[j] for j in runs.single]), owned,
                           list(map(_version, owned)), device_owned, segments)


class _BitSumPlan(NamedTuple):
    """How _HostColumnBitSums fingerprints a list of matrices."""
    run_picks: list[Callable[[Sequence], Sequence]]   # each whole ColumnBlock's members' bits
    single_pick: Callable[[Sequence], Sequence]       # the other matrices' (by host index)
    owned: list[torch.Tensor]    # the device-owned columns the flat indices were built from
    versions: list[int]          # ... and their versions then
    device_owned: torch.Tensor
    segments: torch.Tensor


class OutsideWrites:
    """Parameters written outside the optimizer since it last wrote them become the new master
    values, as if the optimizer had been built on them; the moments stay.

    Most writes are seen at the next step: anything that bumps a tensor's version counter
    (model.load_state_dict, an in-place edit under no_grad; the optimizer's own writes go
    through .data and do not) and a parameter given new storage (`p.data = t`,
    vector_to_parameters). In-place writes through `.data` (`p.data.clamp_()`) bump nothing; they
    are found at window ends, where a fingerprint of what the optimizer last wrote (an integer
    sum of the bits of each matrix's host-owned columns; bf16/fp16 vectors compared with their
    masters) costs two passes and one read per window. The columns and vectors the device updates
    take such writes at every step instead (adopt_device_writes), and the matrices
    a credit rule moves every step ("moments", "factored") are fingerprinted around each of its
    moves (the compiled "factored" step takes those fingerprints in its own pass), the changes
    kept on the device until the window's read (`watch_moves`). The first write found
    at a window end is reported with a warning.

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
        self._bit_sums = _HostColumnBitSums(pipeline.weight_views, host_params)
        # what the fingerprints were when the optimizer last wrote each host matrix (int32, in
        # host index order), and the index lists into them
        self._sums: torch.Tensor | None = None
        self._position_lists: dict[tuple[int, ...], torch.Tensor] = {}
        self._moved: tuple[tuple[int, ...], torch.Tensor] | None = None   # see watch_moves
        self._held_params = [x.param for x in (*host_params, *vector_params)]
        self._sharded = any(map(is_sharded, self._held_params))
        owning = [m for m in host_params if m.k > 0]   # (what adopt_device_writes reads)
        selected = [m.selected for m in owning]
        self._owning = (picker([m.host_index for m in owning]), selected, runs_of(selected))
        self.forget()

    @staticmethod
    def weight_bits(x: HostParam | VectorParam) -> torch.Tensor:
        """The parameter's (this rank's rows') fingerprint: each row's bits summed (int64,
        exact), a vector's elements one by one; one value per row, so that it is split across
        ranks as the rows are."""
        t = x.local.detach()
        rows = t.reshape(t.shape[0], -1) if t.ndim >= 2 else t.reshape(-1, 1)
        return bits(rows).sum(dim=1, dtype=torch.int64)

    def adopt(self) -> None:
        """At each step: adopt what version counters and storage pointers show. The first time
        after a load, also what the fingerprints show (a load may write without bumping a
        version counter), less the weights that are exactly the loaded state's own."""
        held = (*self.host_params, *self.vector_params)
        tensors = [x.local for x in held] if self._sharded else self._held_params
        if (not self._saved_bits and list(map(_version, tensors)) == self._versions
                and list(map(_data_ptr, tensors)) == self._pointers):
            return   # (C-level passes: the common case, nothing written)
        changed = {x.param for x, version, pointer in zip(held, self._versions, self._pointers)
                   if (t := x.local)._version != version or t.data_ptr() != pointer}
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

    def adopt_device_writes(self) -> None:
        """At each step's start, before anything writes the weights: the columns and vectors the
        device updates take what was written into them, through `.data` too (adopt_written)."""
        vectors = [(v.local, v.state) for v in self._vectors_apart]
        if self.selector.has_chosen:
            pick, selected, runs = self._owning
            adopt_written(pick(self.pipeline.weight_views.all()), selected, runs, vectors)
        else:
            adopt_written((), [], runs_of([]), vectors)

    def _written_through_data(self, fresh: Collection[int] = ()) -> set:
        """The parameters whose fingerprint changed since the optimizer last wrote them (one read
        of the device for all). The matrices the credit rule moved in this window add what
        watch_moves() found before each move. `fresh` (host indices): matrices fingerprinted
        since the optimizer last wrote them, with no other code run since: not read again (a
        window end right after the interim move: every moving matrix, a full pass of them)."""
        chosen = self.selector.has_chosen
        hosts = self.host_params
        if not hosts:
            return set()
        if fresh:
            watched = list(filterfalse(set(fresh).__contains__, range(len(hosts))))
            changed = torch.zeros_like(self._sums, dtype=torch.bool)
            if watched:
                at = self._positions(watched)
                changed[at] = self._bit_sums(watched, chosen) != self._sums.index_select(0, at)
        else:
            changed = self._bit_sums(range(len(hosts)), chosen) != self._sums
        if self._moved is not None:
            moved, found = self._moved   # host indices are positions in host_params
            changed = changed.int().index_add_(0, self._positions(moved), found.int()) > 0
            self._moved = None
        flags = changed.tolist()   # the one read
        return {m.param for m, c in zip(hosts, flags) if c}

    def watch_moves(self, moving: list[int], moved: bool,
                    printed: tuple[list[int], torch.Tensor] | None = None) -> None:
        """Around the credit rule's move of host matrices `moving` (its interim step, which
        writes them every step: a fingerprint taken at the window's start says nothing by its
        end): before it (`moved` False), note on the device which of them someone wrote since
        the optimizer last did; after it, fingerprint them as moved. Two passes over those
        matrices a step, no read. `printed` (after the move): (indices, [n, 2] int32) the
        rule's compiled step took of those it moved, before and after, in its own pass
        (factored_kernels.factored_step_): those are checked and refingerprinted from it, not
        read again."""
        if printed is not None and printed[0]:
            indices, prints = printed
            self._found(tuple(indices), prints[:, 0])
            self._note_moved(indices, prints[:, 1])
            moving = list(filterfalse(set(indices).__contains__, moving))
        if not moving:
            return
        now = self._bit_sums(moving, self.selector.has_chosen)
        if moved:
            self._note_moved(moving, now)
        else:
            self._found(tuple(moving), now)

    def _note_moved(self, moving: list[int], now: torch.Tensor) -> None:
        """Host matrices `moving` have fingerprints `now`, as the optimizer wrote them."""
        self._sums.index_copy_(0, self._positions(moving), now)

    def _found(self, moving: tuple[int, ...], now: torch.Tensor) -> None:
        """Keep, on the device, which of host matrices `moving` differ from their fingerprints
        (`now`, before a move) since the optimizer last wrote them."""
        found = now != self._sums.index_select(0, self._positions(moving))
        if self._moved is not None and self._moved[0] == moving:
            found |= self._moved[1]
        elif self._moved is not None:   # the moving matrices changed: keep both
            moving, found = (*self._moved[0], *moving), torch.cat([self._moved[1], found])
        self._moved = (moving, found)

    def adopt_data_writes(self, fresh: Collection[int] = ()) -> None:
        """At window ends: adopt writes through .data, found by the fingerprints (`fresh`: see
        _written_through_data)."""
        changed = self._written_through_data(fresh)
        if changed and not self._warned:
            self._warned = True
            log.warning("%s: parameter(s) were written through .data (found at a window end) "
                        "and are adopted as the new master values: the columns the host "
                        "updates only now, at the window's end. Write under torch.no_grad() "
                        "without .data (p.clamp_() rather than p.data.clamp_()) and the "
                        "optimizer sees it at the next step.", self.owner)
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
        # (lists in held's order: a step compares them all, and hashing 5,000 tensors costs more)
        self._versions = [x.local._version for x in held]
        self._pointers = [x.local.data_ptr() for x in held]
        # the vectors that are not their own masters (an fp32 one is, until given new storage)
        self._vectors_apart = [v for v in self.vector_params
                               if v.state.master.data_ptr() != v.local.data_ptr()]
        self.fingerprint()

    def fingerprint(self, matrices: list[int] | None = None,
                    printed: tuple[list[int], torch.Tensor] | None = None) -> None:
        """Remember the host-owned columns as the optimizer last wrote them (after installs,
        selections and adoptions), of the host matrices `matrices` (default: all). `printed`:
        (indices, int32 [n]) of those, fingerprinted already (by the install's correction, in
        its own pass over them: host/factored_kernels.py factored_correct_)."""
        chosen = self.selector.has_chosen
        watched = range(len(self.host_params)) if matrices is None else matrices
        if printed is not None and printed[0] and matrices is not None:
            indices, prints = printed
            self._note_moved(indices, prints)
            watched = list(filterfalse(set(indices).__contains__, watched))
        if not watched:
            return
        # int32 sums: as fast as a float sum (int64: 25x slower on a CPU, where it would cost
        # more than the step), exact modulo 2**32
        if matrices is None:
            self._sums = self._bit_sums(watched, chosen)
        else:
            self._sums.index_copy_(0, self._positions(matrices), self._bit_sums(watched, chosen))

    def _positions(self, matrices: list[int] | tuple[int, ...]) -> torch.Tensor:
        """Host indices `matrices` as an index into the sums, on the device (kept per list: a
        few recur, each layer's installs and the matrices a rule moves)."""
        key = tuple(matrices)
        positions = self._position_lists.get(key)
        if positions is None:
            positions = _kept(self._position_lists, key,
                              torch.tensor(key, dtype=torch.long, device=self._sums.device))
        return positions
