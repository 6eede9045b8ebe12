"""Two DeepSpeed config conventions, resolved before the config is validated.

- `"zero_optimization": true` / `false`: DeepSpeed's legacy spelling of stage 1 / stage 0 (the
  CIFAR-10 tutorial's own sample uses it).
- `"dist_backend"`: the torch.distributed backend `initialize` uses when it sets up the process
  group itself (nccl, gloo, ...); read by `initialize`, checked and removed here.
- `"auto"`: a placeholder that the Hugging Face Trainer fills from its TrainingArguments. The
  batch sizes can be derived from each other and the world size (train = micro * accumulation *
  world), so an "auto" batch key is treated as absent and derived; any other "auto" outside
  `zero_optimization` names something only the Trainer knows (learning rate, precision, ...) and
  is refused with the key to set. Under `zero_optimization`, "auto" is left to the schema: the
  zenflow block takes it for its intervals, and bucket sizes are accepted and ignored.
"""
from __future__ import annotations

import logging

log = logging.getLogger("zenflow.config")

DIST_BACKENDS = ("nccl", "gloo", "mpi", "ucc", "xccl")
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_WHAT_TO_SET = {"fp16.enabled": "true or false", "bf16.enabled": "true or false",
                "gradient_clipping": "a number (0 turns clipping off)"}


def _auto_paths(value, path: str):
    if value == "auto":
        yield path
    elif isinstance(value, dict):
        for key, sub in value.items():
            yield from _auto_paths(sub, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, sub in enumerate(value):
            yield from _auto_paths(sub, f"{path}[{i}]")


def resolve_deepspeed_conventions(data: dict) -> tuple[dict, list[str]]:
    """Return (config with the conventions applied, problems). `data` is not modified."""
    data = dict(data)
    problems = []
    zero = data.get("zero_optimization")
    if isinstance(zero, bool):
        data["zero_optimization"] = {"stage": 1 if zero else 0}
        log.info('"zero_optimization": %s is read as {"stage": %d} (DeepSpeed\'s legacy form)',
                 str(zero).lower(), 1 if zero else 0)
    elif isinstance(zero, dict) and zero.get("stage") == "auto":
        problems.append('zero_optimization.stage is "auto", which only the Hugging Face Trainer '
                        "fills in; set 1 or 2 (0 = no ZeRO)")
    if "dist_backend" in data:
        backend = data.pop("dist_backend")
        if backend not in DIST_BACKENDS:
            problems.append(f"dist_backend must be one of {', '.join(DIST_BACKENDS)}, got "
                            f"{backend!r}")
    auto_batch = [k for k in BATCH_KEYS if data.get(k) == "auto"]
    for key in auto_batch:
        del data[key]
    if auto_batch and "train_batch_size" not in data \
            and "train_micro_batch_size_per_gpu" not in data:
        problems.append(f"{' and '.join(auto_batch)} are \"auto\" and cannot be derived: set "
                        "train_micro_batch_size_per_gpu (the per-rank batch) or "
                        "train_batch_size to a number; the others follow from train = micro * "
                        "gradient_accumulation_steps * world size")
    for key, value in data.items():
        if key == "zero_optimization":
            continue
        for path in _auto_paths(value, key):
            what = _WHAT_TO_SET.get(path, "a value (a number for sizes, rates and steps)")
            problems.append(f'{path} is "auto", which only the Hugging Face Trainer fills in '
                            f"(from its TrainingArguments); outside it, set {what}")
    return data, problems
