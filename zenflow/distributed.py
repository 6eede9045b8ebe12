"""Data parallel ZenFlow on torch.distributed: which host rows a rank owns, and the few collectives.

Every rank holds the same (averaged) gradients, so the device side, which updates the selected
columns and the vectors, computes the same result everywhere with no communication. The host
side is partitioned ZeRO-2 style: each rank's host (and worker) holds the master values, moments
and gradient sums of only its share of each matrix's *rows*, and copies only those rows of each
gradient to the host. The host AdamW is element-wise, so rows are as good a unit of ownership as
columns, and a row range of a row-major matrix is one contiguous block (no gathers).

Selection needs the column norms of the whole matrix. Each rank computes them over its own rows
and the ranks sum the squares: one number per column crosses the network, never a gradient.

Where a collective's tensors live follows the group's backend (`Partition.device`):

- NCCL (and any backend other than gloo/mpi): on the rank's device, the optimizer's. Per call:
  the column-norm exchange and the window-end flag are computed and reduced on the device (no
  copy to the host; the flag is read back with one .item(), a decision the host needs anyway);
  an install copies only this rank's updated rows from its own install buffer to the device
  (one H2D copy of 1/N of the matrix, on the transfer stream) and the ranks all-gather them on the
  device, straight into the parameter when the rows split evenly: no rank's host memory ever
  holds another rank's rows, and nothing goes back through pageable memory. Columns moving to
  the device at a reselection are gathered the same way (this rank's rows of the k columns go to
  the device first, `from_host`). Gradient averaging in the engine is an all-reduce on the device.
- gloo (and mpi): on the CPU. Norms and flags are tiny, so a device->host copy costs nothing that
  matters; installs gather every rank's rows in host memory and copy the whole matrix to the
  device, which is the cheap path when the device is the CPU (tests, CPU training) and the only
  one gloo offers. With gloo on GPUs every window moves the whole model through host memory:
  use NCCL there.

Collectives always receive tensors on `Partition.device`; callers make host data cross to the
device explicitly (`from_host`), so a CPU run under a group that says "nccl" exercises the code
a GPU run does (tests/test_dist_backends.py checks every collective's tensors that way). The
module-level `dist` is the one handle on torch.distributed, so a test can intercept it.

FSDP2 (`fully_shard`). Its parameters are DTensors sharded `Shard(0)` on a 1-D mesh: each rank
already holds one block of rows of every parameter, the same row partition the host state uses.
The Partition then says `rows_are_local`: a rank's rows are its whole local tensor (`local()`),
nothing is sliced out of a replica and nothing is gathered at an install or a handoff (the rows
never leave their rank); column norms are summed across ranks as above, and so are the squared
gradient norms for clipping, since no rank holds the whole gradient (`splits_rows` is the DDP
case: replicas, whose host rows are gathered back into every replica).

A collective that fails (a rank died, the network broke) raises a RuntimeError that says so;
the process group's timeout bounds how long a lost peer can make the others wait.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

HOST_BACKENDS = ("gloo", "mpi")   # backends whose collectives take CPU tensors
_CPU = torch.device("cpu")
_PLAIN = (torch.Tensor, torch.nn.Parameter)   # never DTensors


def environment_without_group(owner: str, process_group=None) -> None:
    """Raise if a launcher announced several ranks ($WORLD_SIZE > 1) but no process group exists:
    each rank would train alone, the replicas would diverge silently."""
    if process_group is not None or (dist.is_available() and dist.is_initialized()):
        return
    try:
        world = int(os.environ.get("WORLD_SIZE", "1") or "1")
    except ValueError:
        return
    if world > 1:
        raise RuntimeError(
            f"{owner}: WORLD_SIZE={world} but torch.distributed is not initialized, so this rank "
            "would train alone and the replicas would diverge; call "
            "torch.distributed.init_process_group() (or zenflow.init_distributed()) before "
            "building the optimizer, or use zenflow.initialize, which does it")


def _dtensor_type():
    """torch's DTensor class, or None while nothing has imported it: no tensor is a DTensor
    before torch.distributed.tensor is imported, and importing it costs every process that
    imports zenflow 0.7 s (the suite's children, the bench's, a worker's fork server)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds: a DTensor's local shard (a view sharing its storage, so
    writes reach the parameter), any other tensor itself. Callers ask again at each use: FSDP2
    may swap a parameter's local tensor object (same storage) at its first forward."""
    if type(t) in _PLAIN:   # asked several times per matrix per step: the cheap answer first
        return t
    return t._local_tensor if is_sharded(t) else t


def is_sharded(t: torch.Tensor) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def sharded_like(t: torch.Tensor, param: torch.Tensor, dim: int = 0,
                 whole: int | None = None) -> torch.Tensor:
    """`t`, this rank's block of optimizer state split along `dim` as the FSDP2 parameter `param`
    is split along its rows, as a DTensor on the parameter's mesh (Shard(dim); the whole
    tensor's size along `dim` is the parameter's row count, or `whole`: a block of equal size
    per rank), so that torch.distributed.checkpoint saves each rank's block where it belongs.

    `t` stays where it is: DTensor.from_local would copy it to the mesh's device, which for
    host state (master values and moments) on a CUDA mesh is the very copy ZenFlow avoids. The
    DTensor is built the way FSDP2 builds its own CPU-offloaded parameters, from a spec."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    shape = list(t.shape)
    shape[dim] = param.shape[0] if whole is None else whole
    stride, acc = [0] * len(shape), 1
    for d in reversed(range(len(shape))):
        stride[d], acc = acc, acc * shape[d]
    spec = DTensorSpec(param.device_mesh, (Shard(dim),),
                       tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), t.dtype))
    return DTensor(t, spec, requires_grad=False)


def row_sharding_group(owner: str, params: list[torch.Tensor], process_group=None):
    """The process group of FSDP2-sharded `params` (None when no parameter is a DTensor),
    refusing what this code does not support: a mix of DTensors and plain tensors, placements
    other than Shard(0) on a 1-D mesh, parameters on different meshes, or a `process_group`
    that is not the mesh's."""
    sharded = [i for i, p in enumerate(params) if is_sharded(p)]
    if not sharded:
        return None
    if len(sharded) != len(params):
        plain = next(i for i, p in enumerate(params) if not is_sharded(p))
        raise ValueError(
            f"{owner}: params mixes DTensors (FSDP2-sharded, e.g. params[{sharded[0]}]) and plain "
            f"tensors (params[{plain}], shape {tuple(params[plain].shape)}); shard every "
            "parameter with fully_shard (wrap the root module too) or none")
    from torch.distributed.tensor import Shard  # (imported: the parameters are DTensors)
    mesh = params[0].device_mesh
    for i, p in enumerate(params):
        where = f"params[{i}] (shape {tuple(p.shape)})"
        if p.device_mesh.ndim != 1:
            raise ValueError(f"{owner}: {where} is a DTensor on a {p.device_mesh.ndim}-D device "
                             "mesh; only a 1-D mesh (fully_shard's FSDP) is supported, not HSDP "
                             "or tensor parallel meshes")
        if tuple(p.placements) != (Shard(0),):
            raise ValueError(f"{owner}: {where} is a DTensor placed {tuple(p.placements)}; only "
                             "(Shard(dim=0),), fully_shard's default, is supported (not "
                             "Replicate() or Shard(1): each rank must hold whole rows)")
        if p.device_mesh != mesh:
            raise ValueError(f"{owner}: {where} is on another device mesh than params[0]; all "
                             "parameters must share one mesh")
    group = mesh.get_group()
    if process_group is not None and process_group is not group:
        raise ValueError(f"{owner}: process_group is not the device mesh's group of the "
                         "FSDP2-sharded parameters; leave process_group out (the mesh's is used)")
    return group


@dataclass
class Partition:
    """This rank's place in the process group (a single process is rank 0 of 1), the device its
    collectives take tensors on, and the bytes they have sent, by purpose."""
    rank: int = 0
    world_size: int = 1
    group: object = None
    bytes_sent: dict = field(default_factory=dict)
    backend: str | None = None
    device: torch.device = _CPU   # where tensors handed to this group's collectives live
    # The parameters are row shards already (FSDP2): a rank's rows are its whole local tensor.
    rows_are_local: bool = False

    @classmethod
    def from_group(cls, group, device: torch.device | str,
                   rows_are_local: bool = False) -> Partition:
        """`group`: the torch.distributed group (None: the default one). `device`: the rank's
        device (the optimizer's or the engine's), always given: collectives of a device backend
        (NCCL) run there, never on the implicit current device (cuda:0 on every rank of a script
        that did not call torch.cuda.set_device); those of gloo/mpi run on the CPU.
        `rows_are_local`: the parameters are FSDP2 row shards."""
        if device is None:
            raise TypeError("Partition.from_group: device is required (the rank's device)")
        if not (dist.is_available() and dist.is_initialized()):
            return cls(rows_are_local=rows_are_local)
        backend = str(dist.get_backend(group)).lower()
        if backend in HOST_BACKENDS:
            device = _CPU
        return cls(dist.get_rank(group), dist.get_world_size(group), group, backend=backend,
                   device=torch.device(device), rows_are_local=rows_are_local)

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def on_device(self) -> bool:
        """Whether collectives run on the rank's device (NCCL) rather than on the CPU (gloo)."""
        return self.backend is not None and self.backend not in HOST_BACKENDS

    @property
    def splits_rows(self) -> bool:
        """Whether each rank holds a replica of which its host owns some rows (DDP), so that
        installs and handoffs gather the other ranks' rows; not so for FSDP2's shards."""
        return self.active and not self.rows_are_local

    @property
    def shards_gradients(self) -> bool:
        """Whether each rank holds only some rows of every gradient (FSDP2), so that a norm over
        whole gradients is summed across ranks."""
        return self.active and self.rows_are_local

    def rows(self, num_rows: int) -> slice:
        """This rank's rows of a matrix with `num_rows` rows (of the tensor this rank holds):
        equal contiguous blocks of a replica, or all of them when the rows are local already."""
        if self.rows_are_local:
            return slice(0, num_rows)
        per_rank = math.ceil(num_rows / self.world_size)
        start = min(num_rows, self.rank * per_rank)
        return slice(start, min(num_rows, start + per_rank))

    def rows_per_rank(self, num_rows: int) -> int:
        if self.rows_are_local:
            return num_rows
        return math.ceil(num_rows / self.world_size)

    def from_host(self, host: torch.Tensor) -> torch.Tensor:
        """Host data a collective will send, on `self.device`: the tensor itself for gloo, a copy
        on the device for NCCL (always a copy, so CPU runs take the GPU's path)."""
        if not self.on_device:
            return host
        return torch.empty(host.shape, dtype=host.dtype, device=self.device).copy_(host)

    # -- collectives --------------------------------------------------------------------------
    def _count(self, what: str, tensor: torch.Tensor) -> None:
        self.bytes_sent[what] = (self.bytes_sent.get(what, 0) +
                                 tensor.numel() * tensor.element_size())

    def _run(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # gloo/nccl raise RuntimeError or DistBackendError
            raise RuntimeError(
                f"ZenFlowAdamW: {what} across {self.world_size} ranks failed on rank {self.rank} "
                f"({type(exc).__name__}: {exc}); another rank may have died or stopped "
                "stepping in lockstep") from exc

    def sum_(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """All-reduce (sum) in place; a no-op on one rank. A tensor that is not on the group's
        device (a CUDA tensor under gloo) goes through a copy there and back."""
        if self.active:
            buf = tensor if tensor.device == self.device else tensor.to(self.device)
            self._count(what, buf)
            self._run(what, dist.all_reduce, buf, op=dist.ReduceOp.SUM, group=self.group)
            if buf is not tensor:
                tensor.copy_(buf)
        return tensor

    def any(self, flag: bool, what: str) -> bool:
        """True on every rank if it is true on any rank (decisions all ranks must share)."""
        if not self.active:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        self._count(what, t)
        self._run(what, dist.all_reduce, t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def start_any(self, flag: bool, what: str):
        """Start the all-reduce of any() without waiting for it; returns a function that gives
        its result, to call later (a step later, it waits for nothing: the collective has long
        finished). Under NCCL the result comes back through page-locked host memory, copied
        after the collective on the current stream, so reading it waits for that copy's event,
        not for everything the device has queued since."""
        if not self.active:
            return lambda: flag
        t = torch.full((1,), 1 if flag else 0, dtype=torch.int32, device=self.device)
        self._count(what, t)
        work = self._run(what, dist.all_reduce, t, op=dist.ReduceOp.MAX, group=self.group,
                         async_op=True)
        if not self.on_device:
            def result() -> bool:
                self._run(what, work.wait)
                return bool(t[0])
            return result
        work.wait()   # orders the current stream after the collective; the host goes on
        if t.device.type == "cpu":   # a CPU stand-in for NCCL (the tests): already host memory
            return lambda: bool(t[0])
        host = torch.empty(1, dtype=torch.int32, pin_memory=True)
        host.copy_(t, non_blocking=True)
        copied = torch.Event(device=self.device)
        copied.record()

        def result_on_host() -> bool:
            copied.synchronize()
            return bool(host[0])
        return result_on_host

    def gather_objects(self, obj, what: str) -> list:
        """Every rank's picklable `obj`, in rank order (small metadata only)."""
        if not self.active:
            return [obj]
        out = [None] * self.world_size
        self._run(what, dist.all_gather_object, out, obj, group=self.group)
        return out

    def broadcast_object(self, obj, what: str, src: int = 0):
        """Rank `src`'s picklable `obj` on every rank (small metadata only)."""
        if not self.active:
            return obj
        box = [obj if self.rank == src else None]
        self._run(what, dist.broadcast_object_list, box, src=src, group=self.group)
        return box[0]

    def broadcast_(self, tensors: list[torch.Tensor], what: str, src: int = 0) -> None:
        """Every tensor := rank `src`'s, in place (one flat broadcast per dtype)."""
        if not self.active:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for same in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1).to(self.device) for t in same])
            if self.rank == src:
                self._count(what, flat)
            self._run(what, dist.broadcast, flat, src=src, group=self.group)
            with torch.no_grad():
                for t, part in zip(same, flat.split([t.numel() for t in same])):
                    t.copy_(part.view_as(t))

    def first_disagreement(self, tensors: list[torch.Tensor], what: str) -> int | None:
        """The index of the first tensor whose values differ between ranks (None: all agree),
        from one collective over two float64 checksums per tensor: its sum and the sum of its
        even-numbered elements (so most reorderings show too), accumulated without a copy."""
        # Plain tensors only: a sharded parameter (a DTensor) differs between ranks by design.
        plain = [i for i, t in enumerate(tensors) if type(t) in (torch.Tensor, torch.nn.Parameter)]
        if not self.active or not plain:
            return None
        sums = []
        for t in (tensors[i] for i in plain):
            flat = t.detach().reshape(-1)
            sums += [flat.sum(dtype=torch.float64), flat[::2].sum(dtype=torch.float64)]
        local = torch.stack(sums).to(self.device)
        both = torch.cat([local, -local])   # max and -min in one all-reduce
        self._count(what, both)
        self._run(what, dist.all_reduce, both, op=dist.ReduceOp.MAX, group=self.group)
        high, low = both[:local.numel()], -both[local.numel():]
        differ = ((high != low) & ~(torch.isnan(high) & torch.isnan(low))).view(-1, 2).any(1)
        return plain[int(differ.nonzero()[0])] if bool(differ.any()) else None

    def barrier(self, what: str) -> None:
        if self.active:
            self._run(what, dist.barrier, group=self.group)

    def _all_gather(self, what: str, out: torch.Tensor, own: torch.Tensor) -> None:
        self._count(what, own)
        # all_gather_single is the newer name (torch >= 2.13) of all_gather_into_tensor.
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._run(what, all_gather, out, own, group=self.group)

    def gather_rows(self, own_rows: torch.Tensor, num_rows: int, what: str) -> torch.Tensor:
        """Every rank's row block of a [num_rows, n] matrix, concatenated: [num_rows, n] on
        `self.device` (own_rows must be there: see from_host)."""
        if not self.active:
            return own_rows
        per_rank = self.rows_per_rank(num_rows)
        padded = own_rows.new_zeros((per_rank, *own_rows.shape[1:]))
        padded[: own_rows.shape[0]] = own_rows
        out = own_rows.new_empty((per_rank * self.world_size, *own_rows.shape[1:]))
        self._all_gather(what, out, padded)
        return out[:num_rows]

    def gather_stacked(self, own: torch.Tensor, what: str) -> torch.Tensor:
        """[world_size, *own.shape]: every rank's `own` (of one shape on every rank), in rank
        order, on `self.device` (own must be there: see from_host)."""
        if not self.active:
            return own.unsqueeze(0)
        out = own.new_empty(self.world_size * own.numel())   # gloo takes no stacked output
        self._all_gather(what, out, own.contiguous())
        return out.view(self.world_size, *own.shape)

    def own_rows_buffer(self, num_rows: int, like: torch.Tensor) -> torch.Tensor:
        """A zeroed [rows_per_rank, n] buffer on `self.device` for this rank's rows of a matrix
        like `like` ([num_rows, n]); fill its first rows, then gather_rows_into()."""
        return torch.zeros((self.rows_per_rank(num_rows), *like.shape[1:]), dtype=like.dtype,
                           device=self.device)

    def gather_rows_into(self, matrix: torch.Tensor, own_padded: torch.Tensor, what: str) -> None:
        """matrix[:] = every rank's rows (each rank's own_rows_buffer), gathered on the device:
        straight into `matrix` when its rows split evenly, else through one padded buffer."""
        per_rank = own_padded.shape[0]
        if per_rank * self.world_size == matrix.shape[0] and matrix.is_contiguous():
            self._all_gather(what, matrix, own_padded)
            return
        out = own_padded.new_empty((per_rank * self.world_size, *own_padded.shape[1:]))
        self._all_gather(what, out, own_padded)
        matrix.copy_(out[: matrix.shape[0]])
