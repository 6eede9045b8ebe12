"""What DeepSpeed client scripts call besides `initialize`, so that `import zenflow as deepspeed`
is the one line a DeepSpeed-ZenFlow script changes (plus `from deepspeed...` import lines, which
name the package: `from zenflow import comm as dist`, `from zenflow import get_accelerator`).

- `add_config_arguments(parser)`: the --deepspeed/--deepspeed_config options.
- `get_accelerator()`: a minimal DeepSpeed accelerator (device names, seeds, memory queries).
  It lives here, not in `zenflow.host.transfers`, which is the optimizer's CUDA stream seam.
- `resolve_deepspeed_conventions(config)`: the legacy `"zero_optimization": true` and Hugging
  Face's `"auto"` values, applied before a config is validated.
- `DeepSpeedEngineAPI`: the engine attributes and methods DeepSpeed scripts use.
"""
from zenflow.compat.deepspeed.accelerator import get_accelerator
from zenflow.compat.deepspeed.args import add_config_arguments

__all__ = ["add_config_arguments", "get_accelerator"]
