"""The DeepSpeed engine's accessors and small methods that client scripts call, as a mixin of
`zenflow.engine.engine.ZenFlowEngine` (which provides config, optimizer, module and the counters)."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import torch

from zenflow.compat.deepspeed import comm
from zenflow.distributed import is_sharded


def frozen_parameter_names(module: torch.nn.Module) -> set[str]:
    return {name for name, p in module.named_parameters() if not p.requires_grad}


def grad_norm(params: list[torch.Tensor]) -> torch.Tensor | None:
    """The global L2 norm of the gradients, left on the device (read only when asked for)."""
    grads = [p.grad for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else None


class DeepSpeedEngineAPI:
    # --- ranks (read from torch.distributed, or 0 of 1 in a lone process) ---------------------

    @property
    def local_rank(self) -> int:
        return comm.get_local_rank()

    @property
    def global_rank(self) -> int:
        return comm.get_rank()

    @property
    def world_size(self) -> int:
        return comm.get_world_size()

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks: all of them (no model or pipeline parallelism here)."""
        return comm.get_world_size()

    # --- config queries ----------------------------------------------------------------------

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    bf16_enabled = bfloat16_enabled

    def zero_optimization(self) -> bool:
        return self.config.zero_optimization.stage > 0

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_mom(self) -> list:
        """Adam's betas per param group (DeepSpeed returns them for Adam-type optimizers)."""
        return [g.get("betas", g.get("momentum")) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """L2 norm of the (unscaled, averaged, not yet clipped) gradients of the last optimizer
        step; None before the first one."""
        norm = self._global_grad_norm
        return None if norm is None else float(norm)

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale if self.loss_scaler else 1.0

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step changed the weights (False after an fp16 overflow)."""
        return self._step_applied

    # --- accumulation control ----------------------------------------------------------------

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next engine.step() will step the optimizer."""
        if self._boundary_override is not None:
            return self._boundary_override
        return self._micro_steps_into_accumulation() + 1 == self.config.gradient_accumulation_steps

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary decision for the following step() calls (DeepSpeed's pipeline
        engine does this); pass None to return to counting micro-batches."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary: is_boundary must be True, False "
                            f"or None, got {is_boundary!r}")
        self._boundary_override = is_boundary

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing gradient_accumulation_steps; the micro-batch
        size stays (as in DeepSpeed)."""
        per_step = self.config.train_micro_batch_size_per_gpu * self.dp_world_size
        if isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int) \
                or train_batch_size < 1 or train_batch_size % per_step:
            raise ValueError(f"set_train_batch_size: train_batch_size must be a positive multiple "
                             f"of train_micro_batch_size_per_gpu * world size = {per_step}, got "
                             f"{train_batch_size!r}")
        if self._micro_steps_into_accumulation():
            raise RuntimeError("set_train_batch_size: called in the middle of gradient "
                               "accumulation; call it right after a boundary step()")
        self.config.gradient_accumulation_steps = train_batch_size // per_step
        self.config.train_batch_size = train_batch_size
        # Count accumulation from here (micro_steps stays the total, as DeepSpeed reports it).
        self._accumulation_start = self.micro_steps

    def _micro_steps_into_accumulation(self) -> int:
        return (self.micro_steps - self._accumulation_start) % \
            self.config.gradient_accumulation_steps

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without averaging them across ranks. The engine averages only at
        the accumulation boundary, so inside this block the boundary step() is refused (it would
        average); backward() and non-boundary step() calls are fine."""
        previous = self._inside_no_sync
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = previous

    # --- lifecycle and export ----------------------------------------------------------------

    def destroy(self) -> None:
        """Release the optimizer's worker and the engine's hooks (DeepSpeed's name for close)."""
        self.close()

    def save_16bit_model(self, save_dir: str | os.PathLike,
                         save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the synchronized weights in the training dtype (bf16/fp16, fp32 when neither is
        enabled) as a torch state dict. Every rank must call it (installing the pending update is
        collective under data parallel); rank 0 writes."""
        if not isinstance(save_filename, str) or not save_filename or "/" in save_filename:
            raise ValueError(f"save_16bit_model: save_filename must be a plain file name, got "
                             f"{save_filename!r}")
        self._require_every_rank("save_16bit_model")
        self.synchronize()
        state = self._checkpoint_module_state(self.module.state_dict(), exclude_frozen_parameters)
        # An FSDP2 rank holds some rows of each weight: each is gathered whole, one at a time (a
        # collective every rank joins), and kept, in host memory, by rank 0 alone.
        whole = {}
        for k, v in state.items():
            t = v.full_tensor() if is_sharded(v) else v
            if self.global_rank == 0:
                whole[k] = t.detach().cpu()
        if self.global_rank == 0:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            tmp = Path(save_dir) / f".{save_filename}.tmp"
            torch.save(whole, tmp)
            os.replace(tmp, Path(save_dir) / save_filename)
        return True

    def _checkpoint_module_state(self, state: dict, exclude_frozen_parameters: bool) -> dict:
        if not exclude_frozen_parameters:
            return state
        frozen = frozen_parameter_names(self.module)
        return {k: v for k, v in state.items() if k not in frozen}

    def _check_module_state(self, module_state: dict, engine_state: dict, strict: bool) -> None:
        """Raise before anything is loaded when the checkpoint's weights cannot all be loaded
        (torch's load_state_dict copies what matches before it reports what does not)."""
        own = self.module.state_dict()
        wrong = [f"{k}: checkpoint {tuple(v.shape)}, model {tuple(own[k].shape)}"
                 for k, v in module_state.items()
                 if k in own and hasattr(v, "shape") and tuple(v.shape) != tuple(own[k].shape)]
        if wrong:
            raise ValueError("load_checkpoint: the checkpoint's weights do not fit the model "
                             f"(nothing was loaded): {'; '.join(wrong[:5])}")
        if strict:
            excluded = set(engine_state.get("excluded_frozen", []))
            missing = sorted(set(own) - set(module_state) - excluded)
            unexpected = sorted(set(module_state) - set(own))
            if missing or unexpected:
                raise ValueError(f"load_checkpoint: the checkpoint does not match the model "
                                 f"(nothing was loaded): missing {missing[:5]}, unexpected "
                                 f"{unexpected[:5]} (pass load_module_strict=False to load what "
                                 "matches)")

    def _load_module_state(self, module_state: dict, engine_state: dict, strict: bool,
                           custom_load_fn: Callable | None, with_pending: bool) -> None:
        """The checkpoint's synchronized weights; with the optimizer state also loaded, the
        weights training ran on (the in-flight update is in that state and lands later)."""
        if with_pending and engine_state.get("pending_weights"):
            module_state = dict(module_state, **engine_state["pending_weights"])
        with self._weight_sync.paused():
            if custom_load_fn is not None:
                custom_load_fn(src=module_state, dst=self.module)
                return
            excluded = set(engine_state.get("excluded_frozen", []))
            result = self.module.load_state_dict(module_state, strict=strict and not excluded)
        if strict and excluded:
            missing = set(result.missing_keys) - excluded
            if missing or result.unexpected_keys:
                raise RuntimeError(f"load_checkpoint: the checkpoint does not match the model: "
                                   f"missing {sorted(missing)}, unexpected "
                                   f"{sorted(result.unexpected_keys)} (pass "
                                   "load_module_strict=False to load what matches)")
