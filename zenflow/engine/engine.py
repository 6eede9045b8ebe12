"""A DeepSpeed-style training engine driven by the DeepSpeed JSON config.

    engine, optimizer, dataloader, scheduler = zenflow.engine.engine.initialize(
        model=model, config="ds_config.json", training_data=dataset)
    for batch in dataloader:
        loss = engine(batch)
        engine.backward(loss)   # scaled by 1/gradient_accumulation_steps (and the fp16 scale)
        engine.step()           # steps the optimizer only at the accumulation boundary

What runs is decided by the config: a `zero_optimization.zenflow` block gives ZenFlowAdamW,
CPU optimizer offload without it gives OffloadAdamW (the ZeRO-Offload baseline), neither gives
plain torch.optim.AdamW on the device. The model's weights are never rewritten or re-laid-out;
with bf16/fp16 they are cast once, and the optimizer keeps fp32 master weights.

Whoever reads the model sees current weights: evaluation forwards, `state_dict()`, checkpoints
and `save_16bit_model` install ZenFlow's in-flight host update first (see zenflow/engine/weight_sync.py).
The DeepSpeed accessors scripts call (ranks, precision queries, no_sync, ...) are in
zenflow/engine/deepspeed_api.py.
"""
from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zenflow.compat.deepspeed import comm
from zenflow.compat.deepspeed.args import config_from_arguments
from zenflow.config.deepspeed_json import (
    ZenFlowConfig,
    load_config_dict,
    parse_config,
    resolved_settings,
)
from zenflow.distributed import Partition, is_sharded
from zenflow.engine.build import EngineConstruction, core_optimizers
from zenflow.engine.checkpoint import check_tag, load_object, read_checkpoint, write_checkpoint
from zenflow.engine.checkpoint_dcp import load_fsdp2_checkpoint, save_fsdp2_checkpoint
from zenflow.engine.checkpoint_shards import write_sharded_checkpoint
from zenflow.engine.deepspeed_api import DeepSpeedEngineAPI, frozen_parameter_names, grad_norm
from zenflow.engine.fp32_masters import FP32Masters, trainable_param_groups
from zenflow.engine.fsdp import check_sharding
from zenflow.engine.loss_scaler import LossScaler
from zenflow.engine.rank_agreement import StepAgreement
from zenflow.engine.weight_sync import WeightSync, synchronized_state

log = logging.getLogger("zenflow.engine")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# Gradients are averaged across ranks this many bytes at a time: one flat temporary per bucket,
# never one of the whole model (12.5 GiB for a 7B model in bf16), as DDP buckets them.
GRADIENT_BUCKET_BYTES = 256 << 20


def gradient_buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """`grads` in order, grouped by dtype into runs of at most `bucket_bytes` (a larger gradient
    makes a bucket of its own)."""
    buckets: list[list[torch.Tensor]] = []
    open_bucket: dict[torch.dtype, tuple[list[torch.Tensor], int]] = {}
    for g in grads:
        nbytes = g.numel() * g.element_size()
        bucket, size = open_bucket.get(g.dtype, ([], 0))
        if bucket and size + nbytes > bucket_bytes:
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append(g)
        open_bucket[g.dtype] = (bucket, size + nbytes)
    buckets += [bucket for bucket, _ in open_bucket.values() if bucket]
    return buckets


