"""A short description of the machine a benchmark ran on, for its JSON."""
from __future__ import annotations

import os
import platform

import torch


def describe() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {"cpu": cpu, "cores_available": len(os.sched_getaffinity(0)),
            "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info
