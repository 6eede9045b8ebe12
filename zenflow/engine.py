"""A DeepSpeed-style training engine driven by the DeepSpeed JSON config.

    engine, optimizer, dataloader, scheduler = zenflow.engine.initialize(
        model=model, config="ds_config.json", training_data=dataset)
    for batch in dataloader:
        loss = engine(batch)
        engine.backward(loss)   # scaled by 1/gradient_accumulation_steps (and the fp16 scale)
        engine.step()           # steps the optimizer only at the accumulation boundary

What runs is decided by the config: a `zero_optimization.zenflow` block gives ZenFlowAdamW,
CPU optimizer offload without it gives OffloadAdamW (the ZeRO-Offload baseline), neither gives
plain torch.optim.AdamW on the device. The model's weights are never rewritten or re-laid-out;
with bf16/fp16 they are cast once, and the optimizer keeps fp32 master weights.
"""
from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import numpy as np
import torch

from zenflow.checkpoint import check_tag, load_object, read_checkpoint, write_checkpoint
from zenflow.distributed import Partition
from zenflow.config import (ConfigError, ZenFlowConfig, load_config_dict, optimizer_kwargs,
                            parse_config, resolved_settings, scheduler_kwargs)
from zenflow.loss_scaler import LossScaler
from zenflow.schedulers import build_scheduler

log = logging.getLogger("zenflow.engine")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Keys of the zenflow block that only some versions of ZenFlowAdamW accept; the others are
# passed through unconditionally so that an unsupported value fails loudly in the optimizer.


def _core_optimizers():
    """The package's optimizers (the one place that names them)."""
    from zenflow.offload import OffloadAdamW
    from zenflow.optimizer import ZenFlowAdamW
    return ZenFlowAdamW, OffloadAdamW


class _FP32Masters:
    """fp32 master copies for plain AdamW on bf16/fp16 weights (our optimizers have their own).

    The torch optimizer works on the masters; after each step their values are copied back into
    the low-precision model weights.
    """

    def __init__(self, model_params: list[torch.Tensor]):
        self.model_params = model_params
        self.masters = [p.detach().clone().float().requires_grad_(True) for p in model_params]

    def load_grads(self, inv_scale: float) -> None:
        for p, m in zip(self.model_params, self.masters):
            if p.grad is None:
                m.grad = None
            else:
                m.grad = p.grad.float().mul_(inv_scale) if inv_scale != 1.0 else p.grad.float()

    @torch.no_grad()
    def store_weights(self) -> None:
        for p, m in zip(self.model_params, self.masters):
            p.copy_(m)

    def state_dict(self) -> list[torch.Tensor]:
        return [m.detach().clone() for m in self.masters]

    @torch.no_grad()
    def load_state_dict(self, masters: list[torch.Tensor]) -> None:
        for m, saved in zip(self.masters, masters):
            m.copy_(saved)
        self.store_weights()


def _param_groups(params) -> tuple[list, list[torch.Tensor]]:
    """Normalise model_parameters (tensors or group dicts) to groups of trainable tensors."""
    params = list(params)
    if params and isinstance(params[0], dict):
        groups = [dict(g, params=[p for p in g["params"] if p.requires_grad]) for g in params]
    else:
        groups = [{"params": [p for p in params if p.requires_grad]}]
    groups = [g for g in groups if g["params"]]
    flat = [p for g in groups for p in g["params"]]
    if not flat:
        raise ValueError("model_parameters: no parameter requires grad, nothing to train")
    return groups, flat


