"""The host's arithmetic on its buffers: `HostState`, typed views of the buffers of one
optimizer (laid out as zenflow/host/layout.py says), the window sums' accumulation and the host
AdamW update, chunk by chunk.

The host keeps each matrix at full width [rows, in] (rows: this rank's share). It updates all
columns each window and the optimizer installs only the columns the host owns: a device-owned
column's host copy is dead weight until the column comes back, when the device's values overwrite
it. Full width costs ~10% more host arithmetic than keeping only the unselected columns, but a
gradient reaches the host as whole rows (one contiguous copy) and accumulating it is one
streaming add instead of a column scatter.

`HostState` is plain data plus the arena; the worker process rebuilds it from the arena's file
descriptor and the layout, so the same code runs in or out of the training process.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from zenflow.adamw import adam_rate, adamw_, adamw_lookahead, adamw_moments_chunk_
from zenflow.host.arena import Arena, Region
from zenflow.host.compact_moments import SCRATCH, fp32_moments, store_moments_
from zenflow.host.factored import factored_pass
from zenflow.host.layout import HostJob, HostLayout, dtype_name
from zenflow.host.numa import share_bounds
from zenflow.host.scratch import thread_scratch

_CHUNK = 1 << 20  # elements per pass of a dtype-converting add: the fp32 temporary stays in cache
# Elements each thread takes per chunk of the host update. The update does all of a chunk's work
# (AdamW, the rate, the install value) before the next chunk, so the chunk's bytes come from memory
# once and every later touch finds them in the core's cache: 256K elements are 4 MiB of fp32 state
# (master, sum, two moments), within a server core's L2 and its share of L3 (3-5 MiB). Smaller
# chunks would stay in L2, but each chunk costs ~20 us of Python and dispatch, which at 64K
# elements was a third of one core's time (measured: 8.9 ms instead of 14.7 ms per 8M
# parameters with 256K).
PIECE = 1 << 18
# Chunks of a run end at multiples of this many elements from the run's start: torch's fused
# AdamW rounds its scalar tail differently from its SIMD body, so a chunk must end where the whole
# run's vectors would (every SIMD width divides 64); then the results are one call per run's.
_VECTOR_ALIGN = 64


def add_scaled_(sums: list[torch.Tensor], grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """sums += coef * grads, computed in fp32 and rounded once to each sum's dtype (grads of any
    float dtype, coef a 0-dim fp32 tensor): the one arithmetic of every window sum, on the device
    or the host, so that the two agree bit for bit. The factor goes in as a 1-element tensor,
    not a 0-dim one: beside bf16 sums and gradients a 0-dim fp32 factor does not take part in
    type promotion and is rounded to bf16 first (a relative error of up to 2^-9 in every step's
    contribution); a 1-element one makes the arithmetic fp32."""
    torch._foreach_addcmul_(sums, grads, [coef.reshape(1)] * len(sums))


def landing_of(fp32_sum: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where a device sum of `dtype` lands in the host's fp32 sum `fp32_sum` ([rows, cols]): the
    sum itself, or for a narrow dtype the first bytes of it (widen_ makes them the fp32 sum)."""
    if dtype == torch.float32:
        return fp32_sum
    return fp32_sum.view(-1).view(dtype)[:fp32_sum.numel()].view(fp32_sum.shape)


def widen_(fp32_sum: torch.Tensor) -> None:
    """fp32_sum := the bf16 values landing_of() left in its first half, exactly, in place: a
    chunk at a time from the end, each read into a temporary before it is written, so no write
    reaches a narrow value not read yet (chunk [a, b) writes bytes [4a, 4b), and the values
    still unread lie below byte 2a)."""
    flat = fp32_sum.view(-1)
    narrow = flat.view(torch.bfloat16)[:flat.numel()]
    for start in reversed(range(0, flat.numel(), _CHUNK)):
        flat[start:start + _CHUNK].copy_(narrow[start:start + _CHUNK].float())


