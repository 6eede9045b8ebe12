"""The engine on a model sharded with FSDP2 (`fully_shard`): what a DeepSpeed config maps to.

DeepSpeed's ZeRO stage 3 partitions the parameters; here that is FSDP2, applied by the user
before `initialize` (it decides which modules are units and how they prefetch). The engine then
leaves the sharding to FSDP2: it broadcasts no sharded weight (each rank holds other rows) and
averages no gradient (FSDP2's reduce-scatter did), and its checkpoints go through
torch.distributed.checkpoint (zenflow/engine/checkpoint_dcp.py). Precision is FSDP2's too:
`fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))` computes in bf16 and
keeps the sharded parameters in fp32, so the config's bf16/fp16 blocks do not map to it.
A model the user sharded runs the same way under a stage 0-2 config: those stages say what
DeepSpeed splits of replicas, and this model holds none (the engine logs that it runs as stage 3).
"""
from __future__ import annotations

import logging

import torch

from zenflow.config.deepspeed_json import ConfigError, ZenFlowConfig
from zenflow.distributed import is_sharded

log = logging.getLogger("zenflow.engine")


def is_fsdp2(model: torch.nn.Module) -> bool:
    """Whether `model`'s parameters are FSDP2 shards (DTensors)."""
    return any(is_sharded(p) for p in model.parameters())


def check_sharding(model: torch.nn.Module, config: ZenFlowConfig) -> bool:
    """Raise ConfigError (before the model is touched) where the config and the model's sharding
    do not go together; return whether the model is FSDP2-sharded."""
    sharded = is_fsdp2(model)
    problems = []
    if config.zero_optimization.stage == 3 and not sharded:
        problems.append(
            "zero_optimization.stage is 3 (sharded parameters), which zenflow runs on PyTorch's "
            "FSDP2, but the model's parameters are not sharded: call "
            "torch.distributed.fsdp.fully_shard on each block and on the root module before "
            "initialize (docs/fsdp2.md), or use stage 2 (replicas, host state split by rows)")
    if sharded and config.dtype_name != "fp32":
        problems.append(
            f"{config.dtype_name}.enabled is true, but the model is FSDP2-sharded, whose "
            "precision is FSDP2's: pass fully_shard(..., mp_policy=MixedPrecisionPolicy("
            "param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) and leave "
            f"{config.dtype_name} off (the sharded parameters and the optimizer state stay fp32)")
    if problems:
        raise ConfigError(problems)
    if sharded and config.zero_optimization.stage < 3:
        # Stages 0-2 say what DeepSpeed splits of replicas; the model's own sharding decides here.
        log.info("the model is FSDP2-sharded and zero_optimization.stage is %d: it runs as stage 3 "
                 "does (FSDP2 shards the weights and gradients; the host state is split by rows "
                 "under every stage), and checkpoints go through torch.distributed.checkpoint",
                 config.zero_optimization.stage)
    return sharded
