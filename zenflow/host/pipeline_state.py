"""The host pipeline's part of a saved state (zenflow/optim/state.py composes the whole): per
parameter its host values, moments, the filling window sum, a credit rule's own sums and rates,
the counts; and the update in flight, if any."""
from __future__ import annotations

import dataclasses
import math

import torch

from zenflow.adamw import FP32_STATE
from zenflow.host.cores import lent_threads
from zenflow.host.layout import HostJob, HostJobs, HostUpdate
from zenflow.saved_state import check_count, check_saved_tensors


def save(pipe) -> dict:
    """Host values, moments and the filling sums, per parameter; counters; the in-flight set.
    Drains first, so the snapshot is consistent (the in-flight update is done, not installed).
    The credit rule's sums of squares and device rates ride along (zeros where it keeps none)."""
    pipe.drain()
    with lent_threads(pipe.worker_cores):   # the drained worker's cores copy too
        per_param = [_saved_param(pipe, i) for i in range(len(pipe.params))]
    in_flight = jobs = None
    if pipe.in_flight is not None:
        in_flight = pipe.in_flight.matrices
        jobs = [job.saved() for job in pipe.in_flight.jobs]   # done: nothing to widen
    return {"params": per_param, "in_flight": in_flight, "in_flight_jobs": jobs}


def _saved_param(pipe, i: int) -> dict:
    """save()'s copy of parameter i's host state."""
    grad_sum = (pipe.device_sums.sums[i].to("cpu", torch.float32, copy=True)
                if i in pipe.device_sums
                else pipe.host.fp32(f"grad_sum{pipe._sum_slot}", i))
    squares, rate = pipe.credit.saved(i, grad_sum)
    return {
        **pipe.credit.saved_factors(i, pipe.host, pipe.num_grads[i]),
        # fp32 whatever host_moments_dtype (a bf16 moment widens exactly)
        **{kind: pipe.host.state(kind, i).to(torch.float32, copy=True)
           for kind in FP32_STATE},
        # A sum no gradient reached yet holds stale bytes (the next one overwrites them).
        "grad_sum": grad_sum.clone() if pipe.num_grads[i] else torch.zeros_like(grad_sum),
        "grad_sq_sum": squares if pipe.num_grads[i] else torch.zeros_like(grad_sum),
        "rate": rate,
        "host_step": pipe.host_step[i], "num_grads": pipe.num_grads[i]}


def check(pipe, state: dict, window_steps: int | None = None) -> None:
    """Raise ValueError unless `state`, as save() returns it, fits these parameters: finite fp32
    state of each one's shape (a non-negative exp_avg_sq), a gradient sum, integer counts, no
    more gradients summed than the window has steps (`window_steps`), and an in-flight update
    naming distinct parameters with well-formed jobs."""
    saved_params = state.get("params")
    if not isinstance(saved_params, list) or len(saved_params) != len(pipe.params):
        raise ValueError(f"saved host state covers {_length(saved_params)} parameter(s), "
                         f"this optimizer has {len(pipe.params)}")
    for i, (saved, param) in enumerate(zip(saved_params, pipe.params)):
        what = f"host state of the parameter of shape {tuple(param.shape)}"
        buffers = {kind: pipe.host.state(kind, i) for kind in FP32_STATE}
        check_saved_tensors(saved, {**buffers, "grad_sum": buffers["master"],
                                    "grad_sq_sum": buffers["master"],
                                    "rate": buffers["master"]}, what)
        rows, cols = buffers["master"].shape
        # "factored" state (absent where the matrix took another rule): [3, rows] and [3, cols]
        check_saved_tensors(saved, {key: torch.zeros(3, n) for key, n in
                                    (("row_factors", rows), ("col_factors", cols))
                                    if key in saved}, what)
        check_count(saved.get("host_step"), "host_step", what)
        check_count(saved.get("num_grads"), "num_grads", what)
        if window_steps is not None and saved["num_grads"] > window_steps:
            raise ValueError(f"{what}: saved num_grads {saved['num_grads']} exceeds the "
                             f"saved window_steps {window_steps}")
    in_flight = state.get("in_flight")
    if in_flight is not None and not (
            isinstance(in_flight, list)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in in_flight)
            and in_flight == sorted(set(in_flight))
            and all(0 <= i < len(pipe.params) for i in in_flight)):
        raise ValueError(f"saved in_flight must be None or distinct ascending parameter "
                         f"numbers in 0..{len(pipe.params) - 1}, got {in_flight!r}")
    check_in_flight_jobs(state.get("in_flight_jobs"), in_flight or [])


