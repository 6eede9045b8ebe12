"""Data parallel ZenFlow: what each rank moves to its host, what crosses the network, host memory.

Trains the bench GPT for a few steps on 1, 2 and 4 ranks (gloo on 127.0.0.1 here; on a
multi-GPU machine the same script runs NCCL with --backend nccl), once with DDP (every rank a
replica) and once sharded with FSDP2 (`fully_shard` per block and at the root), and reports, per
rank, from the optimizer's own counters (bytes only; nothing is timed):

  - device bytes: the weights (and as many of gradients) each rank holds, and ZenFlow's device
    state (selected columns, vectors);

  - gradient bytes copied device->host per step (each rank copies only the rows it owns) and
    weight bytes copied host->device per window;
  - bytes each rank sent per collective purpose (column-norm exchange, installing host rows,
    window decisions), per step and per window;
  - the column-norm exchange of one selection against an all-gather of the gradients, which is
    what choosing the same top-k columns on every rank would cost without the norm proxy;
  - host memory per rank (master, moments and gradient sums, staging and install buffers).

    python benchmarks/scaling.py [--n-layer 4 --n-embd 768 --steps 12 --ranks 1 2 4
                                  --layouts ddp fsdp2]

Writes benchmarks/results/scaling.json and scaling.png.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zenflow
from zenflow.distributed import local
from zenflow.tools.bench.harness import machine_info
from zenflow.tools.bench.model import GPT, GPTConfig, TokenStream


def train(args, rank: int, world: int, layout: str = "ddp") -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                    vocab_size=args.vocab_size, seq_len=32)
    device = torch.device("cuda", torch.cuda.current_device()) if args.backend == "nccl" \
        else torch.device("cpu")
    model = GPT(cfg).to(device)
    if world > 1 and layout == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    weight_bytes = sum(local(p).numel() * p.element_size() for p in model.parameters())
    stream = TokenStream(cfg.vocab_size, cfg.seq_len, batch_size=2, seed=rank)
    opt = zenflow.ZenFlowAdamW(model.parameters(), lr=3e-4, topk_ratio=0.1, update_interval=4,
                               select_strategy="step", select_interval=4, overlap_step=True,
                               worker=False)
    for t in range(args.steps):
        x, y = (b.to(device) for b in stream.batch(t))
        loss = torch.nn.functional.cross_entropy(model(x).view(-1, cfg.vocab_size), y.view(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"\r{world} rank(s): step {t + 1}/{args.steps}", end="", file=sys.stderr,
                  flush=True)
    if rank == 0:
        print(file=sys.stderr)
    stats = opt.stats()
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    opt.close()
    return {"rank": rank, "world_size": world, "layout": layout,
            "backend": dist.get_backend() if world > 1 else None,
            "device_weight_bytes": weight_bytes,
            "device_state_bytes": stats["device_state_bytes"],
            "host_bytes": stats["host_bytes"], "steps": stats["steps"],
            "windows": stats["windows"], "selections": stats["reselections"] + 1,
            "collective_bytes_sent": stats["collective_bytes_sent"],
            "d2h_bytes_total": stats["d2h_bytes_total"], "h2d_bytes_total": stats["h2d_bytes_total"],
            "d2h_bytes_per_step": stats["d2h_bytes_per_step"],
            "h2d_bytes_per_window": stats["h2d_bytes_total"] / max(1, stats["windows"]),
            # the whole model's (a DTensor's shape is the whole parameter's)
            "num_params": sum(p.numel() for p in model.parameters()),
            "matrix_elements": sum(p.numel() for p in matrices),
            "matrix_columns": sum(p.numel() // p.shape[0] for p in matrices)}


def _rank(rank, world, port, args, out_dir, layout):
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    result = train(args, rank, world, layout)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def run_ranks(args, world: int, layout: str = "ddp") -> list[dict]:
    if world == 1:   # one process: replicas and shards are the same thing
        return [train(args, rank=0, world=1, layout=layout)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank, args=(world, port, args, out_dir, layout), nprocs=world, join=True)
        return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world)]


def summarize(ranks: list[dict]) -> dict:
    """Per-rank numbers of one world size (rank 0's collectives; every rank sends as much)."""
    r0 = ranks[0]
    sent = r0["collective_bytes_sent"]
    return {
        "world_size": r0["world_size"], "layout": r0["layout"],
        "device_weight_bytes_per_rank": [r["device_weight_bytes"] for r in ranks],
        "device_state_bytes_per_rank": [r["device_state_bytes"] for r in ranks],
        "host_bytes_per_rank": [r["host_bytes"] for r in ranks],
        "d2h_bytes_per_step_per_rank": [r["d2h_bytes_per_step"] for r in ranks],
        "h2d_bytes_per_window_per_rank": [r["h2d_bytes_per_window"] for r in ranks],
        "collective_bytes_per_step": {k: v / r0["steps"] for k, v in sent.items()},
        "collective_bytes_per_window": {k: v / max(1, r0["windows"]) for k, v in sent.items()},
        "collective_bytes_per_step_total": sum(sent.values()) / r0["steps"],
        "windows": r0["windows"], "steps": r0["steps"], "selections": r0["selections"],
    }


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, (a, b, c, d) = plt.subplots(1, 4, figsize=(19, 4))
    labels = [f"{r['layout'].upper()}\n{r['world_size']} rank{'s' if r['world_size'] > 1 else ''}"
              for r in runs]
    colors = ["C0" if r["layout"] == "ddp" else "C4" for r in runs]
    a.bar(labels, [max(r["host_bytes_per_rank"]) / 2**20 for r in runs], color=colors)
    a.set_ylabel("host memory per rank (MiB, largest rank)")
    a.set_title("host state is partitioned (both)")
    b.bar(labels, [max(w + s for w, s in zip(r["device_weight_bytes_per_rank"],
                                              r["device_state_bytes_per_rank"])) / 2**20
                   for r in runs], color=colors)
    b.set_ylabel("device MiB per rank: weights + ZenFlow state")
    b.set_title("FSDP2 shards the device side too")
    c.bar(labels, [max(r["d2h_bytes_per_step_per_rank"]) / 2**20 for r in runs], color=colors)
    c.set_ylabel("gradient MiB per step to the host, per rank")
    c.set_title("each rank copies only its rows")
    sel = result["selection"]
    d.bar(["column-norm exchange", "all-gather of gradients"],
          [sel["norm_exchange_bytes"], sel["gradient_allgather_bytes"]], color=["C2", "C3"])
    d.set_yscale("log")
    d.set_ylabel("bytes each rank sends per selection")
    d.set_title(f"selection traffic: {sel['ratio']:.0f}x less")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layouts", nargs="+", default=["ddp", "fsdp2"],
                        choices=("ddp", "fsdp2"))
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "scaling"))
    args = parser.parse_args()

    one_process = run_ranks(args, 1) if 1 in args.ranks else None
    per_run = {(layout, w): ([dict(r, layout=layout) for r in one_process] if w == 1 else
                             run_ranks(args, w, layout))
               for layout in args.layouts for w in args.ranks}
    runs = [summarize(ranks) for ranks in per_run.values()]
    first = per_run[(args.layouts[0], min(args.ranks))]
    one = first[0]
    multi = [key for key in per_run if key[1] > 1]
    r0 = per_run[multi[0]][0] if multi else one
    norm_bytes = r0["collective_bytes_sent"].get("exchanging column norms", 0) / r0["selections"]
    grad_bytes = r0["matrix_elements"] * 4  # each rank's fp32 matrix gradients
    base = summarize(first)

    def shrink(r: dict, key: str) -> float:
        return max(r[key]) / max(base[key])

    result = {
        "machine": machine_info("cuda" if args.backend == "nccl" else "cpu"),
        "settings": vars(args), "num_params": one["num_params"],
        "runs": runs, "raw": {f"{layout}-{w}": ranks for (layout, w), ranks in per_run.items()},
        "selection": {"norm_exchange_bytes": norm_bytes, "gradient_allgather_bytes": grad_bytes,
                      "ratio": grad_bytes / norm_bytes if norm_bytes else None,
                      "columns": one["matrix_columns"]},
        "shrink_vs_first": {f"{r['layout']}-{r['world_size']}": {
            key.removesuffix("_per_rank"): shrink(r, key)
            for key in ("host_bytes_per_rank", "d2h_bytes_per_step_per_rank",
                        "device_weight_bytes_per_rank", "device_state_bytes_per_rank")}
            for r in runs},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(f"model: {one['num_params'] / 1e6:.1f}M parameters, backend {args.backend}; per rank, "
          "largest rank (x: against one process)")
    for r in runs:
        key, mib = f"{r['layout']}-{r['world_size']}", 2 ** 20
        shrunk = result["shrink_vs_first"][key]
        print(f"{r['layout'].upper():>5} {r['world_size']} rank(s): device weights "
              f"{max(r['device_weight_bytes_per_rank']) / mib:7.1f} MiB "
              f"({shrunk['device_weight_bytes']:.2f}x), device state "
              f"{max(r['device_state_bytes_per_rank']) / mib:6.2f} MiB "
              f"({shrunk['device_state_bytes']:.2f}x), host {max(r['host_bytes_per_rank']) / mib:7.1f}"
              f" MiB ({shrunk['host_bytes']:.2f}x), to host per step "
              f"{max(r['d2h_bytes_per_step_per_rank']) / mib:6.2f} MiB "
              f"({shrunk['d2h_bytes_per_step']:.2f}x), to device per window "
              f"{max(r['h2d_bytes_per_window_per_rank']) / mib:6.2f} MiB")
        for what, per_step in r["collective_bytes_per_step"].items():
            print(f"    sends {per_step / 1e6:8.3f} MB/step, "
                  f"{r['collective_bytes_per_window'][what] / 1e6:8.3f} MB/window for {what}")
    if norm_bytes:
        print(f"selection: {norm_bytes / 1e3:.1f} kB of column norms per rank instead of "
              f"{grad_bytes / 1e6:.1f} MB of gradients ({result['selection']['ratio']:.0f}x less)")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
