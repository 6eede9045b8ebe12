"""What `zenflow selftest` runs, by name: plain data that both the command (selftest_cli.py,
which imports no torch) and the checks' runner (selftest.py) read."""
from __future__ import annotations

SECTIONS = ("environment", "correctness", "equivalences", "bf16", "offload", "transfers",
            "worker", "model", "closure", "pagelocks", "compiled", "throughput", "bandwidth",
            "memory", "speed")
DTYPES = ("bf16", "fp32")   # the parameter dtypes of the correctness checks
