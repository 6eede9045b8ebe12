"""tests/test_layout.py's child: prints whether importing the config and check-config pulled in
torch (it must not: the config layer is torch-free)."""
import sys

import zenflow.config.deepspeed_json  # noqa: F401
import zenflow.tools.check_config  # noqa: F401

print('torch' in sys.modules)