def chunks(offset: int, numel: int, bounds: list[int], threads: list[int]
           ) -> list[tuple[int, int, int]]:
    """(node, first element, end) of the chunks of the run of `numel` elements at `offset`: the
    run cut where the NUMA shares `bounds` cut it (numa.share_bounds), each cut moved back onto a
    vector boundary of the run (so up to 63 elements go with the share before), then each part
    into chunks of PIECE elements per thread of its node's team (`threads[node]`)."""
    end = offset + numel

    def cut(bound: int) -> int:
        if bound <= offset or bound >= end:
            return min(max(bound, offset), end)
        return offset + (bound - offset) // _VECTOR_ALIGN * _VECTOR_ALIGN
    cuts = [cut(b) for b in bounds]
    out = []
    for node in range(len(bounds) - 1):
        size = PIECE * max(1, threads[node])
        out += [(node, a, min(cuts[node + 1], a + size))
                for a in range(cuts[node], cuts[node + 1], size)]
    return out


@dataclass
class _Run:
    """One run of adjacent matrices of one group of jobs, as one update pass sees it: the
    group's numbers and the run's flat views (made once per run, so that a chunk only slices)."""
    lookahead: float
    moments: bool
    step: int
    num_grads: int
    hyper: dict              # lr, beta1, beta2, eps, weight_decay
    counts: tuple            # (step, window length) as 0-dim fp32 tensors for the fused kernel
    master: torch.Tensor
    exp_avg: torch.Tensor        # fp32, or bf16 (host_moments_dtype: widened a chunk at a time)
    exp_avg_sq: torch.Tensor
    install: torch.Tensor    # the parameters' dtype
    rate: torch.Tensor | None            # "moments" jobs' rates
    sums: torch.Tensor | None            # None: publish only, no AdamW
    squares: torch.Tensor | None         # "moments": the window's sums of squares
    landings: list[tuple[int, int, torch.Tensor]]   # (first, end, bf16 values), run-relative


def _first(landing: tuple) -> int:
    return landing[0]


def _gradients(run: _Run, a: int, b: int, into: torch.Tensor) -> torch.Tensor:
    """Elements [a, b) of the run's window sums: a view of the fp32 sums or, where the chunk
    holds a bf16 landing, `into` filled with them in fp32 (the widening: exact, in cache)."""
    overlapping = [lnd for lnd in run.landings if lnd[0] < b and lnd[1] > a]
    if not overlapping:
        return run.sums[a:b]
    grads, position = into[:b - a], a
    for first, last, values in overlapping:
        lo, hi = max(first, a), min(last, b)
        if lo > position:
            grads[position - a:lo - a].copy_(run.sums[position:lo])
        grads[lo - a:hi - a].copy_(values[lo - first:hi - first])
        position = hi
    if position < b:
        grads[position - a:].copy_(run.sums[position:b])
    return grads


def _chunk(run: _Run, a: int, b: int) -> None:
    """All the work on elements [a, b) of `run`, while they are in cache: AdamW (an update), the
    rates ("moments"), the install values."""
    x, m_stored, sq_stored = run.master[a:b], run.exp_avg[a:b], run.exp_avg_sq[a:b]
    scratch = thread_scratch(b - a, 2 if m_stored.dtype == torch.float32 else SCRATCH)
    m, sq = fp32_moments(m_stored, sq_stored, scratch)   # (bf16 ones widened, stored at the end)
    denom = None
    if run.sums is not None:
        grads = _gradients(run, a, b, scratch[0])
        if run.moments:
            denom = adamw_moments_chunk_(x, grads, run.squares[a:b], m, sq, run.step,
                                         run.num_grads, scratch=scratch[1], **run.hyper)
        else:
            adamw_([x], [grads], [m], [sq], [run.counts[0]], grad_divisor=run.counts[1],
                   **run.hyper)
    if run.moments:
        if denom is None:   # publish(): the rates from the moments as they are
            adam_rate(run.rate[a:b], sq, run.step, beta2=run.hyper["beta2"],
                      eps=run.hyper["eps"])
        else:               # the update's own denominator: adam_rate's arithmetic, done once
            run.rate[a:b].copy_(denom.reciprocal_())
    if run.lookahead:
        adamw_lookahead(run.install[a:b], x, m, sq, run.step, fraction=run.lookahead,
                        scratch=scratch[1], **run.hyper)
    else:
        run.install[a:b].copy_(x)
    if run.sums is not None:
        store_moments_(m_stored, sq_stored, m, sq, x, scratch)


