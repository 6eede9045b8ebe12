"""`zenflow bench`: train the same GPT on the same tokens with each system, side by side."""
from __future__ import annotations

import argparse
import json
import os
import sys

from zenflow.tools.bench.system_names import SYSTEMS

# The seeds' zenflow block (DeepSpeed tutorial); both ZenFlows get exactly these settings.
SEED_ZENFLOW_BLOCK = {"topk_ratio": 0.05, "select_strategy": "auto", "select_interval": "auto",
                      "update_interval": 4, "full_warm_up_rounds": 0}

PRESETS: dict[str, dict] = {
    # Optimizer-bound on a 2-core CPU: ~92M parameters, wide layers, only 32 tokens per step.
    "cpu-small": dict(device="cpu", dtype="float32", n_layer=6, n_embd=1024, n_head=16,
                      vocab_size=8192, seq_len=32, batch_size=1, warmup=4, steps=8, rounds=2),
    # Llama-2-7B's layout (32 layers of q, k, v, o, gate, up, down: 226 matrices) at width 896:
    # ~316M parameters, which every system fits in 24 GiB of host memory.
    "cpu-llama": dict(device="cpu", dtype="float32", arch="llama", n_layer=32, n_embd=896,
                      n_head=14, ffn=2304, vocab_size=8192, seq_len=32, batch_size=1, warmup=4,
                      steps=8, rounds=2),
    # ~1.0B and ~3.0B parameters in bf16 for one GPU.
    "gpu-1b": dict(device="cuda", dtype="bfloat16", n_layer=18, n_embd=2048, n_head=16,
                   vocab_size=32000, seq_len=512, batch_size=4, warmup=8, steps=16, rounds=2),
    "gpu-3b": dict(device="cuda", dtype="bfloat16", n_layer=36, n_embd=2560, n_head=20,
                   vocab_size=32000, seq_len=512, batch_size=4, warmup=8, steps=16, rounds=2),
}
DEFAULTS = dict(PRESETS["cpu-small"], device=None)
DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="a named size; explicit options below override its values (default: "
                        "none, which runs cpu-small's values)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of: {', '.join(SYSTEMS)} (default: all; "
                        "DeepSpeed systems are skipped when deepspeed is not importable)")
    m = p.add_argument_group("model and data (defaults: the preset's, else cpu-small's)")
    for name, what in (("n_layer", "transformer layers"), ("n_embd", "model width"),
                       ("n_head", "attention heads"), ("vocab_size", "vocabulary size"),
                       ("seq_len", "tokens per sequence"), ("batch_size", "sequences per step")):
        m.add_argument("--" + name.replace("_", "-"), dest=name, type=int,
                       help=f"{what} (default: {DEFAULTS[name]} with cpu-small)")
    r = p.add_argument_group("run")
    r.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    r.add_argument("--dtype", choices=DTYPES,
                   help=f"weight dtype (default: {DEFAULTS['dtype']} with cpu-small)")
    r.add_argument("--steps", type=int,
                   help=f"measured steps per round (default: {DEFAULTS['steps']} with cpu-small)")
    r.add_argument("--warmup", type=int, help="steps per round excluded from the statistics "
                                              f"(default: {DEFAULTS['warmup']} with cpu-small)")
    r.add_argument("--rounds", type=int, help="rounds; each system runs once per round in a fresh "
                                              f"process (default: {DEFAULTS['rounds']} with cpu-small)")
    r.add_argument("--timeline-steps", type=int, default=8,
                   help="steps per system kept for the timeline plot")
    r.add_argument("--main-threads", type=int, default=1,
                   help="torch threads in each system's main process (default 1, leaving the "
                        "other cores to host-update workers)")
    r.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    r.add_argument("--eval-batches", type=int, default=8,
                   help="held-out batches for the final eval loss")
    r.add_argument("--child-timeout", type=float, default=900.0, help="seconds per child process")
    o = p.add_argument_group("optimizer (identical for every system)")
    o.add_argument("--lr", type=float, default=3e-4, help="learning rate")
    o.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    o.add_argument("--topk-ratio", type=float, default=SEED_ZENFLOW_BLOCK["topk_ratio"],
                   help="fraction of columns updated on the device (both ZenFlows)")
    o.add_argument("--update-interval", type=int, default=SEED_ZENFLOW_BLOCK["update_interval"],
                   help="steps per host window (both ZenFlows)")
    o.add_argument("--select-interval", default=SEED_ZENFLOW_BLOCK["select_interval"],
                   help='"auto" or a number of steps between column reselections (both ZenFlows)')
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write the full report as JSON (default: no file)")
    out.add_argument("--plot", metavar="PATH",
                     help="write step-time bars (PATH) and a timeline (PATH with _timeline) as "
                          "PNG; needs matplotlib (default: no plot)")


