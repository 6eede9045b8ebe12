"""An install: a window's new host values, from the install buffer into the parameters.

    queue     once the host's update is done (or, for synchronize(), the host values
              themselves), copy each matrix's rows into its parameter: on CUDA on a side stream,
              on a CPU on the copy thread (zenflow/host/transfers.py); nothing waits yet
    finish    before anything reads a matrix: the device ordered after its copy, then what
              needs the copied values: the deferred-credit rule's correction
              (zenflow/host/credit.py), the device's own newer columns written back over them
              (and the rule told so), the matrix's fingerprint (zenflow/optim/outside_writes.py)
    wait      wait_for_install(): finish everything now

Without `ZenFlowAdamW.attach(model)` every install is finished in the step() that queued it, so
the device waits for the whole copy before the next forward. With it, a matrix a layer of the
model owns is finished in that layer's forward pre-hook (zenflow/optim/model_hooks.py), as late
as possible. Everything still pending is finished at the next point that must see every weight:
the next step(), synchronize(), the optimizer's state_dict(), load_state_dict() and close(), the
attached model's state_dict() and load_state_dict(), and `wait_for_install()`, which code that
reads or writes the weights outside the model's forward calls first (an EMA of the weights, an
evaluation that reads `layer.weight` without calling the layer).

FSDP2-sharded parameters are read by FSDP's own all-gather before their modules' forward: their
installs are finished in the step that queues them, as without attach. DDP's replicas install
per layer too: each matrix's copy of this rank's rows is followed, in its ticket, by their
correction and the all-gather of every rank's (copy_rows_to_params).
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from functools import partial

import torch

from zenflow.host.pipeline import HostPipeline
from zenflow.host.transfers import Ticket, all_of
from zenflow.optim.model_hooks import ModelHooks
from zenflow.optim.params import HostParam, params_from_selected

log = logging.getLogger("zenflow")

# Installs are queued in batches of consecutive matrices of at least this many bytes: a large
# matrix is its own batch (its layer waits for it alone), while thousands of small ones (MoE
# experts) do not cost a queued copy and an event each.
INSTALL_BATCH_BYTES = 8 << 20
# What DDP's gather of every rank's installed rows is counted as (Partition.bytes_sent).
GATHERING = "installing host-updated rows"


# What finishing an install of a matrix corrects it by, where its credit rule moves it: its
# (learning rate, AdamW's step bound) at the window end, and the gradients summed since the
# update was handed off.
Correction = tuple[tuple[float, float], int]


class Installs:
    """The queued installs not finished yet, one per matrix (host index): its copy's Ticket (a
    batch's, shared) and any Correction, in plain dicts, since thousands of objects a window
    (an MoE's matrices) outlive the step and make Python's collector scan the whole process; and
    the models whose forward finishes them. `lock` is the optimizer's: finishing from a forward
    takes it."""

    def __init__(self, pipeline: HostPipeline, host_params: list, outside_writes, selector,
                 lock: threading.RLock):
        self._pipeline, self._credit = pipeline, pipeline.credit
        self._host_params, self._outside_writes = host_params, outside_writes
        self._selector, self._lock = selector, lock
        self._pending: dict[int, Ticket] = {}   # in the order queued
        self._corrections: dict[int, Correction] = {}
        self._attached: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> hooks
        self._stepped: dict[int, HostParam] = {}   # by host index: see columns_stepped
        self._stepped_plan = None   # or all the columns a step's plan stepped, none written yet

    # -- the device's columns -------------------------------------------------------------------
    def columns_stepped(self, plan) -> None:
        """The device's step just updated the selected columns of `plan.stepped` (a
        zenflow.optim.step_plan.StepPlan) and did not write them into the parameters: a window
        end that installs a matrix in this step writes its columns after the copy (finish), so
        writing them before as well would be a pass (and on a GPU launches per matrix) for
        nothing. The others are written before any install's copy is queued (the copy must not
        race the write) and at the step's end (write_stepped_columns)."""
        self._stepped_plan = plan if plan.matrix_steps is not None else None
        self._stepped = {}

    def _stepped_by_index(self) -> dict[int, HostParam]:
        """The stepped matrices not written yet, by host index (a window end's installs take
        some: Python per matrix, once a window)."""
        if self._stepped_plan is not None:
            self._stepped = {m.host_index: m for m in self._stepped_plan.stepped}
            self._stepped_plan = None
        return self._stepped

    def write_stepped_columns(self, but: set[int] = frozenset()) -> None:
        """Write the stepped columns not written yet, except those of matrices `but` (an install
        about to be finished in this step writes them)."""
        plan = self._stepped_plan
        if plan is not None and not but:   # all of them, as planned: no Python per matrix
            plan.matrix_steps.write(plan.pick_stepped(self._pipeline.weight_views.all()))
            self._stepped_plan = None
            return
        stepped = self._stepped_by_index()
        todo = [m for i, m in stepped.items() if i not in but]
        if todo:
            params_from_selected(todo, self._pipeline.weight_views)
            self._stepped = {i: m for i, m in stepped.items() if i in but}

    # -- queue ----------------------------------------------------------------------------------
    def queue_update(self, sizes: dict[int, tuple[float, float]] | None = None) -> list[int]:
        """Wait for the host's update in flight (if any) and queue its install; with `sizes` (a
        window end: index -> (learning rate, step bound)), finishing corrects the values of the
        matrices the credit rule moves for the gradients summed since the update's hand-off.
        Returns the matrices queued."""
        self.finish()   # one install of a matrix at a time
        flight = self._pipeline.take_update()
        if flight is None:
            return []
        waited = self._waited()
        self.write_stepped_columns(but={i for i in flight.matrices if i not in waited})
        moving = {i for i, u in zip(flight.jobs.matrices, flight.jobs.updates)
                  if u.moments and self._credit.moves(i)}
        num_grads = self._pipeline.num_grads
        corrections = {} if sizes is None else {
            i: (sizes[i], num_grads[i]) for i in flight.matrices if i in moving and num_grads[i]}
        return self._add(self._queue(flight.matrices, moving, corrections))

    def queue_masters(self, indices: list[int]) -> None:
        """Queue the install of the host values of `indices` themselves (an update installed with
        a lookahead leads them, and a credit rule's interim steps moved them since)."""
        self.finish()
        self.write_stepped_columns()
        self._pipeline.take_masters(indices)
        self._add(self._queue(indices, set()))

    def _queue(self, indices: list[int], with_rates: set[int],
               corrections: dict[int, Correction] | None = None
               ) -> tuple[dict[int, Ticket], dict[int, Correction]]:
        """Queue the copies; `corrections`: the matrices the credit rule corrects. Under DDP each
        rank corrects its own rows before the ranks gather them (no other rank has their window
        sums), at the copy; elsewhere finishing corrects the installed values. Returns each
        matrix's ticket, and what finishing corrects by."""
        corrections = corrections or {}
        replicas = self._pipeline.partition.splits_rows
        self._pipeline.transfers.new_install()
        tickets = copy_rows_to_params(self._pipeline, indices, with_rates,
                                      corrections if replicas else {})
        later = {} if replicas else corrections
        self._pipeline.read_by(all_of(*{id(t): t for t in tickets.values()}.values()))
        return tickets, later

    def _add(self, queued: tuple[dict[int, Ticket], dict[int, Correction]]) -> list[int]:
        """Installs just queued (_queue's answer). Those no attached forward waits for are
        finished now (a compiled model's forward does not wait: zenflow/optim/model_hooks.py).
        Returns the matrices queued."""
        tickets, corrections = queued
        assert not any(i in self._pending for i in tickets), "finish() the last first"
        self._pending.update(tickets)
        self._corrections.update((i, c) for i, c in corrections.items() if i in tickets)
        waited = self._waited()
        self.finish([i for i in tickets if i not in waited])
        return list(tickets)

    def _waited(self) -> set[int]:
        """The matrices whose installs an attached model's forward finishes."""
        return set().union(*(h.matrices for h in self._attached.values()
                             if not h.finishes_in_step))

    # -- finish ---------------------------------------------------------------------------------
    def pending(self, matrices: list[int] | None = None) -> bool:
        """Whether any install of `matrices` (None: any at all) is pending. Takes no lock: one
        dict read per matrix, which the training thread's queueing and finishing never tear."""
        if matrices is None:
            return bool(self._pending)
        return any(i in self._pending for i in matrices)

    def finish(self, matrices: list[int] | None = None) -> None:
        """Finish the pending installs of `matrices` (default: all) in the order queued."""
        if not self._pending:
            return
        if matrices is None:
            due, self._pending = self._pending, {}
        else:
            due = {i: self._pending.pop(i) for i in matrices if i in self._pending}
        if due:
            self._finish(list(due), list({id(t): t for t in due.values()}.values()),
                         {i: c for i in due if (c := self._corrections.pop(i, None)) is not None})

    def _finish(self, matrices: list[int], tickets: list[Ticket],
                corrections: dict[int, Correction]) -> None:
        pipeline = self._pipeline
        pipeline.transfers.order_after(tickets)
        printed = None   # the corrections' own fingerprints, taken in their kernels
        if corrections:
            self._credit.correct({i: pipeline.weights(i) for i in corrections},
                                 pipeline.device_sums.sums,
                                 {i: sizes for i, (sizes, _) in corrections.items()},
                                 {i: count for i, (_, count) in corrections.items()})
            printed = self._credit.take_correct_prints()
        if self._selector.has_chosen:   # the device's own columns are newer than the host's
            owning = [m for i in matrices if (m := self._host_params[i]).k > 0]
            params_from_selected(owning, pipeline.weight_views)
            if self._stepped or self._stepped_plan is not None:
                stepped = self._stepped_by_index()
                for m in owning:
                    stepped.pop(m.host_index, None)
            for m in owning:
                self._credit.device_owns(m.host_index, m.selected.column_indices)
        self._outside_writes.fingerprint(matrices, printed)

    def check_forward_reads(self, read: list[int]) -> None:
        """At step(), before finishing what is still pending: a pending install of a matrix the
        forward read (`read`: the matrices with a gradient now) was read unfinished, since no
        hook finished it (the model compiled after attach(), a weight one unit holds and another
        reads). Say so, once per model, and finish that model's installs in the step from now
        on."""
        missed = {i for i in read if i in self._pending}
        for hooks in list(self._attached.values()):
            if hooks.matrices & missed and not hooks.finishes_in_step:
                hooks.missed_reads = True
                log.warning("%d weight(s) of an attached model were read by its forward before "
                            "their install was finished (its hooks did not run for them: the "
                            "model compiled after attach(), or a weight one block holds and "
                            "another reads); that forward read the previous window's values. "
                            "Its installs are finished in step() from now on.",
                            len(hooks.matrices & missed))

    def finish_for_forward(self, matrices: list[int] | None) -> None:
        """finish(), from a forward pre-hook (or the model's state_dict hooks): it may run on
        autograd's device thread (a forward recomputed in backward), so with nothing of
        `matrices` pending it returns at once, taking no lock."""
        if self.pending(matrices):
            with self._lock, torch.no_grad():
                self.finish(matrices)

    # -- models ---------------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module, owned: dict[torch.nn.Module, list[int]]) -> ModelHooks:
        """Register `model`'s hooks (once per model): each module of `owned` finishes its
        matrices before its forward."""
        hooks = self._attached.get(model)
        if hooks is None:
            hooks = ModelHooks(model, owned, self.finish_for_forward, self._detached)
            self._attached[model] = hooks
        return hooks

    def _detached(self, model: torch.nn.Module) -> None:
        self._attached.pop(model, None)

    def detach_all(self) -> None:
        """Take every attached model's hooks off (the optimizer closes: a model trained again,
        under a new optimizer, must not carry this one's hooks)."""
        for hooks in list(self._attached.values()):
            hooks.remove()


