"""`zenflow launch`: DeepSpeed's launcher command line, run with torchrun and zenflow serving the
`deepspeed` import names, so that a DeepSpeed script runs unchanged:

    zenflow launch --num_gpus 2 train.py --deepspeed --deepspeed_config ds_config.json

Each process runs the script through zenflow.compat.deepspeed.run_script, which serves
`import deepspeed`, `from deepspeed import comm`, `deepspeed.accelerator` and the rest listed in
docs/deepspeed_names.md, then runs the script as `__main__` with `--local_rank=<r>` appended (as
DeepSpeed's launcher does; --no_local_rank leaves it out). One process on one node runs without
torchrun, with the environment a launcher gives rank 0 of 1; more run under
`torch.distributed.run` (standalone on one node unless --master_port is given).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

RUNNER = "zenflow.compat.deepspeed.run_script"
# DeepSpeed launcher options that select hosts or resources zenflow does not manage: those that
# take a value, and the flags (DeepSpeed's store_true options, which must not take the script's
# name as their value).
UNSUPPORTED_WITH_VALUE = ("hostfile", "include", "exclude", "launcher", "autotuning")
UNSUPPORTED_FLAGS = ("force_multi", "elastic_training")
UNSUPPORTED = UNSUPPORTED_WITH_VALUE + UNSUPPORTED_FLAGS
# Why --bind_cores_to_rank (in DeepSpeedExamples' run_ds.sh scripts) is accepted and changes nothing.
BIND_CORES_NOTE = ("--bind_cores_to_rank changes nothing here: each rank's host worker already "
                   "runs on that rank's own share of this node's cores (zenflow/host/cores.py); "
                   "the training processes are not pinned")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1,
                        help="processes per node; -1: one per visible GPU, or 1 without a GPU")
    parser.add_argument("--num_nodes", type=int, default=1, help="nodes taking part")
    parser.add_argument("--node_rank", type=int, default=0, help="this node's rank among them")
    parser.add_argument("--master_addr", default="127.0.0.1",
                        help="address of the node with rank 0 (several nodes)")
    parser.add_argument("--master_port", type=int, default=None,
                        help="rendezvous port (one node without it: a free port is chosen; "
                             "several nodes: 29500 when not set)")
    parser.add_argument("--no_local_rank", action="store_true",
                        help="do not append --local_rank=<r> to the script's arguments")
    # Accepted by DeepSpeed's launcher; refused here by name.
    for name in UNSUPPORTED_WITH_VALUE:
        parser.add_argument(f"--{name}", default=None, help=argparse.SUPPRESS)
    for name in UNSUPPORTED_FLAGS:
        parser.add_argument(f"--{name}", action="store_const", const=True, default=None,
                            help=argparse.SUPPRESS)
    parser.add_argument("--bind_cores_to_rank", action="store_true",
                        help="accepted for DeepSpeed's scripts; " + BIND_CORES_NOTE)
    parser.add_argument("user_script", help="the training script")
    parser.add_argument("user_args", nargs=argparse.REMAINDER,
                        help="the script's own arguments (--deepspeed --deepspeed_config ...)")


def _processes_per_node(num_gpus: int) -> int:
    if num_gpus > 0:
        return num_gpus
    import torch
    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1


def command(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run `args.user_script` (validated first)."""
    refused = [f"--{n}" for n in UNSUPPORTED if getattr(args, n) is not None]
    if refused:
        raise ValueError(f"{', '.join(refused)}: not supported by zenflow launch (it starts the "
                         "processes of one node; run it on each node with --num_nodes and "
                         "--node_rank)")
    for name, value, low in (("--num_nodes", args.num_nodes, 1), ("--node_rank", args.node_rank, 0)):
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    if args.num_gpus == 0 or args.num_gpus < -1:
        raise ValueError(f"--num_gpus must be a positive count or -1 (one per GPU), got "
                         f"{args.num_gpus}")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise ValueError(f"--master_port must be a TCP port in 1..65535, got {args.master_port}")
    if args.node_rank >= args.num_nodes:
        raise ValueError(f"--node_rank {args.node_rank} is outside --num_nodes {args.num_nodes}")
    if not os.path.isfile(args.user_script):
        raise ValueError(f"user_script {args.user_script!r} is not a file")
    runner = [RUNNER, *(["--no_local_rank"] if args.no_local_rank else []), args.user_script,
              *args.user_args]
    nproc = _processes_per_node(args.num_gpus)
    env = dict(os.environ)
    if nproc == 1 and args.num_nodes == 1:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR=args.master_addr, MASTER_PORT=str(args.master_port or 29500))
        return [sys.executable, "-m", *runner], env
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    if args.num_nodes == 1 and args.master_port is None:
        torchrun.append("--standalone")
    else:
        torchrun += ["--nnodes", str(args.num_nodes), "--node_rank", str(args.node_rank),
                     "--master_addr", args.master_addr,
                     "--master_port", str(args.master_port or 29500)]
    return [*torchrun, "-m", *runner], env


def run(args: argparse.Namespace) -> int:
    try:
        cmd, env = command(args)
    except ValueError as exc:
        print(f"zenflow launch: error: {exc}", file=sys.stderr)
        return 2
    if args.bind_cores_to_rank:
        print(f"zenflow launch: {BIND_CORES_NOTE}", file=sys.stderr, flush=True)
    print(f"zenflow launch: {' '.join(cmd)}", file=sys.stderr, flush=True)
    return run_forwarding_signals(cmd, env)


def run_forwarding_signals(cmd: list[str], env: dict[str, str]) -> int:
    """Run `cmd` and return its exit status; a SIGTERM, SIGINT or SIGHUP sent to this launcher
    (a scheduler ending the job, Ctrl-C) goes on to it, and this waits for it to end (torchrun
    passes it to its workers and waits for them), so no training process is orphaned, and the
    checkpoint a SIGTERM handler writes is written."""
    child = subprocess.Popen(cmd, env=env)

    def forward(signum, frame):
        if child.poll() is None:
            child.send_signal(signum)
    forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {signum: signal.signal(signum, forward) for signum in forwarded}
    try:
        return child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
