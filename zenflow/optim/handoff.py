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
from zenflow.optim.device_adam import ColumnBlock, DeviceColumns

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


def take_block_from_host(block: ColumnBlock, host: dict[str, torch.Tensor],
                         column_indices: torch.Tensor, host_steps: list[int],
                         partition: Partition | None = None) -> None:
    """take_from_host of every member of `block` at once: `host[name]` the members' host state
    as [size, rows, cols] (back to back in the host buffers: this rank's rows of each;
    `partition`, where it splits the rows, gathers every rank's), `column_indices` [size, k],
    `host_steps` the members' host counts."""
    size, num_rows, k = block.master.shape
    own_rows = host["master"].shape[1]
    spread = column_indices.cpu().unsqueeze(1).expand(size, own_rows, k)
    block.column_indices.copy_(column_indices)
    block.counts.copy_(torch.tensor(host_steps, dtype=torch.float32))
    for name in _KINDS:   # (bf16 moments widen)
        taken = host[name].gather(2, spread).float()
        if partition is not None and partition.splits_rows:
            taken = _gather_members_rows(taken, num_rows, partition)
        getattr(block, name).copy_(taken)


def _gather_members_rows(own: torch.Tensor, num_rows: int, partition: Partition) -> torch.Tensor:
    """[size, num_rows, k]: every rank's rows of each member of `own` ([size, rows, k], this
    rank's), in one gather (rows first, as gather_rows takes them)."""
    return partition.gather_rows(partition.from_host(own.transpose(0, 1).contiguous()), num_rows,
                                 "moving columns to the device").transpose(0, 1)


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


def move_block_columns(block: ColumnBlock, host: dict[str, torch.Tensor],
                       new_indices: torch.Tensor, host_steps: list[int],
                       betas: tuple[float, float], rows: slice | None = None,
                       partition: Partition | None = None) -> None:
    """move_columns of every member of `block` at once: a few operators whatever its size (an
    MoE's thousands of experts; a member alone costs about 40 operators and two reads of the
    device, and under data parallel a gather of every rank's rows a kind), the same values.
    `host[name]`: the members' host state as [size, rows, cols] (back to back in the host
    buffers: this rank's `rows` of each, all of them by default; `partition`, where it splits
    the rows, gathers every rank's); `new_indices`: [size, k], each row ascending;
    `host_steps`: the members' host counts (their device counts are the block's)."""
    size, num_rows, k = block.master.shape
    own = rows if rows is not None else slice(0, num_rows)
    gathers = partition is not None and partition.splits_rows
    to_dev = block.column_indices.device
    dev_steps = [int(c) for c in block.counts.tolist()]   # one read of the device
    old, new = block.column_indices.cpu(), new_indices.cpu()
    at_old = torch.searchsorted(old, new).clamp_max(k - 1)      # where a staying column was
    stays = (old.gather(1, at_old) == new).to(to_dev).unsqueeze(1)
    leaves = (new.gather(1, torch.searchsorted(new, old).clamp_max(k - 1)) != old).unsqueeze(1)
    own_rows = own.stop - own.start
    spread_old, spread_new = (c.unsqueeze(1).expand(size, own_rows, k) for c in (old, new))
    keep_from = at_old.to(to_dev).unsqueeze(1).expand(size, num_rows, k)
    for name, beta in (("master", None), ("exp_avg", betas[0]), ("exp_avg_sq", betas[1])):
        current, stack = getattr(block, name), host[name]
        leaving = current[:, own].to("cpu", copy=True)
        if beta is not None:
            leaving.mul_(_rescales(beta, dev_steps, host_steps))
        # (a staying column's host copy is written back as it was: only leaving ones change)
        stack.scatter_(2, spread_old, torch.where(leaves, leaving.to(stack.dtype),
                                                  stack.gather(2, spread_old)))
        joining = stack.gather(2, spread_new).float()
        if beta is not None:
            joining.mul_(_rescales(beta, host_steps, dev_steps))
        if gathers:   # every rank's rows, one gather for all the members
            joining = _gather_members_rows(joining, num_rows, partition)
        current.copy_(torch.where(stays, current.gather(2, keep_from), joining.to(to_dev)))
    block.column_indices.copy_(new_indices)


def _rescales(beta: float, from_steps: list[int], to_steps: list[int]) -> torch.Tensor:
    """moment_rescale of each member, as [size, 1, 1] fp32 (a Python float multiplies an fp32
    tensor as this fp32 value does)."""
    return torch.tensor([moment_rescale(beta, a, b) for a, b in zip(from_steps, to_steps)],
                        dtype=torch.float32).view(-1, 1, 1)