class ZenFlowEngine(DeepSpeedEngineAPI, EngineConstruction, torch.nn.Module):
    """Wraps a model with its optimizer, schedule, precision and checkpointing."""

    def __init__(self, model: torch.nn.Module, config: ZenFlowConfig, raw_config: dict, *,
                 model_parameters=None, optimizer=None, lr_scheduler=None, training_data=None,
                 collate_fn=None):
        super().__init__()
        # FSDP2 (and stage 3, which maps to it) is checked before the model is touched.
        self._fsdp2 = check_sharding(model, config)
        self.config = config
        self._raw_config = raw_config
        self.module = model
        self.dtype = _DTYPES[config.dtype_name]
        self.device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                       if torch.cuda.is_available() else torch.device("cpu"))
        # Module.to changes data in place, so parameter objects (and their identity) survive.
        model.to(device=self.device)
        if self.dtype != torch.float32:
            model.to(dtype=self.dtype)
        # Every rank starts from rank 0's weights (an unseeded model differs per process), as
        # DeepSpeed's initialize does; buffers too (running statistics). FSDP2's shards differ
        # between ranks by design: fully_shard took each rank's rows of the same whole weights.
        self._ranks().broadcast_(
            [*(p for p in model.parameters() if not is_sharded(p)),
             *(b for b in model.buffers() if b.is_floating_point())],
            "broadcasting rank 0's weights at initialize")

        self.global_steps = 0      # optimizer steps attempted (incl. fp16-overflow skips)
        self.micro_steps = 0       # engine.step() calls (micro-batches)
        self.global_samples = 0
        self.skipped_steps = 0     # steps skipped because the fp16 gradients overflowed
        self._step_applied = False
        self._global_grad_norm: torch.Tensor | None = None
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary
        self._accumulation_start = 0  # micro_steps at the last set_train_batch_size
        self._inside_no_sync = False
        self._closed = False

        self.training_dataloader = (self._make_dataloader(training_data, collate_fn)
                                    if training_data is not None else None)
        groups, self._params = trainable_param_groups(
            model_parameters if model_parameters is not None else model.parameters())
        self._masters: FP32Masters | None = None
        self.optimizer = self._make_optimizer(optimizer, groups)
        self.lr_scheduler = self._make_scheduler(lr_scheduler)
        # Our optimizers clip inside step() (max_grad_norm); any other is clipped here.
        self._engine_clips = bool(config.gradient_clipping) and not isinstance(
            self.optimizer, core_optimizers())
        fp16 = config.fp16
        self.loss_scaler = None
        if fp16.enabled:
            self.loss_scaler = LossScaler(
                dynamic=config.dynamic_loss_scale,
                init_scale=(2.0 ** fp16.initial_scale_power if config.dynamic_loss_scale
                            else fp16.loss_scale),
                scale_window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
                consecutive_hysteresis=fp16.consecutive_hysteresis,
                min_scale=fp16.min_loss_scale)
        ignored = config.ignored_keys()
        if ignored:
            log.info("config keys accepted but without effect here: %s", ", ".join(ignored))
        log.info("engine: %s", resolved_settings(config))
        # Under data parallel, where ranks meet before a read or a save (rank_agreement.py).
        self._agreement = StepAgreement.for_default_group()
        if self._agreement is not None:   # a rank waiting in a served barrier says so
            comm.barrier_watchers.append(self._agreement.waiting_in)
        self._weight_sync = WeightSync(
            model, self.synchronize, self._agreement,
            defers_updates=getattr(self.optimizer, "overlap_step", False) is True)
        # Installs are finished in engine.step() (the optimizer's default): a client script may
        # read the weights anywhere after it (an EMA, a clamp, a copy). One that reads them only
        # in the model's forward may attach: engine.optimizer.attach(engine.module).

    # --- training -----------------------------------------------------------------------------

    def _ranks(self) -> Partition:
        """The default group's ranks, collectives on this engine's device (never the implicit
        current CUDA device)."""
        return Partition.from_group(None, self.device)

    def forward(self, *args, **kwargs):
        if self.dtype != torch.float32:
            # Floating-point inputs follow the weights' dtype; integer inputs (token ids) stay.
            cast = lambda x: (x.to(self.dtype) if isinstance(x, torch.Tensor)
                              and x.is_floating_point() else x)
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """loss.backward() with the 1/gradient_accumulation_steps and fp16 loss scales applied."""
        if self._agreement is not None:
            self._agreement.leave_period()   # ranks waiting at a read or save: this one trains on
        scale = 1.0 / self.config.gradient_accumulation_steps
        if self.loss_scaler is not None:
            scale *= self.loss_scaler.loss_scale
        # In fp32, so that a scaled fp16 loss does not overflow before backward even starts.
        (loss.float() * scale).backward(retain_graph=retain_graph)
        return loss

    def step(self) -> None:
        """Count a micro-batch; at the accumulation boundary, step the optimizer and schedule."""
        if self.is_gradient_accumulation_boundary():
            if self._inside_no_sync and self._ranks().active:
                raise RuntimeError("engine.step() at a gradient accumulation boundary inside "
                                   "no_sync(): the boundary step averages gradients across "
                                   "ranks; leave the no_sync() block before it")
            self._optimizer_step()
            if self._agreement is not None:
                self._agreement.next_period()
        self.micro_steps += 1

    def train(self, mode: bool = True):
        """Also reached by engine.eval(): evaluation mode installs ZenFlow's in-flight host update
        first; under data parallel when every rank evaluates (weight_sync.py)."""
        if not mode:
            self._weight_sync.read("engine.eval()")
        return super().train(mode)

    def _average_gradients(self) -> None:
        """Data parallel: every rank steps with the mean of all ranks' gradients, so weights stay
        identical. A model wrapped in DistributedDataParallel has averaged them in backward
        already, and FSDP2 reduce-scattered them (each rank holds the mean of its rows), and
        averaging again would be wrong, so those are left alone."""
        partition = self._ranks()
        if not partition.active or self._fsdp2 or isinstance(
                self.module, torch.nn.parallel.DistributedDataParallel):
            return
        grads = [p.grad for p in self._params if p.grad is not None]
        for bucket in gradient_buckets(grads, GRADIENT_BUCKET_BYTES):
            flat = partition.sum_(torch.cat([g.reshape(-1) for g in bucket]),
                                  "averaging gradients")
            flat /= partition.world_size
            for g, averaged in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(averaged.view_as(g))

    def _optimizer_step(self) -> None:
        self._average_gradients()
        inv_scale = 1.0
        if self.loss_scaler is not None:
            scale = self.loss_scaler.loss_scale  # the scale these gradients were made with
            overflow = LossScaler.has_overflow(self._params)
            self.loss_scaler.update(overflow)
            if overflow:
                self.skipped_steps += 1
                self._step_applied = False
                log.info("fp16 gradient overflow at step %d: step skipped, loss scale now %g",
                         self.global_steps, self.loss_scaler.loss_scale)
                self._zero_grad()
                self.global_steps += 1
                self.global_samples += self.config.train_batch_size
                return
            inv_scale = 1.0 / scale
        clip = self.config.gradient_clipping
        if self._masters is not None:
            self._masters.load_grads(inv_scale)
            self._global_grad_norm = grad_norm(self._masters.masters)
            if self._engine_clips:
                torch.nn.utils.clip_grad_norm_(self._masters.masters, clip)
            self.optimizer.step()
            self._masters.store_weights()
        else:
            if inv_scale != 1.0:
                for p in self._params:
                    if p.grad is not None:
                        p.grad.mul_(inv_scale)
            self._global_grad_norm = grad_norm(self._params)
            if self._engine_clips:
                torch.nn.utils.clip_grad_norm_(self._params, clip)
            self.optimizer.step()
        self._step_applied = True
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self._zero_grad()
        self.global_steps += 1
        self.global_samples += self.config.train_batch_size

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for p in self._params:
            p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._zero_grad()

    def synchronize(self) -> None:
        """Wait for in-flight host updates and install them (ZenFlow overlap mode). Under data
        parallel every rank must call it."""
        sync = getattr(self.optimizer, "synchronize", None)
        if sync is not None and not self._closed and not getattr(self.optimizer, "closed", False):
            sync()
            self._weight_sync.installed()

    def close(self) -> None:
        """Stop the optimizer's worker process, if it has one, and remove the engine's hooks."""
        self._closed = True
        if self._agreement is not None:
            self._agreement.leave_period()
            if self._agreement.waiting_in in comm.barrier_watchers:
                comm.barrier_watchers.remove(self._agreement.waiting_in)
        self._weight_sync.remove()
        close = getattr(self.optimizer, "close", None)
        if close is not None:
            close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- checkpoints ----------------------------------------------------------------------------

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: Any = None,
                        client_state: dict | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> str:
        """Write `<save_dir>/<tag>/` atomically; every rank must call it.

        The tag defaults to `global_step<N>`; any other is used as str(tag), as in DeepSpeed
        (whose tutorial passes a loss value). model_states.pt holds the synchronized weights
        (ZenFlow's in-flight update installed), and the run that saves continues exactly as if
        it had not. Returns the checkpoint's path (truthy, where DeepSpeed returns True).
        """
        self._require_every_rank("save_checkpoint")
        tag = self._common_tag(str(tag) if tag is not None else f"global_step{self.global_steps}")
        if self._micro_steps_into_accumulation():
            log.warning("saving a checkpoint in the middle of gradient accumulation: the "
                        "gradients accumulated so far are not saved")
        module_state = pending = optimizer_state = {}
        if not self._fsdp2:   # FSDP2: in checkpoint_dcp.py, through torch.distributed.checkpoint
            module_state, pending, optimizer_state = synchronized_state(
                self.module, self.optimizer, self._weight_sync)
        excluded = sorted(frozen_parameter_names(self.module)) if exclude_frozen_parameters else []
        engine_state = {
            "global_steps": self.global_steps, "micro_steps": self.micro_steps,
            "global_samples": self.global_samples, "skipped_steps": self.skipped_steps,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
            "fp32_masters": self._masters.state_dict() if self._masters else None,
            "rng": _rng_state(), "client_state": client_state or {},
            "config": self._raw_config,
            "optimizer_class": type(self.optimizer).__name__,
            # The weights training runs on until the in-flight update lands: restored with the
            # optimizer state for an exact resume. Frozen parameters left out, if asked.
            "pending_weights": pending, "excluded_frozen": excluded,
        }
        partition = self._ranks()
        meta = {"global_steps": self.global_steps, "world_size": partition.world_size,
                "optimizer_class": type(self.optimizer).__name__, "dtype": str(self.dtype)}
        if self._fsdp2:
            return str(save_fsdp2_checkpoint(self, save_dir, tag, engine_state, meta,
                                             save_latest, excluded))
        module_state = {k: v for k, v in module_state.items() if k not in set(excluded)}
        objects = {"model_states.pt": module_state, "engine_states.pt": engine_state}
        if not partition.active:
            objects["optimizer_states.pt"] = optimizer_state
            return str(write_checkpoint(save_dir, tag, objects, meta, update_latest=save_latest))
        # Data parallel: each rank writes its own share of the host state and its RNG; rank 0
        # commits them with the common files (zenflow/engine/checkpoint_shards.py).
        return str(write_sharded_checkpoint(
            partition, save_dir, tag, objects, f"rank{partition.rank}_states.pt",
            {"optimizer": optimizer_state, "rng": engine_state["rng"]}, meta,
            update_latest=save_latest))

    def _require_every_rank(self, method: str) -> None:
        """Under data parallel, raise before a collective that not every rank calls (it would
        hang): the ranks meet in the store first (rank_agreement.py)."""
        if self._agreement is None:
            return
        missing, why = self._agreement.missing_from(method, comm.DEFAULT_TIMEOUT)
        if missing:
            how = {"left": "went on training without calling it",
                   "exited": "ended without calling it (the process exited)",
                   "waiting": "wait in another collective call (a barrier, or another save)",
                   "late": f"did not call it within {comm.DEFAULT_TIMEOUT.total_seconds():g} s",
                   }[why]
            raise RuntimeError(
                f"{method} is collective: every rank must call it (each rank writes its share of "
                f"the optimizer state, and installing the in-flight update is collective), but "
                f"rank(s) {', '.join(map(str, missing))} {how}. Call {method} on every rank, "
                f"not only on rank 0 (rank 0 alone writes the common files)")

    def _common_tag(self, tag: str) -> str:
        """Rank 0's tag, as DeepSpeed uses: ranks whose tags differ (a tag made from each rank's
        own loss, say) are warned about, ignored or refused as checkpoint.tag_validation says."""
        partition = self._ranks()
        if not partition.active:
            return check_tag(tag)
        tags = partition.gather_objects(tag, "comparing the checkpoint tags")
        if len(set(tags)) > 1:
            mode = self.config.checkpoint.tag_validation
            message = (f"save_checkpoint: the ranks passed different tags ({', '.join(tags[:4])}"
                       f"{', ...' if len(tags) > 4 else ''}); ")
            if mode == "FAIL":
                raise ValueError(message + "checkpoint.tag_validation is \"Fail\"; pass the same "
                                 "tag on every rank")
            if mode == "WARN":
                log.warning(message + "saving under rank 0's tag %r (checkpoint.tag_validation "
                            "\"Warn\"; \"Ignore\" silences this)", tags[0])
        return check_tag(tags[0])

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: Any = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Callable | None = None
                        ) -> tuple[str | None, dict | None]:
        """Verify and restore a checkpoint (DeepSpeed's arguments, in its order). Returns
        (path, client_state); (None, None) with a warning when `load_dir` has no `latest`
        checkpoint and no tag is given, as DeepSpeed does. A named tag that is missing raises.
        `custom_load_fn(src=state_dict, dst=module)` replaces module.load_state_dict."""
        if tag is None and not (Path(load_dir) / "latest").is_file():
            log.warning("load_checkpoint: %r has no 'latest' file, so there is no checkpoint to "
                        "load; nothing was loaded (pass tag= to load a specific one)",
                        str(load_dir))
            return None, None
        tag = None if tag is None else str(tag)
        if self._fsdp2:
            return self._load_fsdp2_checkpoint(load_dir, tag, load_module_strict,
                                               load_optimizer_states, load_lr_scheduler_states,
                                               load_module_only)
        partition = self._ranks()
        mine = f"rank{partition.rank}_states.pt" if partition.active else "optimizer_states.pt"
        path, manifest, objs = read_checkpoint(
            load_dir, tag, ["model_states.pt", "engine_states.pt"], map_location="cpu")
        saved_world = manifest["meta"].get("world_size", 1)
        if not load_module_only and saved_world != partition.world_size:
            raise ValueError(f"checkpoint {str(path)!r} was written by {saved_world} rank(s) and "
                             f"this run has {partition.world_size}: each rank's optimizer holds "
                             "only its share of the host state, so resume on the same number of "
                             "ranks (or pass load_module_only=True to load only the weights)")
        if mine not in manifest["files"] and not load_module_only:
            raise ValueError(f"checkpoint {str(path)!r} has no {mine}")
        state = objs["engine_states.pt"]
        # With load_module_only no optimizer share is read: the weights are whole in every
        # checkpoint, so any world size loads them.
        if not load_module_only and partition.active:
            # read_checkpoint verified this rank's file with the others
            share = load_object(path / mine, map_location="cpu")
            objs["optimizer_states.pt"] = share["optimizer"]
            state = dict(state, rng=share["rng"])
        elif not load_module_only:
            objs["optimizer_states.pt"] = load_object(path / mine, map_location="cpu")
        if state["optimizer_class"] != type(self.optimizer).__name__ and not load_module_only:
            raise ValueError(f"checkpoint {str(path)!r} was written with "
                             f"{state['optimizer_class']}, this engine runs "
                             f"{type(self.optimizer).__name__}; pass load_module_only=True to "
                             f"load only the weights")
        # All or nothing: everything is checked against the model and optimizer first.
        if custom_load_fn is None:
            self._check_module_state(objs["model_states.pt"], state, load_module_strict)
        check_optimizer = getattr(self.optimizer, "check_state_dict", None)
        if not load_module_only and load_optimizer_states and check_optimizer is not None:
            check_optimizer(objs["optimizer_states.pt"])
        self._load_module_state(objs["model_states.pt"], state, load_module_strict, custom_load_fn,
                                with_pending=not load_module_only and load_optimizer_states)
        self._weight_sync.loaded()
        if not load_module_only:
            if load_optimizer_states:
                self.optimizer.load_state_dict(objs["optimizer_states.pt"])
                if self._masters is not None and state["fp32_masters"] is not None:
                    self._masters.load_state_dict(state["fp32_masters"])
            self._load_engine_state(state, load_lr_scheduler_states)
        return str(path), state["client_state"]

    def _load_engine_state(self, state: dict, load_lr_scheduler_states: bool) -> None:
        if load_lr_scheduler_states and self.lr_scheduler is not None \
                and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.loss_scaler is not None and state["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        for key in ("global_steps", "micro_steps", "global_samples", "skipped_steps"):
            setattr(self, key, state[key])
        if state.get("rng") is not None:
            _set_rng_state(state["rng"])

    def _load_fsdp2_checkpoint(self, load_dir, tag: str | None, strict: bool,
                               load_optimizer_states: bool, load_lr_scheduler_states: bool,
                               load_module_only: bool) -> tuple[str, dict]:
        """An FSDP2 engine's checkpoint (checkpoint_dcp.py), on any number of ranks: DCP reads
        each rank's rows; a rank the saving run did not have keeps its RNG as it is."""
        partition = self._ranks()
        path, manifest, objs = read_checkpoint(load_dir, tag, ["engine_states.pt"],
                                               map_location="cpu")
        if not manifest["meta"].get("fsdp2"):
            raise ValueError(f"checkpoint {str(path)!r} was not written by an FSDP2-sharded "
                             "engine (it holds whole weights, not torch.distributed.checkpoint "
                             "shards); load it into an engine whose model is not sharded")
        state = objs["engine_states.pt"]
        if state["optimizer_class"] != type(self.optimizer).__name__ and not load_module_only:
            raise ValueError(f"checkpoint {str(path)!r} was written with "
                             f"{state['optimizer_class']}, this engine runs "
                             f"{type(self.optimizer).__name__}; pass load_module_only=True to "
                             f"load only the weights")
        load_optimizer = load_optimizer_states and not load_module_only
        load_fsdp2_checkpoint(self, path, load_optimizer=load_optimizer, strict=strict)
        self._weight_sync.loaded()
        if not load_module_only:
            share = f"rank{partition.rank}_states.pt"
            rng = (load_object(path / share, map_location="cpu")["rng"]
                   if share in manifest["files"] else None)
            if rng is None:
                log.info("load_checkpoint: the checkpoint has no RNG state for rank %d (it was "
                         "saved on %s rank(s)); this rank's RNG is left as it is",
                         partition.rank, manifest["meta"].get("world_size"))
            self._load_engine_state(dict(state, rng=rng), load_lr_scheduler_states)
        return str(path), state["client_state"]


def _rng_state() -> dict:
    """Every RNG's state as tensors and plain data, so that a weights-only load reads it."""
    kind, key, pos, has_gauss, cached = np.random.get_state()
    version, mt, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "numpy": {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": pos,
                      "has_gauss": has_gauss, "cached_gaussian": cached},
            "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64),
                       "gauss_next": gauss_next}}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"].tolist()), p["gauss_next"]))


