"""Serve the `deepspeed` import names from zenflow, so that a DeepSpeed script runs unchanged.

    zenflow.serve_deepspeed_imports()     # what `zenflow launch` does in every rank
    import deepspeed                      # zenflow's initialize, init_distributed, ...
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

Nothing here happens on `import zenflow`: the names exist only after `serve_deepspeed_imports()`
(called by the launcher in each process it starts, or by the user), so importing zenflow never
shadows an installed DeepSpeed. Serving refuses to run when a real DeepSpeed is already imported.

`deepspeed` itself is a module object whose attributes resolve through `zenflow` at first use
(this module sits below the engine and cannot import it). A `deepspeed.*` name not in SERVED is
refused by name, with ModuleNotFoundError (so a script's `try: ... except ImportError` fallback
still works) or AttributeError. docs/deepspeed_names.md lists both.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import types

# `deepspeed.<name>` attribute -> the zenflow public name it resolves to.
TOP_LEVEL = {
    "initialize": "initialize",
    "init_distributed": "init_distributed",
    "add_config_arguments": "add_config_arguments",
    "get_accelerator": "get_accelerator",
    "DeepSpeedEngine": "ZenFlowEngine",
    "comm": "comm",
}

# Submodules served: name -> what it holds (printed once by the launcher, listed in the docs).
SERVED = {
    "deepspeed": "initialize, init_distributed, add_config_arguments, get_accelerator, "
                 "DeepSpeedEngine, comm",
    "deepspeed.comm": "zenflow.comm (torch.distributed, rank 0 of 1 without a group)",
    "deepspeed.accelerator": "get_accelerator (CUDA, else the CPU)",
    "deepspeed.ops": "(package)",
    "deepspeed.ops.adam": "DeepSpeedCPUAdam, FusedAdam -> torch.optim.AdamW (Adam with "
                          "adamw_mode=False)",
    "deepspeed.moe": "(package)",
    "deepspeed.moe.utils": "split_params_into_different_moe_groups_for_optimizer (the groups as a "
                           "list, nothing moved: zenflow has no MoE layers, so no parameter is an "
                           "expert's), "
                           "is_moe_param (False)",
    "deepspeed.utils": "logger, log_dist",
}

# Names DeepSpeed scripts import that zenflow refuses, and why (the rest are refused plainly).
REFUSED = {
    "deepspeed.moe.layer": "mixture-of-experts layers (expert parallelism is not supported)",
    "deepspeed.pipe": "pipeline parallelism is not supported (data parallel only)",
    "deepspeed.runtime": "DeepSpeed's engine internals; use the engine's methods instead",
    "deepspeed.zero": "ZeRO stage 3 (zero.Init, GatheredParameters) is not supported",
    "deepspeed.ops.op_builder": "DeepSpeed's compiled kernels are not part of zenflow",
    "deepspeed.checkpointing": "activation checkpointing: use torch.utils.checkpoint",
}

def _spec(name: str, is_package: bool) -> importlib.machinery.ModuleSpec:
    """The module spec of a served module. `importlib.util.find_spec(name)` returns it and raises
    ValueError for a module in sys.modules without one; transformers' and accelerate's
    `is_deepspeed_available()` call it at import. No loader: the module is in sys.modules
    already. There is no `deepspeed` distribution metadata either, so those checks answer False
    and the libraries keep their own DeepSpeed code paths off: the script drives zenflow's engine
    itself."""
    return importlib.machinery.ModuleSpec(name, None, is_package=is_package)


def _zenflow(name: str):
    return getattr(importlib.import_module("zenflow"), name)


class _DeepSpeedModule(types.ModuleType):
    """The `deepspeed` package: its attributes are zenflow's public names, looked up on use."""

    def __getattr__(self, name: str):
        if name in TOP_LEVEL:
            value = _zenflow(TOP_LEVEL[name])
            setattr(self, name, value)
            return value
        raise AttributeError(f"deepspeed.{name} is not served by zenflow (served: "
                             f"{', '.join(sorted(TOP_LEVEL))}; see docs/deepspeed_names.md)")


def _adam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
          amsgrad=False, adamw_mode=True, **ignored):
    """DeepSpeed's Adam constructors, as torch's: AdamW (adamw_mode, the default) or Adam."""
    import torch
    if not bias_correction:
        raise ValueError("deepspeed.ops.adam: bias_correction=False is not served (torch's Adam "
                         "always corrects the bias); drop the argument")
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)


