"""tests/test_deepspeed_launch.py's child: with a `deepspeed` module already imported, zenflow
refuses to serve its own; prints the refusal."""
import sys
import types

sys.modules['deepspeed'] = types.ModuleType('deepspeed')
import zenflow  # noqa: E402

try:
    zenflow.serve_deepspeed_imports()
except RuntimeError as exc:
    print(exc)