def copy_rows_to_params(pipe: HostPipeline, indices: list[int],
                        with_rates: set[int] = frozenset(),
                        corrections: dict[int, Correction] | None = None
                        ) -> dict[int, Ticket]:
    """Queue the install buffer's values of `indices` into their parameters, every rank's rows
    (FSDP2: this rank's shard, which is all it holds), in the order given (the model's, as a
    forward reads them), with the credit rule's rates for the matrices `with_rates`; returns
    each one's Ticket (its batch's). Under DDP the rule's rates are gathered from every rank
    first (one collective on the current stream); then each matrix's rows are copied,
    corrected by `corrections` (index -> ((lr, bound), count)) and all-gathered from every
    rank on the copy stream, in its ticket (Installs._queue), so that with the model attached a
    layer's forward waits only for its own matrices' copy and gather."""
    start = time.perf_counter()
    host, partition, transfers = pipe.host, pipe.partition, pipe.transfers
    corrections = corrections or {}
    tickets, nbytes = {}, 0
    batch, batch_pairs, batch_bytes = [], [], 0
    if partition.splits_rows:
        pipe.credit.gather_rates([i for i in indices if i in with_rates], host)

    def queue_batch() -> None:
        nonlocal batch, batch_pairs, batch_bytes, nbytes
        ticket = transfers.to_device(batch_pairs)
        tickets.update((j, ticket) for j in batch)
        nbytes += batch_bytes
        batch, batch_pairs, batch_bytes = [], [], 0
    # alike small matrices back to back (an MoE's experts): one copy for all, in the order given
    runs = [[i] for i in indices] if partition.splits_rows else [
        part for run in pipe.layout.back_to_back(indices)
        for part in ([run] if with_rates.isdisjoint(run) else [[i] for i in run])]
    for run in runs:
        if len(run) > 1:
            values = host.span("install", [run[0], run[-1]])[0]
            batch.extend(run)
            batch_pairs.append(([pipe.weights(i) for i in run], values))
            batch_bytes += values.nbytes
            if batch_bytes >= INSTALL_BATCH_BYTES:
                queue_batch()
            continue
        i = run[0]
        param = pipe.weights(i)
        values = host.install(i)
        if partition.splits_rows and gathers_on_device(partition, param.device):
            # NCCL (or gloo on a CPU): this rank's rows to the device, where every rank gathers
            # them, after the copy on its stream: the ticket covers the gather, so a layer's
            # forward waits for its own matrices (attached) while later copies and gathers
            # run beside it. It also says when the install buffer may be overwritten.
            own = partition.own_rows_buffer(param.shape[0], param)
            tickets[i] = transfers.to_device([(own[: values.shape[0]], values)], then=partial(
                _gather_own_rows, pipe, i, param, own, values.shape[0], corrections.get(i)))
            nbytes += values.numel() * values.element_size()
            continue
        if partition.splits_rows:  # gloo with a GPU: every rank's rows, gathered in host memory
            if i in corrections:   # on the device, where the sums are, and back
                own = values.to(pipe.device, copy=True)
                _correct_own_rows(pipe, i, own, corrections[i])
                values = own.to(partition.device)
            values = partition.gather_rows(values, param.shape[0], GATHERING)
        pairs = [(param, values)]
        if i in with_rates:
            pairs += pipe.credit.install_pairs(i, host)
        batch.append(i)
        batch_pairs += pairs
        batch_bytes += sum(dst.numel() * dst.element_size() for dst, _ in pairs)
        if batch_bytes >= INSTALL_BATCH_BYTES:
            queue_batch()
    if batch:
        queue_batch()
    pipe.timer.moved(h2d=nbytes)
    pipe.timer.offload(time.perf_counter() - start)
    return tickets


