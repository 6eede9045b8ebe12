"""tests/test_deepspeed_launch.py's script for `zenflow launch`: the served `deepspeed` names are
zenflow's, importlib finds each of them, and the others are refused by name. Prints its arguments
and one `refused ...` line per refusal.

    python -m zenflow launch tests/programs/deepspeed_names.py ARGS...
"""
import importlib.util
import sys

import deepspeed
import deepspeed.comm as dist
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.utils import logger  # noqa: F401

import zenflow
from zenflow.compat.deepspeed.serve import SERVED

assert deepspeed.initialize is zenflow.initialize and dist is zenflow.comm
assert deepspeed.DeepSpeedEngine is zenflow.ZenFlowEngine
assert get_accelerator().device_name() in ('cpu', 'cuda')
p = [torch.nn.Parameter(torch.ones(2))]
assert type(DeepSpeedCPUAdam(p)) is torch.optim.AdamW
assert type(FusedAdam(p, adam_w_mode=False)) is torch.optim.Adam
groups = {'params': p, 'name': 'parameters'}
assert split_params_into_different_moe_groups_for_optimizer(groups) == [groups]
for name in SERVED:   # what transformers' and accelerate's DeepSpeed checks call
    assert importlib.util.find_spec(name) is not None, name
print('args', sys.argv[1:])
for name in ('deepspeed.runtime.zero', 'deepspeed.pipe', 'deepspeed.nothing'):
    try:
        __import__(name)
    except ModuleNotFoundError as exc:
        print('refused', exc)
try:
    deepspeed.zero
except AttributeError as exc:
    print('refused', exc)
