"""ZenFlow for PyTorch: a stall-free offloading AdamW for fine-tuning large models."""
from zenflow.optimizer import ZenFlowAdamW
from zenflow.offload import OffloadAdamW
from zenflow.engine import initialize

__all__ = ["ZenFlowAdamW", "OffloadAdamW", "initialize"]
__version__ = "0.1.0"
