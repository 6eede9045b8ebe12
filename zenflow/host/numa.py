"""Which NUMA nodes hold the host state on a multi-socket server.

The host worker reads and writes the whole host state every window (its AdamW touches about 20
bytes per parameter). Pages on the other socket come over the socket interconnect, at a fraction
of local bandwidth, and by default Linux puts a shared page on the node of the thread that first
touches it: the training process, which creates the memory. So the memory goes where the
worker's cores are: preferred on their node when they sit on one, interleaved page by page over
their nodes when they span several (each socket's threads then find their share local, and both
memory controllers work). On a machine with one node there is nothing to choose and nothing is
done; where the kernel refuses (no mbind, a container's seccomp profile) the pages go where
Linux puts them and a debug line says why.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform

log = logging.getLogger("zenflow")

NODE_DIR = "/sys/devices/system/node"
MPOL_PREFERRED, MPOL_INTERLEAVE = 1, 3
MPOL_F_ADDR = 2
# (mbind, get_mempolicy) system call numbers; glibc wraps neither (libnuma does).
_SYSCALLS = {"x86_64": (237, 239), "aarch64": (235, 236), "ppc64le": (259, 260)}


def _cpu_list(text: str) -> set[int]:
    """The CPUs of a sysfs list such as "0-3,8-11"."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def node_cpus(node_dir: str = NODE_DIR) -> dict[int, set[int]]:
    """Each NUMA node's CPUs; empty where sysfs does not say (not Linux, no NUMA support)."""
    nodes = {}
    try:
        names = os.listdir(node_dir)
    except OSError:
        return {}
    for name in names:
        if name.startswith("node") and name[4:].isdigit():
            try:
                with open(os.path.join(node_dir, name, "cpulist")) as f:
                    nodes[int(name[4:])] = _cpu_list(f.read())
            except (OSError, ValueError):
                continue
    return nodes


def nodes_for(cpus: list[int], node_dir: str = NODE_DIR) -> list[int]:
    """The nodes whose CPUs include some of `cpus`, where the machine has more than one node
    (else [], which means: leave placement to Linux)."""
    nodes = node_cpus(node_dir)
    if len(nodes) < 2:
        return []
    return sorted(n for n, members in nodes.items() if members & set(cpus))


def _syscall(which: int, *args) -> int:
    """Run system call number `which`; returns 0 or the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    return 0 if libc.syscall(which, *args) == 0 else ctypes.get_errno()


def _nodemask(nodes: list[int]):
    bits = 64
    mask = (ctypes.c_ulong * (max(nodes) // bits + 1))()
    for n in nodes:
        mask[n // bits] |= 1 << (n % bits)
    return mask, len(mask) * bits


def place_file(fd: int, nbytes: int, nodes: list[int]) -> str | None:
    """Give the shared memory file `fd` (a memfd: the policy is the file's, whoever faults its
    pages) the policy for `nodes`, before any of its pages exists. Returns None, or why not."""
    numbers = _SYSCALLS.get(platform.machine())
    if not nodes or numbers is None or nbytes == 0:
        return None if not nodes or nbytes == 0 else f"no mbind number for {platform.machine()}"
    memory = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    window = (ctypes.c_char * nbytes).from_buffer(memory)
    try:
        mask, maxnode = _nodemask(nodes)
        mode = MPOL_PREFERRED if len(nodes) == 1 else MPOL_INTERLEAVE
        # The kernel reads maxnode - 1 bits of the mask.
        error = _syscall(numbers[0], ctypes.c_void_p(ctypes.addressof(window)),
                         ctypes.c_ulong(nbytes), mode, mask, ctypes.c_ulong(maxnode + 1), 0)
    finally:
        del window
        memory.close()
    return None if error == 0 else f"mbind failed: {os.strerror(error)}"


def policy_of(address: int) -> tuple[int, list[int]]:
    """(mode, nodes) of the memory policy at `address` (for tests and diagnostics)."""
    numbers = _SYSCALLS[platform.machine()]
    mode = ctypes.c_int(-1)
    mask = (ctypes.c_ulong * 16)()
    error = _syscall(numbers[1], ctypes.byref(mode), mask, ctypes.c_ulong(16 * 64 + 1),
                     ctypes.c_void_p(address), ctypes.c_ulong(MPOL_F_ADDR))
    if error:
        raise OSError(error, f"get_mempolicy: {os.strerror(error)}")
    return mode.value, [n for n in range(16 * 64) if mask[n // 64] >> (n % 64) & 1]


def place_host_memory(fd: int, nbytes: int, nodes: list[int]) -> None:
    """place_file, logging what happened (placement is an optimisation: failure is not an
    error)."""
    if not nodes:
        return
    why_not = place_file(fd, nbytes, nodes)
    if why_not is None:
        log.info("host state (%.2f GiB) %s NUMA node%s %s, where the host worker runs",
                 nbytes / 2**30, "on" if len(nodes) == 1 else "interleaved over",
                 "" if len(nodes) == 1 else "s", ",".join(map(str, nodes)))
    else:
        log.debug("host state left where Linux puts it (%s)", why_not)