class ZenFlowEngine(torch.nn.Module):
    """Wraps a model with its optimizer, schedule, precision and checkpointing."""

    def __init__(self, model: torch.nn.Module, config: ZenFlowConfig, raw_config: dict, *,
                 model_parameters=None, optimizer=None, lr_scheduler=None, training_data=None,
                 collate_fn=None):
        super().__init__()
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

        self.global_steps = 0      # optimizer steps attempted (incl. fp16-overflow skips)
        self.micro_steps = 0       # engine.step() calls (micro-batches)
        self.global_samples = 0
        self.skipped_steps = 0     # steps skipped because the fp16 gradients overflowed
        self._step_applied = False

        self.training_dataloader = (self._make_dataloader(training_data, collate_fn)
                                    if training_data is not None else None)
        groups, self._params = _param_groups(
            model_parameters if model_parameters is not None else model.parameters())
        self._masters: Optional[_FP32Masters] = None
        self.optimizer = self._make_optimizer(optimizer, groups)
        self.lr_scheduler = self._make_scheduler(lr_scheduler)
        # Our optimizers clip inside step() (max_grad_norm); any other is clipped here.
        self._engine_clips = bool(config.gradient_clipping) and not isinstance(
            self.optimizer, _core_optimizers())
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

    # --- construction -------------------------------------------------------------------------

    def _make_dataloader(self, data, collate_fn):
        import torch.distributed as dist

        if isinstance(data, torch.utils.data.DataLoader):
            return data
        sampler = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            sampler = torch.utils.data.DistributedSampler(data)
        return torch.utils.data.DataLoader(
            data, batch_size=self.config.train_micro_batch_size_per_gpu, sampler=sampler,
            shuffle=sampler is None, collate_fn=collate_fn)

    def _make_optimizer(self, client_optimizer, groups):
        cfg = self.config
        if client_optimizer is not None:
            if cfg.optimizer is not None:
                raise ConfigError(["optimizer is given both in the config and to "
                                   "initialize(optimizer=...); give one of them"])
            opt = (client_optimizer if isinstance(client_optimizer, torch.optim.Optimizer)
                   else client_optimizer(groups))
            zenflow_cls, offload_cls = _core_optimizers()
            expected = {"zenflow": zenflow_cls, "offload": offload_cls}.get(cfg.optimizer_kind)
            if expected is not None and not isinstance(opt, expected):
                where = ("zero_optimization.zenflow" if cfg.optimizer_kind == "zenflow"
                         else "zero_optimization.offload_optimizer.device")
                raise ConfigError([f"{where} asks for {expected.__name__}, but initialize got a "
                                   f"{type(opt).__name__}; drop optimizer= and put an optimizer "
                                   f"block in the config, or pass a {expected.__name__}"])
            if cfg.gradient_clipping and isinstance(opt, _core_optimizers()):
                log.warning("gradient_clipping is ignored for a %s passed to initialize: its own "
                            "max_grad_norm (%r) clips", type(opt).__name__,
                            getattr(opt, "max_grad_norm", None))
            return opt
        if cfg.optimizer is None:
            raise ConfigError(["optimizer is missing: add an optimizer block "
                               "({\"type\": \"AdamW\", \"params\": {...}}) to the config or pass "
                               "optimizer= to initialize"])
        kwargs = optimizer_kwargs(cfg)
        if cfg.optimizer_kind == "zenflow":
            zenflow_cls, _ = _core_optimizers()
            if kwargs["steps_per_epoch"] is None and self.training_dataloader is not None:
                kwargs["steps_per_epoch"] = max(
                    1, len(self.training_dataloader) // cfg.gradient_accumulation_steps)
            return zenflow_cls(groups, **kwargs)
        if cfg.optimizer_kind == "offload":
            _, offload_cls = _core_optimizers()
            return offload_cls(groups, **kwargs)
        if self.dtype != torch.float32:
            self._masters = _FP32Masters(self._params)
            index = {id(p): i for i, p in enumerate(self._params)}
            groups = [dict(g, params=[self._masters.masters[index[id(p)]] for p in g["params"]])
                      for g in groups]
        return torch.optim.AdamW(groups, **kwargs)

    def _make_scheduler(self, client_scheduler):
        spec = scheduler_kwargs(self.config)
        if client_scheduler is not None:
            if spec is not None:
                raise ConfigError(["scheduler is given both in the config and to "
                                   "initialize(lr_scheduler=...); give one of them"])
            return (client_scheduler if not callable(client_scheduler)
                    or hasattr(client_scheduler, "step") else client_scheduler(self.optimizer))
        if spec is None:
            return None
        name, params = spec
        return build_scheduler(name, self.optimizer, params)

    # --- DeepSpeed-style accessors ------------------------------------------------------------

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next engine.step() will step the optimizer."""
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step changed the weights (False after an fp16 overflow)."""
        return self._step_applied

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale if self.loss_scaler else 1.0

    # --- training -----------------------------------------------------------------------------

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
        scale = 1.0 / self.config.gradient_accumulation_steps
        if self.loss_scaler is not None:
            scale *= self.loss_scaler.loss_scale
        # In fp32, so that a scaled fp16 loss does not overflow before backward even starts.
        (loss.float() * scale).backward(retain_graph=retain_graph)
        return loss

    def step(self) -> None:
        """Count a micro-batch; at the accumulation boundary, step the optimizer and schedule."""
        if self.is_gradient_accumulation_boundary():
            self._optimizer_step()
        self.micro_steps += 1

    def _average_gradients(self) -> None:
        """Data parallel: every rank steps with the mean of all ranks' gradients, so weights stay
        identical. A model wrapped in DistributedDataParallel has averaged them in backward
        already, and averaging again would be wrong, so it is left alone."""
        partition = Partition.from_group()
        if not partition.active or isinstance(self.module,
                                              torch.nn.parallel.DistributedDataParallel):
            return
        grads = [p.grad for p in self._params if p.grad is not None]
        for dtype in {g.dtype for g in grads}:
            same = [g for g in grads if g.dtype == dtype]
            flat = partition.sum_(torch.cat([g.reshape(-1) for g in same]), "averaging gradients")
            flat /= partition.world_size
            for g, averaged in zip(same, flat.split([g.numel() for g in same])):
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
            if self._engine_clips:
                torch.nn.utils.clip_grad_norm_(self._masters.masters, clip)
            self.optimizer.step()
            self._masters.store_weights()
        else:
            if inv_scale != 1.0:
                for p in self._params:
                    if p.grad is not None:
                        p.grad.mul_(inv_scale)
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
        """Wait for in-flight host updates and install them (ZenFlow overlap mode)."""
        sync = getattr(self.optimizer, "synchronize", None)
        if sync is not None:
            sync()

    def close(self) -> None:
        """Stop the optimizer's worker process, if it has one."""
        close = getattr(self.optimizer, "close", None)
        if close is not None:
            close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- checkpoints ----------------------------------------------------------------------------

    def save_checkpoint(self, save_dir: Union[str, os.PathLike], tag: Optional[str] = None,
                        client_state: Optional[dict] = None, save_latest: bool = True) -> str:
        """Write `<save_dir>/<tag>/` atomically (tag defaults to `global_step<N>`)."""
        tag = check_tag(tag if tag is not None else f"global_step{self.global_steps}")
        if self.micro_steps % self.config.gradient_accumulation_steps != 0:
            log.warning("saving a checkpoint in the middle of gradient accumulation: the "
                        "gradients accumulated so far are not saved")
        engine_state = {
            "global_steps": self.global_steps, "micro_steps": self.micro_steps,
            "global_samples": self.global_samples, "skipped_steps": self.skipped_steps,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
            "fp32_masters": self._masters.state_dict() if self._masters else None,
            "rng": _rng_state(), "client_state": client_state or {},
            "config": self._raw_config,
            "optimizer_class": type(self.optimizer).__name__,
        }
        partition = Partition.from_group()
        meta = {"global_steps": self.global_steps, "world_size": partition.world_size,
                "optimizer_class": type(self.optimizer).__name__, "dtype": str(self.dtype)}
        objects = {"model_states.pt": self.module.state_dict(), "engine_states.pt": engine_state}
        if not partition.active:
            objects["optimizer_states.pt"] = self.optimizer.state_dict()
            return str(write_checkpoint(save_dir, tag, objects, meta, update_latest=save_latest))
        # Data parallel: each rank's optimizer holds its own share of the host state, and its own
        # RNG. Rank 0 collects them and writes one atomic checkpoint with a file per rank.
        mine = {"optimizer": self.optimizer.state_dict(), "rng": engine_state["rng"]}
        shares = partition.gather_objects(mine, "collecting optimizer shares for the checkpoint")
        for rank, share in enumerate(shares):
            objects[f"rank{rank}_states.pt"] = share
        if partition.rank == 0:
            write_checkpoint(save_dir, tag, objects, meta, update_latest=save_latest)
        partition.barrier("waiting for rank 0 to write the checkpoint")
        return str(Path(save_dir) / tag)

    def load_checkpoint(self, load_dir: Union[str, os.PathLike], tag: Optional[str] = None,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str, dict]:
        """Verify and restore a checkpoint. Returns (path, client_state) like DeepSpeed."""
        partition = Partition.from_group()
        mine = f"rank{partition.rank}_states.pt" if partition.active else "optimizer_states.pt"
        path, manifest, objs = read_checkpoint(
            load_dir, tag, ["model_states.pt", "engine_states.pt"], map_location="cpu")
        saved_world = manifest["meta"].get("world_size", 1)
        if saved_world != partition.world_size:
            raise ValueError(f"checkpoint {str(path)!r} was written by {saved_world} rank(s) and "
                             f"this run has {partition.world_size}: each rank's optimizer holds "
                             "only its share of the host state, so resume on the same number of "
                             "ranks (or pass load_module_only=True to load only the weights)")
        if mine not in manifest["files"]:
            raise ValueError(f"checkpoint {str(path)!r} has no {mine}")
        # read_checkpoint verified every file of the manifest, this one included.
        share = load_object(path / mine, map_location="cpu")
        state = objs["engine_states.pt"]
        if partition.active:
            objs["optimizer_states.pt"] = share["optimizer"]
            state = dict(state, rng=share["rng"])
        else:
            objs["optimizer_states.pt"] = share
        if state["optimizer_class"] != type(self.optimizer).__name__ and not load_module_only:
            raise ValueError(f"checkpoint {str(path)!r} was written with "
                             f"{state['optimizer_class']}, this engine runs "
                             f"{type(self.optimizer).__name__}; pass load_module_only=True to "
                             f"load only the weights")
        self.module.load_state_dict(objs["model_states.pt"])
        if not load_module_only:
            if load_optimizer_states:
                self.optimizer.load_state_dict(objs["optimizer_states.pt"])
                if self._masters is not None and state["fp32_masters"] is not None:
                    self._masters.load_state_dict(state["fp32_masters"])
            if load_lr_scheduler_states and self.lr_scheduler is not None \
                    and state["lr_scheduler"] is not None:
                self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            if self.loss_scaler is not None and state["loss_scaler"] is not None:
                self.loss_scaler.load_state_dict(state["loss_scaler"])
            for key in ("global_steps", "micro_steps", "global_samples", "skipped_steps"):
                setattr(self, key, state[key])
            _set_rng_state(state["rng"])
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


def initialize(model: torch.nn.Module = None, model_parameters: Optional[Iterable] = None,
               config: Union[str, os.PathLike, dict, None] = None, training_data=None,
               lr_scheduler: Any = None, optimizer: Any = None,
               collate_fn: Optional[Callable] = None, config_params: Optional[dict] = None,
               args: Any = None):
    """Like deepspeed.initialize: returns (engine, optimizer, dataloader, lr_scheduler).

    `config` is a path to the JSON file or a dict (`config_params` is DeepSpeed's older name;
    `args.deepspeed_config` is read as DeepSpeed does). The whole config is validated before
    anything is built; problems raise ConfigError naming each key path.
    """
    if model is None:
        raise ValueError("initialize: model is required")
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
    if config is None:
        raise ValueError("initialize: config is required (a path to the JSON file or a dict)")
    raw = load_config_dict(config)
    cfg = parse_config(raw)
    engine = ZenFlowEngine(model, cfg, raw, model_parameters=model_parameters,
                           optimizer=optimizer, lr_scheduler=lr_scheduler,
                           training_data=training_data, collate_fn=collate_fn)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
