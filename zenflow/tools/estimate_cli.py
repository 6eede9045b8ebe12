"""The `zenflow estimate` command: its arguments and its run. Importing this module imports no
torch (`zenflow estimate --help` is instant); run() imports the model (estimate.py)."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

GIB = 1 << 30


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-config", metavar="PATH", default=None,
                     help="a Hugging Face config.json or model folder (read offline; no weights)")
    src.add_argument("--preset", default=None, help="a `zenflow bench` preset name (e.g. cpu-llama)")
    src.add_argument("--shapes", default=None,
                     help='parameter shapes, e.g. "4096x4096*128,11008x4096*64,4096*65"')
    p.add_argument("--gpus", type=at_least(1, int), default=None,
                   help="GPUs (data-parallel ranks) on the host (default 1, or --fsdp's N)")
    p.add_argument("--fsdp", type=at_least(1, int), default=None, metavar="N",
                   help="also print the bytes per rank with the model sharded N ways by FSDP2, "
                        "beside DDP's on N GPUs")
    p.add_argument("--gpu-memory", type=_above_zero, default=None,
                   help="GiB per GPU (default: the selftest's GPU, else 80)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="weight dtype (default: the config's or preset's, else bf16)")
    p.add_argument("--topk-ratio", type=_ratio, default=0.1, help="ZenFlow topk_ratio")
    p.add_argument("--update-interval", type=_interval, default="auto",
                   help='ZenFlow update_interval, or "auto": the window the optimizer settles at')
    p.add_argument("--device-sum-budget", type=_budget, default="auto",
                   help='GiB of device memory for window sums, or "auto" as the optimizer '
                        "decides it (what is left less a tenth of the GPU)")
    p.add_argument("--activation-gib", type=at_least(0, float), default=None,
                   help="GiB of activations at the peak of forward and backward, which the "
                        "auto device-sum budget leaves room for (default: estimated from the "
                        "shapes, --seq-len and --micro-batch)")
    p.add_argument("--seq-len", type=at_least(1, int), default=4096,
                   help="tokens per sequence, for the activations' estimate (default 4096)")
    p.add_argument("--micro-batch", type=at_least(1, int), default=1,
                   help="sequences per GPU per forward, for the activations' estimate "
                        "(default 1)")
    p.add_argument("--deferred-credit", choices=("moments", "factored", "mean", "window"),
                   default="factored",
                   help="ZenFlow deferred_credit (default: the optimizer's, factored)")
    p.add_argument("--device-sum-dtype", choices=("auto", "float32", "bfloat16"),
                   default="auto", help="ZenFlow device_sum_dtype (default: the optimizer's, "
                                        "auto: bfloat16 for bf16 weights, else float32)")
    p.add_argument("--host-moments-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="ZenFlow host_moments_dtype (default: the optimizer's, float32; "
                        "bfloat16: 4 bytes less host memory a parameter)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="ZenFlow overlap_step")
    p.add_argument("--attach", action=argparse.BooleanOptionalAction, default=False,
                   help="the model is attached to the optimizer (opt.attach(model), or the "
                        "framework callbacks' attach=True): each block's forward waits only for "
                        "its own install (default: off, as zenflow.initialize and the callbacks "
                        "run: the step waits for the whole install)")
    p.add_argument("--fwd-bwd-seconds", type=_above_zero, default=None,
                   help="forward+backward seconds per step on one GPU: the window and the step times "
                        "follow from it (without it they are shown at 0.25-2 s)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="what trains: cuda, or cpu for the CPU proxy (default: the selftest "
                        "JSON's device type, else cuda)")
    p.add_argument("--selftest-json", metavar="FILE", default=None,
                   help="measured figures from `zenflow selftest --json FILE`")
    p.add_argument("--host-sockets", type=at_least(1, int), default=2,
                   help="the server's CPU sockets, for the host's figures the selftest did not "
                        "measure (estimate_host.py)")
    p.add_argument("--host-cores-per-socket", type=at_least(1, int), default=32,
                   help="physical cores per socket")
    p.add_argument("--host-gbps-per-socket", type=_above_zero, default=125.0,
                   help="memory bandwidth per socket, GB/s")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the estimate as JSON")


# Argument types: each refuses a bad value with what it must be and what it got; argparse
# names the argument ("argument --gpus: must be an integer >= 1, got '0'").
def at_least(least: float, kind: type = float):
    what = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value >= least or math.isinf(value):
            raise argparse.ArgumentTypeError(f"must be {what} >= {least:g}, got {text!r}")
        return value
    return parse


def _above_zero(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}")
    return value


def _interval(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f'must be "auto" or an integer >= 1, got {text!r}')
    return value


def _budget(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f'must be "auto" or GiB >= 0, got {text!r}')
    return int(value * GIB)


def _selftest_figures(path: str) -> dict:
    """The measured figures of a `zenflow selftest --json` report."""
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--selftest-json {path}: {exc}") from None
    if not isinstance(report, dict) or not isinstance(report.get("measured", {}), dict):
        raise ValueError(f"--selftest-json {path}: not a `zenflow selftest --json` report")
    return report.get("measured", {})


def required_modules(args: argparse.Namespace) -> list[str]:
    """Optional packages this run needs, checked by `zenflow` before any work starts."""
    return ["transformers"] if args.hf_config else []


def run(args: argparse.Namespace) -> int:
    import torch

    from zenflow.tools import estimate_shapes as shapes_from
    from zenflow.tools.estimate import estimate
    from zenflow.tools.estimate_host import HostMachine
    from zenflow.tools.estimate_report import format_report
    try:
        measured = _selftest_figures(args.selftest_json) if args.selftest_json else None
        if args.hf_config:
            shapes, dtype, how = shapes_from.hf_shapes(args.hf_config)
            source = f"{args.hf_config} ({how})"
        elif args.preset:
            shapes, dtype = shapes_from.preset_shapes(args.preset)
            source = f"bench preset {args.preset}"
        else:
            shapes, dtype, source = shapes_from.parse_shapes(args.shapes), None, "--shapes"
        if args.dtype:
            dtype = shapes_from.DTYPES[args.dtype]
        if args.fsdp is not None and args.gpus not in (None, args.fsdp):
            raise ValueError(f"--fsdp N shards the model over N GPUs: N must be >= 1 and --gpus "
                             f"left out or equal to it, got --fsdp {args.fsdp} --gpus {args.gpus}")
        gpus = args.fsdp or args.gpus or 1
        if args.activation_gib is None:
            activations, activation_note = shapes_from.activation_bytes_guess(
                shapes, args.seq_len, args.micro_batch,
                (dtype or torch.bfloat16).itemsize)
        else:
            activations, activation_note = int(args.activation_gib * GIB), "--activation-gib"
        target = args.device or ("cpu" if measured and str(measured.get("device", "")
                                                             ).startswith("cpu") else "cuda")
        report = estimate(shapes, dtype or torch.bfloat16, gpus=gpus, fsdp=args.fsdp,
                          gpu_memory_bytes=int(args.gpu_memory * GIB) if args.gpu_memory else None,
                          topk_ratio=args.topk_ratio, update_interval=args.update_interval,
                          overlap=args.overlap, fwd_bwd_s=args.fwd_bwd_seconds,
                          measured=measured, target=target, source=source,
                          device_sum_budget=args.device_sum_budget,
                          activation_bytes=activations, activation_note=activation_note,
                          deferred_credit=args.deferred_credit, attached=args.attach,
                          device_sum_dtype=args.device_sum_dtype,
                          host_moments_dtype=args.host_moments_dtype,
                          host=HostMachine(args.host_sockets, args.host_cores_per_socket,
                                           args.host_gbps_per_socket))
    except (ValueError, OSError) as exc:
        print(f"zenflow estimate: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"\nwrote {args.json}")
    return 0
