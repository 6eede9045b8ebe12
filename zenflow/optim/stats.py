"""ZenFlowAdamW.stats(): counters, memory per parameter, per-step timings and bytes moved."""
from __future__ import annotations

from zenflow.optim.params import device_state_bytes


def optimizer_stats(opt) -> dict:
    """What ZenFlowAdamW.stats() returns, from its parts (`opt`: a ZenFlowAdamW)."""
    host_numel = sum(m.param.numel() for m in opt._host_params)
    numel = host_numel + sum(v.param.numel() for v in opt._vector_params)
    dev = device_state_bytes(opt._host_params, opt._vector_params)
    return {
        "steps": opt.counters.step,
        "skipped_steps": opt.counters.skipped_steps,
        "windows": opt.counters.num_windows,
        "reselections": opt._selector.num_reselections,
        # the training thread's seconds in them (the device waits: columns move with their state)
        "reselect_s_total": opt._selector.reselect_seconds,
        "last_reselect_s": opt._selector.last_reselect_seconds,
        "update_interval": opt.settings.update_interval,
        "last_window_steps": opt._window.last_interval,
        "retained_importance": opt._selector.schedule.last_retained,
        "world_size": opt._partition.world_size,
        "collective_bytes_sent": dict(opt._partition.bytes_sent),
        "host_busy_s": opt._runner.busy_seconds,
        "worker": opt.settings.worker and bool(opt._host_params),
        "host_bytes": opt._pipeline.host.nbytes(),
        "host_bytes_per_param": opt._pipeline.host.nbytes() / max(1, host_numel),
        "pinned_bytes": opt._pipeline.pinned_bytes(),
        "device_sum_matrices": len(opt._pipeline.device_sums.sums),
        "host_sum_matrices": len(opt._host_params) - len(opt._pipeline.device_sums.sums),
        "device_sum_bytes": opt._pipeline.device_sums.nbytes() + opt._pipeline.credit.nbytes(),
        "moments_matrices": sum(map(opt._pipeline.credit.moves, range(len(opt._host_params)))),
        # matrix steps of the credit rule that one compiled kernel took (a GPU's "factored")
        "fused_steps": getattr(opt._pipeline.credit, "fused_steps", 0),
        # host-summed gradients whose copy started in backward / waited for step()
        "early_copies": opt._pipeline.early_copies.early,
        "late_copies": opt._pipeline.early_copies.late,
        # what the device waited for the last finished install (attach() hides most of it)
        "last_install_wait_s": opt._pipeline.transfers.last_install_wait_seconds,
        # ... and in the last window's own work at its start and end (fingerprints, queueing)
        "last_window_work_s": opt._pipeline.transfers.last_window_work_seconds,
        "device_state_bytes": dev,
        "device_state_bytes_per_param": dev / max(1, numel),
        **opt._timer.summary(),
    }

