"""ZenFlow for PyTorch: a stall-free offloading AdamW for fine-tuning large models."""
from zenflow.optimizer import ZenFlowAdamW
from zenflow.offload import OffloadAdamW

__all__ = ["ZenFlowAdamW", "OffloadAdamW"]
__version__ = "0.1.0"
