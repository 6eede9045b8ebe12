"""State moves with its column: the handoff of columns between the device and the host.

When a column joins the device set, its fp32 master value and both Adam moments come from the
host; when it leaves, they go back (into bf16 moments with host_moments_dtype="bfloat16":
rounded to nearest, once per move). Nothing is reset. The two sides count updates separately,
so a moment is rescaled on the way (`moment_rescale`) to keep its bias-corrected value unchanged.
Both functions run at a window boundary after the host has been drained.
"""
from __future__ import annotations

import torch

from zenflow.adamw import FP32_STATE, moment_rescale
from zenflow.distributed import Partition
from zenflow.optim import columns
from zenflow.optim.device_adam import DeviceColumns

_KINDS = FP32_STATE


def _host_columns(host_rows: torch.Tensor, cols: torch.Tensor, num_rows: int,
                  partition: Partition) -> torch.Tensor:
    """host[:, cols] over all rows of the matrix (other ranks hold the other rows); on the
    collectives' device under data parallel (NCCL: this rank's rows go to the device first).
    Under FSDP2 a rank's device holds only its own rows: nothing to gather."""
    own = columns.gather_columns(host_rows, cols, out=host_rows.new_empty(
        host_rows.shape[0], len(cols), dtype=torch.float32))   # (bf16 moments widen)
    if not partition.splits_rows:
        return own
    return partition.gather_rows(partition.from_host(own), num_rows,
                                 "moving columns to the device")


def take_from_host(dev: DeviceColumns, host: dict[str, torch.Tensor],
                   column_indices: torch.Tensor, host_step: int, num_rows: int,
                   partition: Partition) -> None:
    """First selection: the device side starts at the host's count with the host's state."""
    cpu_index = column_indices.cpu()
    dev.column_indices.copy_(column_indices)
    dev.step = host_step
    for name in _KINDS:
        getattr(dev, name).copy_(_host_columns(host[name], cpu_index, num_rows, partition))


def move_columns(dev: DeviceColumns, host: dict[str, torch.Tensor], new_indices: torch.Tensor,
                 host_step: int, betas: tuple[float, float], rows: slice, num_rows: int,
                 partition: Partition) -> None:
    """Reselection: columns that leave the device go back to the host (this rank's rows), columns
    that join come from it; staying columns keep their device state."""
    beta_of = {"master": None, "exp_avg": betas[0], "exp_avg_sq": betas[1]}
    old, new = dev.column_indices.cpu(), new_indices.cpu()
    stays, leaves = torch.isin(new, old), ~torch.isin(old, new)
    to_dev = dev.column_indices.device

    out_cols, out_pos = old[leaves], leaves.nonzero().flatten().to(to_dev)
    for name, beta in beta_of.items():
        leaving = getattr(dev, name)[rows].index_select(1, out_pos).cpu()
        if beta is not None:
            leaving.mul_(moment_rescale(beta, dev.step, host_step))
        columns.scatter_columns(host[name], out_cols, leaving)

    stay_src = torch.searchsorted(old, new[stays]).to(to_dev)
    stay_dst = stays.nonzero().flatten().to(to_dev)
    join_cols, join_dst = new[~stays], (~stays).nonzero().flatten().to(to_dev)
    for name, beta in beta_of.items():
        current = getattr(dev, name)
        fresh = torch.empty_like(current)
        fresh.index_copy_(1, stay_dst, current.index_select(1, stay_src))
        joining = _host_columns(host[name], join_cols, num_rows, partition)
        if beta is not None:
            joining.mul_(moment_rescale(beta, host_step, dev.step))
        fresh.index_copy_(1, join_dst, joining.to(fresh.device))
        current.copy_(fresh)   # (in place: it may be a view of a ColumnBlock)
    dev.column_indices.copy_(new_indices)