def required_modules(args: argparse.Namespace) -> list[str]:
    """Optional packages this run needs, checked by `zenflow` before any work starts."""
    return ["matplotlib"] if args.plot else []


def build_spec(args: argparse.Namespace) -> tuple[dict, list[str], int]:
    """Validate the arguments and turn them into the child spec, the systems and the rounds."""
    base = dict(PRESETS[args.preset]) if args.preset else dict(DEFAULTS)
    for key in list(base):
        value = getattr(args, key, None)
        if value is not None:
            base[key] = value
    if base["device"] is None:
        import torch
        base["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    if base["device"] == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available to this torch build")
    for key in ("steps", "rounds", "batch_size"):
        if base[key] < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {base[key]}")
    if base["warmup"] < 0:
        raise ValueError(f"--warmup must be >= 0, got {base['warmup']}")
    for key, least in (("main_threads", 1), ("eval_batches", 1), ("timeline_steps", 0)):
        if getattr(args, key) < least:
            raise ValueError(f"--{key.replace('_', '-')} must be >= {least}, got {getattr(args, key)}")
    if not 0.0 <= args.topk_ratio <= 1.0:
        raise ValueError(f"--topk-ratio must be in [0, 1], got {args.topk_ratio}")
    select_interval = args.select_interval
    if select_interval != "auto":
        try:
            select_interval = int(select_interval)
        except ValueError:
            select_interval = 0
        if select_interval < 1:
            raise ValueError(f'--select-interval must be "auto" or an integer >= 1, '
                             f"got {args.select_interval!r}")
    if args.update_interval < 1:
        raise ValueError(f"--update-interval must be >= 1, got {args.update_interval}")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise ValueError(f"--systems: unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
                         f"choose from {', '.join(SYSTEMS)}")
    model = {k: base[k] for k in ("n_layer", "n_embd", "n_head", "vocab_size", "seq_len")}
    model.update({k: base[k] for k in ("arch", "ffn") if k in base})
    from zenflow.tools.bench.model import GPTConfig
    GPTConfig(**model)  # validates sizes before any child starts
    spec = {
        "preset": args.preset, "device": base["device"], "dtype": base["dtype"], "model": model,
        "num_params": GPTConfig(**model).num_params(),
        "batch_size": base["batch_size"], "steps": base["steps"], "warmup": base["warmup"],
        "timeline_steps": args.timeline_steps, "main_threads": args.main_threads, "seed": args.seed,
        "eval_batches": args.eval_batches,
        "lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": args.weight_decay,
        "zenflow": dict(SEED_ZENFLOW_BLOCK, topk_ratio=args.topk_ratio,
                        update_interval=args.update_interval, select_interval=select_interval,
                        # DeepSpeed refuses an integer interval with strategy "auto" (it means
                        # once per epoch there); a step count needs strategy "step" in both.
                        select_strategy="auto" if select_interval == "auto" else "step"),
    }
    return spec, systems, base["rounds"]


def run(args: argparse.Namespace) -> int:
    from zenflow.tools.bench import harness
    from zenflow.tools.bench.report import format_table
    try:
        spec, systems, rounds = build_spec(args)
    except ValueError as exc:
        print(f"zenflow bench: error: {exc}", file=sys.stderr)
        return 2
    report = harness.run_benchmark(spec, systems, rounds, child_timeout_s=args.child_timeout)
    print()
    print(format_table(report))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.json}")
    if args.plot:
        from zenflow.tools.bench import plots
        for path in plots.write_plots(report, args.plot):
            print(f"wrote {path}")
    ok = any(e.get("summary") for e in report["systems"].values())
    return 0 if ok else 1
