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
zenflow/engine/deepspeed_api.py, save_checkpoint and load_checkpoint in
zenflow/engine/engine_checkpoints.py.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

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
from zenflow.engine.deepspeed_api import DeepSpeedEngineAPI, grad_norm
from zenflow.engine.engine_checkpoints import EngineCheckpoints
from zenflow.engine.fp32_masters import FP32Masters, trainable_param_groups
from zenflow.engine.fsdp import check_sharding
from zenflow.engine.gradient_averaging import average_gradients
from zenflow.engine.loss_scaler import LossScaler
from zenflow.engine.rank_agreement import StepAgreement
from zenflow.engine.weight_sync import WeightSync

log = logging.getLogger("zenflow.engine")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ZenFlowEngine(EngineCheckpoints, DeepSpeedEngineAPI, EngineConstruction, torch.nn.Module):
    """Wraps a model with its optimizer, schedule, precision and checkpointing (the checkpoints:
    zenflow/engine/engine_checkpoints.py)."""

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
        average_gradients(partition, [p.grad for p in self._params if p.grad is not None])

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
