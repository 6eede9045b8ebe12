"""ZenFlow for PyTorch: a stall-free offloading AdamW for fine-tuning large models.

DeepSpeed scripts run with `import zenflow as deepspeed`: `initialize`, `init_distributed`,
`add_config_arguments`, `comm` and `get_accelerator` are here under DeepSpeed's names. Unchanged,
with `import deepspeed`, they run under `zenflow launch` (or after `serve_deepspeed_imports()`);
importing zenflow alone never shadows a real DeepSpeed.

The public names are imported on first use, so that `zenflow.config` (and `zenflow check-config`)
loads without torch.
"""
from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from typing import TYPE_CHECKING

try:
    __version__ = _version("zenflow-torch")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

# public name -> the module that defines it (a module itself where the name is its last part)
_PUBLIC = {
    "ZenFlowAdamW": "zenflow.optim.optimizer",
    "OffloadAdamW": "zenflow.optim.offload",
    "ZenFlowSettings": "zenflow.config.settings",
    "initialize": "zenflow.engine.engine",
    "ZenFlowEngine": "zenflow.engine.engine",
    "init_distributed": "zenflow.compat.deepspeed.comm",
    "add_config_arguments": "zenflow.compat.deepspeed.args",
    "get_accelerator": "zenflow.compat.deepspeed.accelerator",
    "comm": "zenflow.compat.deepspeed.comm",
    "serve_deepspeed_imports": "zenflow.compat.deepspeed.serve",
    "find_optimizer": "zenflow.integrations.find",
    "find_optimizers": "zenflow.integrations.find",
    # the framework callbacks (`zenflow.integrations.ZenFlowLightningCallback()`, as the README
    # writes it); the subpackage imports no framework until a callback is used
    "integrations": "zenflow.integrations",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on first use
    from zenflow import integrations
    from zenflow.compat.deepspeed import comm
    from zenflow.compat.deepspeed.accelerator import get_accelerator
    from zenflow.compat.deepspeed.args import add_config_arguments
    from zenflow.compat.deepspeed.comm import init_distributed
    from zenflow.compat.deepspeed.serve import serve_deepspeed_imports
    from zenflow.config.settings import ZenFlowSettings
    from zenflow.engine.engine import ZenFlowEngine, initialize
    from zenflow.integrations.find import find_optimizer, find_optimizers
    from zenflow.optim.offload import OffloadAdamW
    from zenflow.optim.optimizer import ZenFlowAdamW


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'zenflow' has no attribute {name!r}")
    loaded = importlib.import_module(module)
    value = loaded if module.endswith("." + name) else getattr(loaded, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


__all__ = ["ZenFlowAdamW", "OffloadAdamW", "ZenFlowSettings", "initialize", "ZenFlowEngine",
           "init_distributed", "add_config_arguments", "comm", "get_accelerator", "find_optimizer",
           "find_optimizers", "serve_deepspeed_imports", "integrations", "__version__"]