def DeepSpeedCPUAdam(model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                     weight_decay=0.0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
    return _adam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adamw_mode)


def FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
              adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True):
    return _adam(params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode)


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971):
    """The groups as a list, as DeepSpeed returns them (a single group dict becomes [group]).
    DeepSpeed moves expert parameters (those its MoE layers mark) into groups of their own;
    zenflow serves no MoE layer, so no parameter is an expert's and nothing moves."""
    if isinstance(param_groups, dict):
        return [param_groups]
    return list(param_groups)


def is_moe_param(param) -> bool:
    return False


def _deepspeed_logger() -> logging.Logger:
    """deepspeed.utils.logger: DeepSpeed's logger prints INFO and up to stdout, so does this."""
    logger = logging.getLogger("DeepSpeed")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def log_dist(message: str, ranks=None, level=logging.INFO) -> None:
    """Log on the given ranks (all when ranks is None or holds -1), as deepspeed.utils does."""
    from zenflow.compat.deepspeed import comm
    rank = comm.get_rank() if comm.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        _deepspeed_logger().log(level, "[Rank %d] %s", rank, message)


def _submodules() -> dict[str, types.ModuleType]:
    from zenflow.compat.deepspeed import accelerator, comm

    def module(name: str, **attrs) -> types.ModuleType:
        mod = types.ModuleType(name, f"zenflow's {name}: {SERVED[name]}")
        mod.__dict__.update(attrs)
        mod.__spec__ = _spec(name, is_package="__path__" in attrs)
        return mod

    package = _DeepSpeedModule("deepspeed", "zenflow serving DeepSpeed's import names")
    package.__path__ = []   # a package, so that `import deepspeed.x` looks for submodules
    package.__spec__ = _spec("deepspeed", is_package=True)
    mods = {
        "deepspeed": package,
        "deepspeed.comm": comm,
        "deepspeed.accelerator": module("deepspeed.accelerator",
                                        get_accelerator=accelerator.get_accelerator),
        "deepspeed.ops": module("deepspeed.ops", __path__=[]),
        "deepspeed.ops.adam": module("deepspeed.ops.adam", DeepSpeedCPUAdam=DeepSpeedCPUAdam,
                                     FusedAdam=FusedAdam),
        "deepspeed.moe": module("deepspeed.moe", __path__=[]),
        "deepspeed.moe.utils": module(
            "deepspeed.moe.utils", is_moe_param=is_moe_param,
            split_params_into_different_moe_groups_for_optimizer=(
                split_params_into_different_moe_groups_for_optimizer)),
        "deepspeed.utils": module("deepspeed.utils", __path__=[], logger=_deepspeed_logger(),
                                  log_dist=log_dist),
    }
    package.ops, package.moe, package.utils = mods["deepspeed.ops"], mods["deepspeed.moe"], \
        mods["deepspeed.utils"]
    package.accelerator = mods["deepspeed.accelerator"]
    mods["deepspeed.ops"].adam = mods["deepspeed.ops.adam"]
    mods["deepspeed.moe"].utils = mods["deepspeed.moe.utils"]
    return mods


class _RefuseUnserved(importlib.abc.MetaPathFinder):
    """Any other `deepspeed.*` import fails naming what zenflow does not serve."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("deepspeed.") or fullname in sys.modules:
            return None
        why = next((reason for name, reason in REFUSED.items()
                    if fullname == name or fullname.startswith(name + ".")), None)
        raise ModuleNotFoundError(
            f"{fullname} is not served by zenflow" + (f": {why}" if why else "")
            + f" (served: {', '.join(SERVED)}; see docs/deepspeed_names.md)", name=fullname)


def serve_deepspeed_imports() -> list[str]:
    """Make `import deepspeed` (and the names in SERVED) resolve to zenflow in this process.

    Refuses when a real DeepSpeed is already imported, since serving would shadow it. Calling it
    twice is harmless. Returns the module names served."""
    existing = sys.modules.get("deepspeed")
    if existing is not None and not isinstance(existing, _DeepSpeedModule):
        raise RuntimeError("serve_deepspeed_imports: a real DeepSpeed is already imported "
                           f"({getattr(existing, '__file__', existing)!r}); serving zenflow under "
                           "its name would shadow it. Call this before anything imports "
                           "deepspeed, or use DeepSpeed itself")
    if existing is None:
        sys.modules.update(_submodules())
        sys.meta_path.insert(0, _RefuseUnserved())
    return list(SERVED)
