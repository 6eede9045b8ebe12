"""ZenFlow for PyTorch: a stall-free offloading AdamW for fine-tuning large models.

DeepSpeed scripts run with `import zenflow as deepspeed`: `initialize`, `init_distributed`,
`add_config_arguments`, `comm` and `get_accelerator` are here under DeepSpeed's names.
"""
from importlib.metadata import PackageNotFoundError, version as _version

from zenflow import comm
from zenflow.comm import init_distributed
from zenflow.ds import add_config_arguments, get_accelerator
from zenflow.engine import ZenFlowEngine, initialize
from zenflow.integrations import find_optimizer, find_optimizers
from zenflow.offload import OffloadAdamW
from zenflow.optimizer import ZenFlowAdamW
from zenflow.settings import ZenFlowSettings

try:
    __version__ = _version("zenflow-torch")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["ZenFlowAdamW", "OffloadAdamW", "ZenFlowSettings", "initialize", "ZenFlowEngine",
           "init_distributed", "add_config_arguments", "comm", "get_accelerator", "find_optimizer",
           "find_optimizers", "__version__"]
