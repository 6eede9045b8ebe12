"""The host's figures `zenflow estimate` assumes where no selftest measured them: the worker's
update and accumulate rates on a stated server, placed as zenflow/host/cores.py places them.

Each rank's training process keeps TRAINING_CORES physical cores of the machine and its worker
takes the rest, on every socket (zenflow/host/numa.py keeps each socket's part of the host state
on that socket's memory). A pass over the host state then runs at the lesser of what the
workers' cores compute and what the sockets' memory streams:

    rate = min(worker cores x per-core rate, sockets x bandwidth per socket / bytes per parameter)

The per-core rates and the bytes are benchmarks/host_adam.py's (the update against a streaming
probe of its bytes, on one core of a 2-core AMD EPYC): "mean" and the lookahead stream, while the
"factored" update computes a log and a sqrt of every value and is bound by arithmetic until
enough cores share a socket. This module is torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass

from zenflow.host.cores import TRAINING_CORES


@dataclass(frozen=True)
class HostMachine:
    """The server the estimate assumes: two sockets of 32 physical cores, each with 125 GB/s
    of memory bandwidth (a dual-socket GPU server's, DDR5; `--host-*` state yours)."""
    sockets: int = 2
    cores_per_socket: int = 32
    gbps_per_socket: float = 125.0

    def worker_cores(self, ranks: int) -> int:
        """Cores every rank's worker has together: all but TRAINING_CORES per rank."""
        return max(1, self.sockets * self.cores_per_socket - TRAINING_CORES * ranks)

    def __str__(self) -> str:
        return (f"{self.sockets} socket(s) x {self.cores_per_socket} cores, "
                f"{self.gbps_per_socket:g} GB/s a socket")


# (parameters per second on one core, bytes a parameter moves to or from memory)
PASSES = {
    # AdamW on the window's mean: the fp32 sum read, master and both moments read and written,
    # the bf16 install value written
    "host_adamw_params_per_s": (0.9e9, 30),
    # the same bytes and the sum read twice (two passes of row blocks), bound by arithmetic
    "host_factored_params_per_s": (0.18e9, 34),
    # a bf16 gradient row read, its fp32 sum read and written
    "host_accumulate_params_per_s": (2.0e9, 10),
    # a reselection's column moves (optim/handoff.py), every selected column changing: in each of
    # the three fp32 state buffers a gather and a scatter of columns, which touch ~81% of the
    # 64-byte lines at topk_ratio 0.1, the scatter's read and written (benchmarks/drained_host.py:
    # the gathers of 180M parameters' three buffers 104 ms on one core, a scatter 1.17x a gather)
    "host_reselect_params_per_s": (0.8e9, 29),
}
# host_moments_dtype="bfloat16": both moments read and written in 2 bytes (8 fewer a
# parameter), but widened and rounded back by separate passes (host/compact_moments.py): per
# core the update runs at the share of the fp32 one that benchmarks/host_adam.py measured
# ("mean_bf16" against "mean", "factored_bf16" against "factored", on one core)
COMPACT_PASSES = {
    "host_adamw_params_per_s": (0.9e9 * 0.47, 22),
    "host_factored_params_per_s": (0.18e9 * 0.74, 26),
}


def host_figures(machine: HostMachine, ranks: int, compact_moments: bool = False
                 ) -> dict[str, tuple[float, str]]:
    """{figure: (parameters per second of every rank's worker together, how it was reached)};
    `compact_moments`: host_moments_dtype="bfloat16" (COMPACT_PASSES)."""
    cores = machine.worker_cores(ranks)
    bandwidth = machine.sockets * machine.gbps_per_socket * 1e9
    out = {}
    for key, (per_core, nbytes) in PASSES.items():
        if compact_moments:
            per_core, nbytes = COMPACT_PASSES.get(key, (per_core, nbytes))
        computed, streamed = cores * per_core, bandwidth / nbytes
        bound = "memory" if streamed < computed else "cores"
        out[key] = (min(computed, streamed),
                    f"{machine}: {cores} worker cores x {per_core / 1e9:g}G params/s a core, "
                    f"or {bandwidth / 1e9:g} GB/s / {nbytes} bytes a parameter: bound by {bound}")
    return out