def initialize(model: torch.nn.Module = None, model_parameters: Iterable | None = None,
               config: str | os.PathLike | dict | None = None, training_data=None,
               lr_scheduler: Any = None, optimizer: Any = None,
               collate_fn: Callable | None = None, config_params: dict | None = None,
               args: Any = None, dist_init_required: bool | None = None, mpu: Any = None,
               mesh_param: Any = None
               ) -> tuple[ZenFlowEngine, torch.optim.Optimizer, torch.utils.data.DataLoader | None,
                          Any]:
    """Like deepspeed.initialize: returns (engine, optimizer, dataloader, lr_scheduler).

    The dataloader is None without `training_data`; the scheduler is the config's (a torch
    LRScheduler), the one passed as `lr_scheduler` (anything with step(), hence Any), or None.

    The config comes from exactly one of `config` (a JSON path or a dict), `config_params`
    (DeepSpeed's older name) or `args.deepspeed_config`. It is validated whole before anything
    is built; problems raise ConfigError naming each key path. Launched with several ranks
    ($WORLD_SIZE > 1) and no process group yet, the default group is initialized here, as
    DeepSpeed does (`dist_init_required=False` refuses that instead of training alone).
    """
    if model is None:
        raise ValueError("initialize: model is required")
    for name, value in (("mpu", mpu), ("mesh_param", mesh_param)):
        if value is not None:
            raise ValueError(f"initialize: {name}={value!r} asks for model/tensor parallelism, "
                             "which zenflow does not support (data parallel only); pass "
                             f"{name}=None")
    if dist_init_required is not None and not isinstance(dist_init_required, bool):
        raise TypeError(f"initialize: dist_init_required must be True, False or None, got "
                        f"{dist_init_required!r}")
    raw = load_config_dict(config_from_arguments(config, config_params, args))
    if comm.env_world_size() > 1 and not comm.is_initialized():
        if dist_init_required is False:
            raise RuntimeError(f"initialize: WORLD_SIZE={comm.env_world_size()} but no process "
                               "group exists and dist_init_required=False; initialize "
                               "torch.distributed first, or let initialize do it")
        comm.init_distributed(dist_backend=raw.get("dist_backend"))
    cfg = parse_config(raw)
    engine = ZenFlowEngine(model, cfg, raw, model_parameters=model_parameters,
                           optimizer=optimizer, lr_scheduler=lr_scheduler,
                           training_data=training_data, collate_fn=collate_fn)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
