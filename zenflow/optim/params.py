"""The optimizer's parameters, by where their state lives.

A `HostParam` (every matrix; for OffloadAdamW every parameter) keeps its fp32 master values and
moments in the host pipeline, except for its `k` selected columns, whose state is on the device
(`DeviceColumns`). A `VectorParam` (a bias, a norm weight) is updated on the device every step.

`param` is the parameter as the optimizer was given it (the key of its gradient and of its saved
state); `local` is what this rank holds of it and what the optimizer reads and writes: the
parameter itself, or an FSDP2 parameter's local row shard.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from zenflow.distributed import is_sharded, local
from zenflow.host.weight_views import WeightViews
from zenflow.optim import columns
from zenflow.optim.device_adam import (
    DeviceColumns,
    DeviceVector,
    column_blocks,
    device_step,
    write_selected,
)
from zenflow.optim.importance import num_selected

log = logging.getLogger("zenflow")


@dataclass
class HostParam:
    """A parameter whose state lives on the host, except for its `k` selected columns."""
    param: torch.nn.Parameter
    group: dict
    host_index: int            # its number in the HostPipeline
    k: int                     # number of columns updated on the device
    selected: DeviceColumns    # the selected columns and their state, on the device (own rows)
    num_columns: int           # columns of its [out, in] view (a vector: its elements)

    @property
    def local(self) -> torch.Tensor:
        return local(self.param)

    def host_owns_columns(self, columns_chosen: bool) -> bool:
        """Whether some of its columns are updated on the host (all of them before selection)."""
        return not columns_chosen or self.k < self.num_columns

    def selected_from_param(self) -> None:
        """The selected columns' master values := the parameter's (weights written outside)."""
        columns.gather_columns(columns.as_matrix(self.local.detach()),
                               self.selected.column_indices, out=self.selected.master)

    def param_from_selected(self, weights: torch.Tensor) -> None:
        """The parameter's selected columns := their device master values, which are newer than
        the host's (after the host's update of the other columns was installed); `weights`: the
        [rows, cols] view the optimizer writes it through (HostPipeline.weights)."""
        columns.scatter_columns(weights, self.selected.column_indices, self.selected.master)


@dataclass
class VectorParam:
    """A vector parameter (bias, norm weight): plain AdamW on the device, every step."""
    param: torch.nn.Parameter
    group: dict
    state: DeviceVector

    @property
    def local(self) -> torch.Tensor:
        return local(self.param)

    def master_from_param(self) -> None:
        """The master values := the parameter's (weights written outside the optimizer)."""
        if self.state.master.data_ptr() != self.local.data_ptr():
            self.state.master.copy_(self.local.detach())


def built_layout(param_groups: list[dict]) -> dict:
    """What the optimizer built its state for, per parameter it was given: the dtype of a
    trainable one (and that it is contiguous), None for one frozen then."""
    return {p: p.dtype if p.requires_grad else None
            for group in param_groups for p in group["params"]}


_NOT_BUILT = object()


def present_gradients(param_groups: list[dict], device: torch.device, owner: str,
                      built: dict) -> dict:
    """{parameter: gradient} of the trainable parameters that have one, each checked to be dense
    and on `device` (of an FSDP2 parameter: its local shard), and to be what the optimizer was
    built for (`built_layout`)."""
    grads = {}
    for group in param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None or not p.requires_grad:
                continue
            dtype = built.get(p, _NOT_BUILT)
            if dtype is _NOT_BUILT:
                raise ValueError(f"{owner}: {_not_built_for(p)}")
            if dtype != p.dtype or not p.is_contiguous():
                raise ValueError(f"{owner}: {_changed_since_built(p, dtype)}")
            if g.is_sparse or g.device != device:
                where = "sparse" if g.is_sparse else f"on {g.device}"
                raise ValueError(f"{owner}: the gradient of a parameter of shape "
                                 f"{tuple(p.shape)} is {where}; dense gradients on {device} "
                                 "are required")
            grads[p] = local(g)
    return grads


