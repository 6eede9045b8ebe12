"""tests/test_lifecycle_faults.py's script: under an address-space limit (`ulimit -v`) 64 MiB above
what the process maps, a 512 MiB arena fails with HostMemoryError naming the limit, from the check
and from the mapping itself, and leaves no memory file open. Prints OK."""
import os
import resource

import torch

from zenflow.host.arena import Arena, HostMemoryError


def vm_size():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024


resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (64 << 20), resource.RLIM_INFINITY))
regions = [("master", torch.float32, 128 << 20)]   # 512 MiB
fds = len(os.listdir("/proc/self/fd"))
for available in (None, 1 << 40):   # the check; past the check, the mapping
    try:
        Arena.create(regions, "ZenFlowAdamW", available)
    except HostMemoryError as exc:
        assert "ulimit -v" in str(exc), exc
    else:
        raise AssertionError("mapped beyond RLIMIT_AS")
    assert len(os.listdir("/proc/self/fd")) == fds, "a memory file leaked"
print("OK")
