"""What a training script calls on ZenFlowAdamW between its steps: the mixin `BetweenSteps`
(zenflow/optim/optimizer.py holds the constructor and step() itself).

    synchronize, wait_for_install   the host's update installed now, or the copies in flight
                                    made readable
    attach                          an attached model's blocks wait for their own installs
    close, with                     the worker stopped, its memory released
    stats, timeline                 telemetry
    state_dict, load_state_dict     the state, checked and composed by zenflow/optim/state.py
    repr, the knobs and the counters as attributes, no deep copy, no param group added once
    built

They read the parts that ZenFlowAdamW's constructor builds (`_installs`, `_pipeline`,
`_selector`, `_outside_writes`, `counters`, ...). The ones that change the optimizer's state run
under its lock (`serialized`), as step() does.
"""
from __future__ import annotations

import functools
import logging

import torch

from zenflow.config.settings import AdamWHyperparameters, ZenFlowSettings
from zenflow.optim import state as state_format
from zenflow.optim.model_hooks import ModelHooks, install_units
from zenflow.optim.stats import optimizer_stats

log = logging.getLogger("zenflow")


def serialized(method):
    """Run `method` under the optimizer's lock: step(), state_dict(), load_state_dict(),
    synchronize() and close() from different threads (asynchronous checkpointing beside
    training) take turns instead of tearing the host pipeline's bookkeeping."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.__dict__["_lock"]:
            return method(self, *args, **kwargs)
    return locked


class BetweenSteps:
    """ZenFlowAdamW's methods outside step() (module doc); a mixin ahead of
    torch.optim.Optimizer, whose repr, state_dict and load_state_dict it replaces."""

    def __getattr__(self, name: str):
        """The knobs read as attributes too: `opt.topk_ratio` is `opt.settings.topk_ratio`."""
        settings = self.__dict__.get("settings")
        if settings is not None and name in ZenFlowSettings.model_fields:
            return getattr(settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        """torch's listing of the param groups, with ZenFlow's settings first."""
        groups = super().__repr__()          # "ZenFlowAdamW (\nParameter Group 0\n ..."
        header, _, rest = groups.partition("\n")
        settings = "".join(f"    {name}: {value!r}\n"
                           for name, value in self.settings.model_dump().items())
        return f"{header}\nZenFlow settings\n{settings}{rest}"

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "_pipeline"):
            raise NotImplementedError(f"{self._NAME}: add_param_group after construction is not "
                                      "supported; pass every group to the constructor")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        AdamWHyperparameters.from_arguments(self._NAME, **{k: group[k] for k in
                                                          AdamWHyperparameters.model_fields})

    @property
    def skipped_steps(self) -> int:
        with self._lock:
            self._settle_skips()
        return self.counters.skipped_steps

    @property
    def num_windows(self) -> int:
        return self.counters.num_windows

    @property
    def num_reselections(self) -> int:
        return self._selector.num_reselections

    def __deepcopy__(self, memo):
        raise TypeError(f"{self._NAME} cannot be deep-copied: it owns a host worker process and "
                        "shared host memory. Build a new optimizer over the copied model's "
                        "parameters and load_state_dict(this.state_dict()) into it")

    @property
    def _runner(self):
        """What runs the host's work: the worker process's link, or the in-process runner."""
        return self._pipeline.runner

    @property
    def closed(self) -> bool:
        return getattr(self, "_closed", True)

    @serialized
    def synchronize(self) -> None:
        """Wait for the in-flight host update and install it now (before evaluation or saving
        the final model). Training continues correctly afterwards; the update is just visible
        earlier than the overlap schedule would make it. After close() there is no host left
        to wait for, and the weights stay as they are."""
        if self.closed:
            return
        self._installs.finish()
        self._outside_writes.adopt()
        self._outside_writes.adopt_data_writes()
        self._installs.queue_update()
        if ((self.settings.install_lookahead and self.settings.overlap_step
             and self.counters.num_windows) or self._pipeline.credit.interim_taken):
            # The installed weights lead the host's values by the lookahead, or the device has
            # stepped them since (a credit rule's interim steps): show the values.
            chosen = self._selector.has_chosen
            self._installs.queue_masters(
                [m.host_index for m in self._host_params if m.host_owns_columns(chosen)])
        self._installs.finish()
        self._outside_writes.fingerprint()

    # ------------------------------------------------------------------ installs and the model
    def attach(self, model: torch.nn.Module) -> ModelHooks:
        """Let `model`'s forward wait for installs block by block (opt-in; once per model).

        Without it, the device waits at the end of the step() that ends a window for the whole
        copy of the host's update into the parameters before the next forward can start (on one
        H100 with Llama-2-7B, 12.5 GB over PCIe: about 0.25 s a window), and every read of a
        weight after step() sees the installed values. With it, each block of the model's
        repeated layers (and each of its other children) waits, in a forward pre-hook, only for
        the copies of the weights inside it, so the copies of later blocks overlap the forward of
        earlier ones (zenflow/optim/model_hooks.py says what a unit is). The contract: between a
        step() and the next forward, code that reads or writes the weights outside the model's
        forward (an EMA of the weights, copy.deepcopy(model), parameters_to_vector, a
        `.data` clamp) calls `wait_for_install()` first. step(), synchronize(), state_dict(),
        load_state_dict(), close() and the model's state_dict() and load_state_dict() finish
        every install by themselves. A forward that read a weight whose install its hooks did
        not finish (the model compiled after attach, a weight one unit holds and another reads)
        is found at the next step(): a warning says so, and that model's installs are finished in
        the step from then on. Returns a handle whose `remove()` takes the hooks off."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{self._NAME}.attach: model must be a torch.nn.Module (the model "
                            f"whose forward reads this optimizer's parameters), got "
                            f"{type(model).__name__}")
        matrices = {m.param: m.host_index for m in self._host_params}
        return self._installs.attach(
            model, install_units(model, matrices, self._partition.rows_are_local))

    def wait_for_install(self) -> None:
        """Make every installed value readable now (an attached model's forward waits for each
        layer's by itself): later device work waits for the copies in flight, and the Python
        thread only where the "device" is the CPU. Cheap when nothing is in flight."""
        self._installs.finish_for_forward(None)

    # ------------------------------------------------------------------ lifecycle
    @serialized
    def close(self) -> None:
        """Stop the host worker and release its memory. Idempotent.

        There is deliberately no __del__ here: frameworks wrap optimizers in objects that share
        this one's __dict__ (Lightning's LightningOptimizer does), and such a wrapper's
        collection must not stop the worker the real optimizer still uses. The runner stops
        its worker when the runner itself is collected, and at interpreter exit."""
        if not getattr(self, "_closed", True):
            self._install_last_update()
            self._installs.finish()   # the copies read host memory that close() releases
            self._installs.detach_all()
            self._closed = True
            self._pipeline.close()

    def _install_last_update(self) -> None:
        """What torch's optimizers leave after the last step(), trained weights: the update in
        flight and the host's values installed (synchronize()), so a script that ends training
        with close() or a `with` block saves the weights trained on every window. In one process
        only: under data parallel installing is collective, and a rank may close alone (the
        engine and the callbacks synchronize where every rank reads). A failure here (a dead
        worker) is said and does not keep the worker from stopping."""
        if self._partition.active or not self.counters.num_windows:
            return
        try:
            self.synchronize()
        except Exception as exc:   # close() must still release the worker and its memory
            log.warning("%s.close(): the last host update could not be installed (%s); the "
                        "weights lack it", self._NAME, exc)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @serialized
    def stats(self) -> dict:
        """Telemetry: counters, memory per parameter, per-step timings and bytes moved (the
        window's skips so far settled first: one read)."""
        self._settle_skips()
        return optimizer_stats(self)

    def timeline(self) -> dict:
        """Per-step records of the training process ({start, end, step_s, stall_s, offload_s,
        d2h_bytes, h2d_bytes, skipped}) and the (start, end) of each host update, in
        perf_counter() seconds, for plotting the two side by side."""
        return {"steps": list(self._timer.records), "host_updates": list(self._runner.updates)}

    # ------------------------------------------------------------------ checkpoints
    @serialized
    def state_dict(self) -> dict:
        """Everything needed to continue exactly (the format: zenflow/optim/state.py): host and device
        state, selection, counters and the partial window. Waits for in-flight host work first
        (without installing it). The skips of the window so far are settled first (one read), so
        that its counts are exact."""
        self._installs.finish()
        self._settle_skips()
        return state_format.save(self, self._state_parts())

    def check_state_dict(self, state_dict: dict) -> None:
        """Raise ValueError if load_state_dict(state_dict) would fail; changes nothing."""
        state_format.check(self._state_parts(), state_dict)

    @serialized
    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state saved by state_dict() from an optimizer over the same parameters.
        Everything is checked before anything changes: a failed load leaves this optimizer as
        it was. Load the model's weights first, then this (as frameworks do): weights loaded
        afterwards count as changed outside the optimizer and become the master values."""
        self._installs.finish()
        state_format.load(self, self._state_parts(), state_dict)
        self._selector.tell_owned_columns()
        self._skips.forget()       # steps of the window the loaded state replaces
        self._agreement.forget()

    def _state_parts(self) -> state_format.StateParts:
        return state_format.StateParts(
            self._NAME, self.param_groups, self.counters, self._host_params, self._vector_params,
            self._pipeline, self._selector, self._window, self._outside_writes,
            self.settings.topk_ratio, self.settings.overlap_step, self._partition.world_size,
            self._partition.rank, sharded=self._partition.rows_are_local,
            replica_rows=self._partition.splits_rows)