class HostState:
    """Typed views of the host buffers of one optimizer, and the host arithmetic over them."""

    def __init__(self, arena: Arena, layout: HostLayout):
        self.arena = arena
        self.layout = layout
        # Set by the worker on a multi-node host (zenflow/host/teams.py): runs each NUMA node's
        # share of an update on that node's cores. None: the calling thread runs it all.
        self.teams = None
        # Set by the worker: a thread per worker core, one torch thread each, for updates made
        # of many small operators (zenflow/host/factored.py). None: `teams` or this thread.
        self.lanes = None
        # made once: steps reuse them (a step stages every matrix: two operators each)
        self._typed_views: dict[str, list[torch.Tensor | None]] = {}
        self._fp32_views: dict[tuple, torch.Tensor | tuple] = {}   # fp32(), factors(), landing()
        self._staging_names = [f"staging{slot}" for slot in range(layout.staging_slots)]

    @classmethod
    def allocate(cls, layout: HostLayout, owner: str = "ZenFlowAdamW",
                 available: int | None = None, nodes: list[int] | None = None) -> HostState:
        return cls(Arena.create(layout.regions(), owner, available, nodes), layout)

    @classmethod
    def attach(cls, layout: HostLayout, regions: list[Region], size: int, fd: int) -> HostState:
        return cls(Arena.attach(regions, size, fd), layout)

    def nbytes(self) -> int:
        """Bytes of host state (the arena rounds each buffer up to whole pages on top)."""
        return sum(r.nbytes for r in self.arena.regions)

    # -- views --------------------------------------------------------------------------------
    def fp32(self, kind: str, i: int) -> torch.Tensor:
        """[rows, cols] view of matrix i in an fp32 buffer ("master", "grad_sum0", ...), made
        once (a window end asks for every matrix's: two operators each)."""
        view = self._fp32_views.get((kind, i))
        if view is None:
            m = self.layout.matrices[i]
            view = self._fp32_views[kind, i] = \
                self.arena.views[kind][m.offset:m.offset + m.numel].view(m.rows, m.cols)
        return view

    def landing(self, kind: str, i: int, dtype: torch.dtype) -> torch.Tensor:
        """landing_of(fp32(kind, i), dtype): where a device sum of `dtype` lands, made once."""
        view = self._fp32_views.get((kind, i, dtype))
        if view is None:
            view = self._fp32_views[kind, i, dtype] = landing_of(self.fp32(kind, i), dtype)
        return view

    def state(self, kind: str, i: int) -> torch.Tensor:
        """[rows, cols] view of matrix i's AdamW state `kind` ("master", "exp_avg",
        "exp_avg_sq"): fp32, the moments in layout.moments_dtype."""
        return self.fp32(kind, i)   # (laid out as the fp32 buffers, whatever the dtype)

    def stacked_state(self, kind: str, matrices: list[int]) -> torch.Tensor | None:
        """`matrices`' state `kind` as one [n, rows, cols] view where they are alike and back
        to back in that order (HostLayout.build places alike small ones so), else None."""
        first = self.layout.matrices[matrices[0]]
        if any(self.layout.matrices[i].offset != first.offset + j * first.numel
               or self.layout.matrices[i].numel != first.numel for j, i in enumerate(matrices)):
            return None
        flat = self.arena.views[kind][first.offset:first.offset + len(matrices) * first.numel]
        return flat.view(len(matrices), first.rows, first.cols)

    def staging(self, slot: int, i: int) -> torch.Tensor:
        """[rows, cols] view of matrix i in staging buffer `slot` (the param's dtype)."""
        return self._typed(self._staging_names[slot], i)

    def step_coef(self, slot: int) -> torch.Tensor:
        """The 0-dim factor of the gradients in staging buffer `slot`."""
        return self.arena.views["step_coef"][slot]

    def install(self, i: int) -> torch.Tensor:
        """[rows, cols] view of matrix i in the install buffer (the param's dtype)."""
        return self._typed("install", i)

    def rate(self, i: int) -> torch.Tensor:
        """[rows, cols] view of matrix i in the rate buffer (deferred_credit="moments")."""
        return self._typed("rate", i)

    def factors(self, i: int) -> tuple[torch.Tensor, ...]:
        """Matrix i's views of the factors buffer (deferred_credit="factored"): the window's row
        sums of squares [rows], column sums [cols], host-owned mask [cols], alpha [rows], beta
        [cols]."""
        views = self._fp32_views.get(("factors", i))
        if views is None:
            m = self.layout.matrices[i]
            flat = self.arena.views["factors"][m.factor_offset:m.factor_offset + 2 * m.rows
                                               + 3 * m.cols]
            views = self._fp32_views["factors", i] = tuple(
                flat.split([m.rows, m.cols, m.cols, m.rows, m.cols]))
        return views

    def square_sum(self, sum_slot: int, i: int) -> torch.Tensor:
        """Where the squares of device-summed matrix i's window go when its sum goes to slot
        `sum_slot`: the other slot, which the window did not fill for this matrix."""
        return self.fp32(f"grad_sum{1 - sum_slot}", i)

    def span(self, buffer: str, matrices: list[int]) -> list[torch.Tensor]:
        """Flat views of `buffer` (an fp32 buffer such as "grad_sum0", or a typed one's prefix
        such as "staging0") from the first of `matrices` to the end of the last, one per dtype
        for a typed buffer: the bytes that copies of those matrices touch, each view one
        page-lock registration; of a run of HostLayout.back_to_back (its first and last will
        do), the one view its copy at once reads or writes."""
        fp32 = buffer in self.arena.views
        by_view: dict[str, list[tuple[int, int]]] = {}
        for i in matrices:
            m = self.layout.matrices[i]
            name = buffer if fp32 else f"{buffer}_{dtype_name(m.dtype)}"
            start = m.offset if fp32 else m.typed_offset
            by_view.setdefault(name, []).append((start, start + m.numel))
        return [self.arena.views[name][min(a for a, _ in runs):max(b for _, b in runs)]
                for name, runs in by_view.items()]

    def _typed(self, buffer: str, i: int) -> torch.Tensor:
        views = self._typed_views.get(buffer)
        if views is None:
            views = self._typed_views[buffer] = [None] * len(self.layout.matrices)
        view = views[i]
        if view is None:
            m = self.layout.matrices[i]
            flat = self.arena.views[f"{buffer}_{dtype_name(m.dtype)}"]
            view = views[i] = flat[m.typed_offset:m.typed_offset + m.numel].view(m.rows, m.cols)
        return view

    def _typed_run(self, buffer: str, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        start = next(g[1] for g in self.layout.groups if g[0] == dtype)
        flat = self.arena.views[f"{buffer}_{dtype_name(dtype)}"]
        return flat[offset - start:offset - start + numel]

    # -- the arithmetic -----------------------------------------------------------------------
    def accumulate(self, staging_slot: int, sum_slot: int, added: list[int],
                   fresh: list[int]) -> None:
        """grad_sum[sum_slot] += coef * staging[staging_slot] in fp32 for the `added` matrices
        (= for the `fresh` ones: the window's first gradient: their sums hold stale bytes), where
        coef is the slot's step_coef, copied with the gradients (0: a skipped step adds
        nothing)."""
        sums = self.arena.views[f"grad_sum{sum_slot}"]
        coef = self.step_coef(staging_slot)
        skipped = float(coef.numpy()) == 0.0   # host memory, landed before this runs
        for matrices, add in ((added, True), (fresh, False)):
            for offset, numel, dtype in self.layout.fp32_runs(matrices):
                total = sums[offset:offset + numel]
                grad = self._typed_run(f"staging{staging_slot}", offset, numel, dtype)
                for start in range(0, numel, _CHUNK):   # a dtype's fp32 temporary stays in cache
                    part, g = total[start:start + _CHUNK], grad[start:start + _CHUNK]
                    if skipped:
                        if not add:
                            part.zero_()
                    elif add:
                        add_scaled_([part], [g], coef)
                    else:   # = add_scaled_ into zeros, in one pass instead of two
                        torch.mul(g.float(), coef, out=part)

    def update(self, jobs: list[HostJob], sum_slot: int) -> None:
        """AdamW on each job's matrix with the mean of its gradient sum, then the new values (with
        a lookahead, the values that fraction of the next step further), in the parameters'
        dtype, into the install buffer, and for "moments" jobs their rates. The sums are consumed
        (left stale; a bf16 landing is read as it is, never widened in place).

        One pass over the state, chunk by chunk (see PIECE): each chunk's AdamW, rate and install
        value are done before the next chunk, so every byte comes from memory once. Jobs sharing
        hyperparameters, step and window length are updated together, as flat runs where their
        matrices are adjacent (usually: one run per dtype); chunks end where the fused kernel's
        vectors would over the whole run, so the results are those of one kernel call per run.
        """
        self._pass(jobs, sum_slot)

    def publish(self, jobs: list[HostJob]) -> None:
        """The install buffer := what `jobs` install: each matrix's host values, or with a
        lookahead those values that fraction of the next step further (from the moments the
        update left), and for "moments" jobs their rates. Also rebuilds an in-flight update's
        install buffer after a load."""
        self._pass(jobs, None)

    def _pass(self, jobs: list[HostJob], sum_slot: int | None) -> None:
        """update() (sum_slot given) or publish() (None): the chunks of every job, run in this
        thread or, where the worker has set `teams`, each NUMA node's share on its own cores.
        "factored" jobs go matrix by matrix, in blocks of rows (zenflow/host/factored.py)."""
        if any(job.update.factored for job in jobs):
            factored_pass(self, [job for job in jobs if job.update.factored], sum_slot)
            jobs = [job for job in jobs if not job.update.factored]
            if not jobs:
                return
        groups: dict[tuple, list[int]] = {}
        for job in jobs:
            groups.setdefault((job.step, job.num_grads, job.update), []).append(job.matrix)
        narrow = {job.matrix for job in jobs if job.widen and sum_slot is not None}
        nodes = len(self.arena.nodes) if self.teams is not None else 1
        bounds = share_bounds(self.layout.numel, nodes)
        threads = self.teams.threads if self.teams is not None else [torch.get_num_threads()]
        shares: list[list] = [[] for _ in range(nodes)]
        for key, matrices in groups.items():
            for offset, numel, dtype in self.layout.fp32_runs(matrices):
                run = self._run(key, offset, numel, dtype, sum_slot,
                                [i for i in matrices if i in narrow])
                for node, start, end in chunks(offset, numel, bounds, threads):
                    shares[node].append(partial(_chunk, run, start - offset, end - offset))
        if self.teams is not None:
            self.teams.run(shares)
        else:
            for task in shares[0]:
                task()

    def _run(self, key: tuple, offset: int, numel: int, dtype: torch.dtype,
             sum_slot: int | None, narrow: list[int]) -> _Run:
        step, num_grads, u = key
        lookahead, moments = u.lookahead, u.moments
        v, part = self.arena.views, slice(offset, offset + numel)
        landings = []
        for i in narrow:   # bf16 sums landed in the first half of their fp32 slot (landing_of)
            m = self.layout.matrices[i]
            if offset <= m.offset < offset + numel:
                values = self.fp32(f"grad_sum{sum_slot}", i).view(-1).view(torch.bfloat16)
                landings.append((m.offset - offset, m.offset - offset + m.numel,
                                 values[:m.numel]))
        return _Run(
            lookahead, moments, step, num_grads,
            dict(lr=u.lr, beta1=u.beta1, beta2=u.beta2, eps=u.eps, weight_decay=u.weight_decay),
            (torch.full((), float(step)), torch.full((), float(num_grads))),
            v["master"][part], v["exp_avg"][part], v["exp_avg_sq"][part],
            self._typed_run("install", offset, numel, dtype),
            self._typed_run("rate", offset, numel, dtype) if moments else None,
            None if sum_slot is None else v[f"grad_sum{sum_slot}"][part],
            v[f"grad_sum{1 - sum_slot}"][part] if moments and sum_slot is not None else None,
            sorted(landings, key=_first))

    def copy_masters(self, matrices: list[int]) -> None:
        """The install buffer := the master values of `matrices`, in the parameters' dtype."""
        for offset, numel, dtype in self.layout.fp32_runs(matrices):
            self._typed_run("install", offset, numel, dtype).copy_(
                self.arena.views["master"][offset:offset + numel])
