"""How the engine builds its data loader, optimizer and schedule from the config and the
arguments of `initialize` (a mixin of zenflow.engine.engine.ZenFlowEngine)."""
from __future__ import annotations

import logging

import torch

from zenflow.config.deepspeed_json import ConfigError, ZenFlowConfig, scheduler_kwargs
from zenflow.engine.fp32_masters import FP32Masters
from zenflow.engine.schedulers import build_scheduler

log = logging.getLogger("zenflow.engine")


def core_optimizers():
    """The package's optimizers (the one place that names them)."""
    from zenflow.optim.offload import OffloadAdamW
    from zenflow.optim.optimizer import ZenFlowAdamW
    return ZenFlowAdamW, OffloadAdamW


def optimizer_for_config(cfg: ZenFlowConfig, params, *, hyperparameters=None,
                         steps_per_epoch: int | None = None) -> torch.optim.Optimizer:
    """The optimizer a validated config asks for, over `params` (tensors or param groups):
    ZenFlowAdamW with the config's ZenFlowSettings when zero_optimization.zenflow is present,
    OffloadAdamW when only offload_optimizer.device is "cpu", torch.optim.AdamW otherwise (which
    its caller clips). `hyperparameters` replaces the optimizer block's AdamW numbers;
    `steps_per_epoch` fills in the zenflow block's when it has none (the engine's dataloader)."""
    adamw = (hyperparameters or cfg.hyperparameters()).model_dump()
    zenflow_cls, offload_cls = core_optimizers()
    if cfg.optimizer_kind == "zenflow":
        settings = cfg.zenflow_settings()
        if settings.steps_per_epoch is None and steps_per_epoch is not None:
            settings = settings.replace(steps_per_epoch=steps_per_epoch)
        return zenflow_cls(params, **adamw, **settings.model_dump())
    if cfg.optimizer_kind == "offload":
        return offload_cls(params, **adamw, max_grad_norm=cfg.max_grad_norm)
    return torch.optim.AdamW(params, **adamw)


class EngineConstruction:
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
            zenflow_cls, offload_cls = core_optimizers()
            expected = {"zenflow": zenflow_cls, "offload": offload_cls}.get(cfg.optimizer_kind)
            if expected is not None and not isinstance(opt, expected):
                where = ("zero_optimization.zenflow" if cfg.optimizer_kind == "zenflow"
                         else "zero_optimization.offload_optimizer.device")
                raise ConfigError([f"{where} asks for {expected.__name__}, but initialize got a "
                                   f"{type(opt).__name__}; drop optimizer= and put an optimizer "
                                   f"block in the config, or pass a {expected.__name__}"])
            if cfg.gradient_clipping and isinstance(opt, core_optimizers()):
                log.warning("gradient_clipping is ignored for a %s passed to initialize: its own "
                            "max_grad_norm (%r) clips", type(opt).__name__,
                            opt.settings.max_grad_norm)
            return opt
        if cfg.optimizer is None:
            raise ConfigError(["optimizer is missing: add an optimizer block "
                               "({\"type\": \"AdamW\", \"params\": {...}}) to the config or pass "
                               "optimizer= to initialize"])
        steps_per_epoch = None
        if cfg.zenflow is not None and cfg.zenflow.steps_per_epoch is None \
                and self.training_dataloader is not None:
            steps_per_epoch = max(1, len(self.training_dataloader)
                                  // cfg.gradient_accumulation_steps)
        if cfg.optimizer_kind == "adamw" and self.dtype != torch.float32:
            # Plain AdamW steps fp32 copies of the low-precision weights.
            self._masters = FP32Masters(self._params)
            index = {id(p): i for i, p in enumerate(self._params)}
            groups = [dict(g, params=[self._masters.masters[index[id(p)]] for p in g["params"]])
                      for g in groups]
        return optimizer_for_config(cfg, groups, steps_per_epoch=steps_per_epoch)

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
