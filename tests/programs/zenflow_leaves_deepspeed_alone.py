"""tests/test_deepspeed_launch.py's child: importing zenflow, its engine and its served comm puts
no `deepspeed` in sys.modules; prints `no deepspeed` or `real PATH` (a DeepSpeed installed)."""
import sys

import zenflow  # noqa: F401
import zenflow.compat.deepspeed.comm  # noqa: F401
import zenflow.engine.engine  # noqa: F401

assert 'deepspeed' not in sys.modules
try:
    import deepspeed
except ImportError:
    print('no deepspeed')
else:
    print('real', deepspeed.__file__)