def _not_built_for(p: torch.Tensor) -> str:
    kind = "a DTensor" if is_sharded(p) else "a plain tensor"
    return (f"param_groups holds a parameter of shape {tuple(p.shape)} ({kind}) that the optimizer "
            "was not built over: something replaced the parameters in param_groups after it was "
            "built, so its state belongs to tensors the model no longer uses. Accelerate's "
            "prepare(model, optimizer) with an FSDP2 plugin does this (it shards the model, then "
            "swaps the optimizer's parameters for the shards): shard the model first "
            "(accelerate.utils.fsdp2_prepare_model(accelerator, model), or fully_shard), build "
            "the optimizer over the sharded model.parameters(), then pass both to "
            "accelerator.prepare (docs/fsdp2.md)")


def _changed_since_built(p: torch.Tensor, dtype: torch.dtype | None) -> str:
    shape = tuple(p.shape)
    if dtype is None:
        return (f"the parameter of shape {shape} did not require grad when the optimizer was "
                "built and now has a gradient: it has no optimizer state and would never be "
                "updated; build the optimizer after unfreezing it")
    if p.dtype != dtype:
        return (f"the parameter of shape {shape} is {p.dtype} but was {dtype} when the optimizer "
                "was built (model.to(dtype) or .double() afterwards?); build the optimizer after "
                "changing the model's dtype")
    return (f"the parameter of shape {shape} is no longer contiguous (model.to(memory_format="
            "torch.channels_last) afterwards?); build the optimizer after changing the memory "
            "format, or keep the parameters contiguous")


def device_update(grads, vector_params: list[VectorParam], scale,
                  vector_weights: WeightViews) -> None:
    """AdamW on the device: the selected columns of the matrices with a gradient (`grads`, a
    zenflow.optim.step_plan.StepGradients: its plan's `matrix_steps`, none before the columns
    are chosen) and every vector with one (those without are left alone, as torch.optim does),
    scaled by `scale` (a zenflow.optim.step_scale.StepScale: nothing changes on a step it
    skips). The vectors are written through `vector_weights` (by position in `vector_params`);
    the matrices' columns are left for the caller to write (MatrixSteps.write)."""
    plan = grads.plan
    vectors = [(vector_weights[j], grads.vectors[j], vector_params[j].state,
                vector_params[j].group) for j in plan.vector_present]
    device_step(plan.matrix_steps, plan.pick_stepped(grads.host), vectors, scale)


def params_from_selected(matrices: list[HostParam], weights: WeightViews) -> None:
    """param_from_selected() of each of `matrices`, written through `weights` (by host index);
    the members of a whole ColumnBlock together."""
    write_selected([weights[m.host_index] for m in matrices], [m.selected for m in matrices])


def sort_params(param_groups: list[dict], topk_ratio: float, vectors_on_host: bool,
                device: torch.device) -> tuple[list[HostParam], list[VectorParam]]:
    """The trainable parameters of `param_groups`, each with a place for its state."""
    host: list[HostParam] = []
    vectors: list[VectorParam] = []
    shapes = []   # (rows, cols, dtype, k) of each host matrix: alike small ones share blocks
    for group in param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            if p.ndim >= 2 or vectors_on_host:
                k = num_selected(topk_ratio, p.numel() // p.shape[0]) \
                    if p.ndim >= 2 else 0
                rows = local(p).shape[0] if p.ndim >= 2 else 1
                width = p.numel() // max(1, p.shape[0]) if p.ndim >= 2 else p.numel()
                host.append(HostParam(p, group, len(host), k, None, width))
                shapes.append((rows, width, p.dtype, k))
            else:
                vectors.append(VectorParam(p, group, DeviceVector.for_param(local(p))))
    for m, selected in zip(host, column_blocks(shapes, device)):
        m.selected = selected
    return host, vectors




def device_state_bytes(host_params: list[HostParam], vector_params: list[VectorParam]) -> int:
    """Bytes of optimizer state on the device: the selected columns' and the vectors'."""
    return (sum(m.selected.nbytes() for m in host_params)
            + sum(v.state.nbytes(v.local) for v in vector_params))