def load(pipe, state: dict) -> HostJobs | None:
    """Restore what save() returned (check() it first), but the update in flight: its jobs are
    returned (None: none), done, their values published in the install buffer. After a worker
    died mid-work this is the roll-back: every host buffer is overwritten and a new worker
    starts."""
    if pipe.link.torn:
        pipe.link.restart()
    pipe.drain()
    # No copy may still read the buffers rewritten below: the last install (the install buffer)
    # and the last copy of the device sums.
    pipe.timer.stall(pipe._install_reader.wait() + pipe.device_sums.wait_copied())
    pipe._start_over()
    with lent_threads(pipe.worker_cores):   # the drained worker's cores copy too
        return _loaded(pipe, state)


def _loaded(pipe, state: dict) -> HostJobs | None:
    """load()'s copies into the host buffers, and the update in flight's jobs (published)."""
    for i, s in enumerate(state["params"]):
        for kind in FP32_STATE:   # (into bf16 moments: rounded to nearest)
            pipe.host.state(kind, i).copy_(s[kind])
        if i in pipe.device_sums:
            pipe.device_sums.sums[i].copy_(s["grad_sum"])
        else:
            pipe.host.fp32("grad_sum0", i).copy_(s["grad_sum"])
        pipe.credit.load(i, s["grad_sq_sum"], s["rate"], s["grad_sum"], s["num_grads"])
        pipe.credit.load_factors(i, s, pipe.host)
        pipe.host_step[i], pipe.num_grads[i] = s["host_step"], s["num_grads"]
    if state["in_flight"] is None:
        return None
    # The update is done; its install buffer is rebuilt from the values it produced. A "moments"
    # job's rates go to the device only where this optimizer's rule keeps rates, a "factored"
    # one's only where it keeps factors (a state saved under other settings installs the values
    # alone; a "factored" job under "moments" its rates from the moments).
    jobs = [_job(saved, pipe.credit)
            for saved in state.get("in_flight_jobs") or []] or [
        HostJob(i, 0, 0, HostUpdate(0.0, 0.0, 0.0, 0.0, 0.0)) for i in state["in_flight"]]
    pipe.host.publish(jobs)
    return HostJobs.of(jobs)


def _job(saved: list, credit) -> HostJob:
    job = HostJob.from_saved(saved)
    if credit.host_factors:
        moments = factored = job.update.factored
    else:
        moments, factored = job.update.moments and credit.host_rates, False
    return job._replace(update=dataclasses.replace(job.update, moments=moments,
                                                   factored=factored))


def _length(value) -> str:
    return str(len(value)) if isinstance(value, list) else type(value).__name__


def check_in_flight_jobs(jobs, matrices: list[int]) -> None:
    """A saved in-flight update's jobs (None for states saved without them) fit its matrices:
    one [matrix, step, num_grads, lr, beta1, beta2, eps, weight_decay, lookahead, moments,
    factored] each (states of format 3 and older: without moments; 5 and older: without
    factored), with counts that are positive integers and
    hyperparameters that AdamW accepts."""
    if jobs is None:
        return
    shape = ("'in_flight_jobs' must hold one [matrix, step, num_grads, lr, beta1, beta2, eps, "
             "weight_decay, lookahead, moments, factored] per in-flight matrix")
    if not (isinstance(jobs, list) and all(isinstance(j, (list, tuple)) and len(j) in (9, 10, 11)
                                           for j in jobs)
            and [j[0] for j in jobs] == list(matrices)):
        raise ValueError(shape)
    for job in jobs:
        matrix, step, num_grads, lr, beta1, beta2, eps, weight_decay, lookahead = job[:9]
        for position, flag in ((9, "moments"), (10, "factored")):
            if len(job) > position and not isinstance(job[position], bool):
                raise ValueError(f"{shape}; the job of matrix {matrix} has {flag} "
                                 f"{job[position]!r}, expected a bool")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1
                   for x in (step, num_grads)):
            raise ValueError(f"{shape}; the job of matrix {matrix} has step {step!r} and "
                             f"num_grads {num_grads!r}, expected positive integers")
        numbers = (lr, beta1, beta2, eps, weight_decay, lookahead)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                   for x in numbers) or not (
                lr >= 0 and 0 <= beta1 < 1 and 0 <= beta2 < 1 and eps > 0 and weight_decay >= 0
                and lookahead >= 0):
            raise ValueError(f"{shape}; the job of matrix {matrix} has (lr, beta1, beta2, eps, "
                             f"weight_decay, lookahead) = {numbers}, expected finite lr >= 0, "
                             "betas in [0, 1), eps > 0, weight_decay >= 0, lookahead >= 0")
