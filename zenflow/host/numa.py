"""Which NUMA nodes hold the host state on a multi-socket server.

The host worker reads and writes the whole host state every window (its AdamW touches about 30
bytes per parameter), so its speed is the memory bandwidth its cores reach. Pages on the other
socket come over the socket interconnect, at a fraction of local bandwidth, and by default Linux
puts a shared page on the node of the thread that first touches it: the training process, which
creates the memory. So the memory goes where the worker's cores are: preferred on their node
when they sit on one; when they span several, every buffer is cut into one equal share per node
(`share_bounds`: the same cut for every buffer of the same length) and each share is preferred
on its node, and the worker runs each share's arithmetic on that node's cores
(zenflow/host/teams.py), so every socket works on local memory with its own memory controller.
Equal shares, because the sockets' memory bandwidths are equal and the update is bound by them;
a node whose cores finish first helps the others. On a machine with one node there is nothing to
choose and nothing is done; where the kernel refuses (no mbind, a container's seccomp profile)
the pages go where Linux puts them and a debug line says why.
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


def cores_by_node(cpus: list[int], nodes: list[int], node_dir: str = NODE_DIR
                  ) -> list[list[int]]:
    """Of `cpus`, those on each of `nodes`, in that order (a node sysfs does not list: none)."""
    members = node_cpus(node_dir)
    return [sorted(set(cpus) & members.get(node, set())) for node in nodes]


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


# Shares are cut at multiples of this many elements: a whole page (4 KiB) for any element size,
# and a multiple of every SIMD width, so a kernel over a share vectorizes it as it would the
# whole buffer (torch's fused AdamW rounds differently in its scalar tail: a cut anywhere else
# would change results).
SHARE_ALIGN = 4096
PAGE = 4096


def share_bounds(numel: int, parts: int) -> list[int]:
    """Element bounds [0, b1, ..., numel] cutting `numel` elements into `parts` equal shares,
    each cut at a multiple of SHARE_ALIGN (so shares may be empty when numel is small)."""
    if parts < 1:
        raise ValueError(f"share_bounds: parts must be >= 1, got {parts}")
    cuts = [min(numel, numel * i // parts // SHARE_ALIGN * SHARE_ALIGN) for i in range(1, parts)]
    return [0, *cuts, numel]


def spans(regions: list[tuple[int, int, int]], size: int, nodes: list[int]
          ) -> list[tuple[int, int, int]]:
    """(first byte, bytes, node) covering a file of `size` bytes whose buffers are `regions`
    (byte offset, element count, element size; page-aligned, ascending): each buffer cut into
    share_bounds' shares, share i on nodes[i]. The page padding after a buffer goes with its
    last share; bytes before the first buffer with nodes[0]."""
    out: list[tuple[int, int, int]] = []

    def add(start: int, end: int, node: int) -> None:
        if end <= start:
            return
        if out and out[-1][2] == node and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], end - out[-1][0], node)
        else:
            out.append((start, end - start, node))
    position = 0
    for offset, numel, itemsize in sorted(regions):
        add(position, offset, out[-1][2] if out else nodes[0])
        bounds = share_bounds(numel, len(nodes))
        for i, node in enumerate(nodes):
            add(offset + bounds[i] * itemsize, offset + bounds[i + 1] * itemsize, node)
        position = max(position, offset + numel * itemsize)
    add(position, size, out[-1][2] if out else nodes[0])
    return out


def place_file(fd: int, nbytes: int, nodes: list[int],
               regions: list[tuple[int, int, int]] | None = None) -> str | None:
    """Give the shared memory file `fd` (a memfd: the policy is the file's, whoever faults its
    pages) the policy for `nodes`, before any of its pages exists: preferred on a single node;
    over several, each of `regions`' buffers (byte offset, elements, element size) cut into
    equal shares, one preferred on each node (spans()), or without `regions` interleaved page
    by page. Returns None, or why not."""
    numbers = _SYSCALLS.get(platform.machine())
    if not nodes or numbers is None or nbytes == 0:
        return None if not nodes or nbytes == 0 else f"no mbind number for {platform.machine()}"
    if len(nodes) == 1:
        plan = [(0, nbytes, MPOL_PREFERRED, nodes)]
    elif regions is None:
        plan = [(0, nbytes, MPOL_INTERLEAVE, nodes)]
    else:
        plan = [(start, length, MPOL_PREFERRED, [node])
                for start, length, node in spans(regions, nbytes, nodes)]
    memory = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    window = (ctypes.c_char * nbytes).from_buffer(memory)
    error = 0
    try:
        for start, length, mode, members in plan:
            mask, maxnode = _nodemask(members)
            # The kernel reads maxnode - 1 bits of the mask.
            error = _syscall(numbers[0], ctypes.c_void_p(ctypes.addressof(window) + start),
                             ctypes.c_ulong(length), mode, mask, ctypes.c_ulong(maxnode + 1), 0)
            if error:
                break
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


def place_host_memory(fd: int, nbytes: int, nodes: list[int],
                      regions: list[tuple[int, int, int]] | None = None) -> None:
    """place_file, logging what happened (placement is an optimisation: failure is not an
    error)."""
    if not nodes:
        return
    why_not = place_file(fd, nbytes, nodes, regions)
    if why_not is None:
        how = ("on" if len(nodes) == 1 else "interleaved over" if regions is None
               else "in equal shares on")
        log.info("host state (%.2f GiB) %s NUMA node%s %s, where the host worker runs",
                 nbytes / 2**30, how, "" if len(nodes) == 1 else "s", ",".join(map(str, nodes)))
    else:
        log.debug("host state left where Linux puts it (%s)", why_not)