def gathers_on_device(partition, device: torch.device) -> bool:
    """Whether DDP's installs gather every rank's rows on the parameters' `device`, after each
    copy on its stream: NCCL, and gloo on a CPU (which so runs the GPU's path); gloo with a GPU
    gathers them in host memory instead, before the copy."""
    return partition.on_device or partition.device == device


def _gather_own_rows(pipe: HostPipeline, i: int, param: torch.Tensor, own: torch.Tensor,
                     rows: int, correction: Correction | None) -> None:
    """DDP, after this rank's rows of matrix i have been copied into `own` (its padded rows
    buffer, `rows` of them real): correct them (every rank corrects its own, from its window
    sums), then gather every rank's into `param`."""
    if correction is not None:
        _correct_own_rows(pipe, i, own[:rows], correction)
    pipe.partition.gather_rows_into(param, own, GATHERING)


def _correct_own_rows(pipe: HostPipeline, i: int, own: torch.Tensor,
                      correction: Correction) -> None:
    """The credit rule's install correction of this rank's rows `own` of matrix i (DDP), from
    its own window sum, for `correction` = ((lr, bound), gradients summed since the hand-off)."""
    sizes, count = correction
    pipe.credit.correct({i: own}, pipe.device_sums.sums, {i: sizes}, {i: count})
