"""Data parallel ZenFlow: what crosses the network for selection, and host memory per rank.

Trains the bench GPT for a few steps on 1 rank and on 2 ranks (gloo on 127.0.0.1 here; on a
multi-GPU machine the same script runs NCCL with --backend nccl) and reports, from the
optimizer's own counters:

  - bytes each rank sent per collective purpose (column-norm exchange, installing host rows,
    window decisions) per step;
  - the column-norm exchange of one selection against an all-gather of the gradients, which is
    what choosing the same top-k columns on every rank would cost without the norm proxy;
  - host memory per rank (master, moments and gradient sums) for 1 and 2 ranks.

    python benchmarks/scaling.py [--n-layer 4 --n-embd 768 --steps 12]

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
from zenflow.bench.harness import machine_info
from zenflow.bench.model import GPT, GPTConfig, TokenStream


def train(args, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                    vocab_size=args.vocab_size, seq_len=32)
    model = GPT(cfg)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    stream = TokenStream(cfg.vocab_size, cfg.seq_len, batch_size=2, seed=rank)
    opt = zenflow.ZenFlowAdamW(model.parameters(), lr=3e-4, topk_ratio=0.1, update_interval=4,
                               select_strategy="step", select_interval=4, overlap_step=True,
                               worker=False)
    for t in range(args.steps):
        x, y = stream.batch(t)
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
    return {"host_bytes": stats["host_bytes"], "steps": stats["steps"],
            "selections": stats["reselections"] + 1,
            "collective_bytes_sent": stats["collective_bytes_sent"],
            "num_params": sum(p.numel() for p in model.parameters()),
            "matrix_elements": sum(p.numel() for p in matrices),
            "matrix_columns": sum(p.numel() // p.shape[0] for p in matrices)}


def _rank(rank, world, port, args, out_dir):
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    result = train(args, rank, world)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def run_two_ranks(args) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank, args=(2, port, args, out_dir), nprocs=2, join=True)
        return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(2)]


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    mem = [result["one_rank"]["host_bytes"] / 2**20,
           result["two_ranks"][0]["host_bytes"] / 2**20,
           result["two_ranks"][1]["host_bytes"] / 2**20]
    a.bar(["1 rank", "2 ranks: rank 0", "2 ranks: rank 1"], mem, color=["C0", "C1", "C1"])
    a.set_ylabel("host memory per rank (MiB)")
    a.set_title("host state is partitioned")
    sel = result["selection"]
    b.bar(["column-norm exchange", "all-gather of gradients"],
          [sel["norm_exchange_bytes"], sel["gradient_allgather_bytes"]], color=["C2", "C3"])
    b.set_yscale("log")
    b.set_ylabel("bytes each rank sends per selection")
    b.set_title(f"selection traffic: {sel['ratio']:.0f}x less")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "scaling"))
    args = parser.parse_args()

    one = train(args, rank=0, world=1)
    two = run_two_ranks(args)
    sent = two[0]["collective_bytes_sent"]
    norm_bytes = sent.get("exchanging column norms", 0) / two[0]["selections"]
    grad_bytes = two[0]["matrix_elements"] * 4  # each rank's fp32 matrix gradients
    result = {
        "machine": machine_info("cpu"), "settings": vars(args), "num_params": one["num_params"],
        "one_rank": one, "two_ranks": two,
        "per_step_bytes_sent_rank0": {k: v / two[0]["steps"] for k, v in sent.items()},
        "selection": {"norm_exchange_bytes": norm_bytes, "gradient_allgather_bytes": grad_bytes,
                      "ratio": grad_bytes / norm_bytes if norm_bytes else None,
                      "columns": two[0]["matrix_columns"]},
        "host_bytes_ratio_two_to_one": two[0]["host_bytes"] / one["host_bytes"],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(f"model: {one['num_params'] / 1e6:.1f}M parameters")
    print(f"host memory per rank: 1 rank {one['host_bytes'] / 2**20:.0f} MiB, 2 ranks "
          f"{two[0]['host_bytes'] / 2**20:.0f} + {two[1]['host_bytes'] / 2**20:.0f} MiB "
          f"({result['host_bytes_ratio_two_to_one']:.2f}x of 1 rank each)")
    print(f"selection: {norm_bytes / 1e3:.1f} kB of column norms per rank instead of "
          f"{grad_bytes / 1e6:.1f} MB of gradients ({result['selection']['ratio']:.0f}x less)")
    for what, per_step in result["per_step_bytes_sent_rank0"].items():
        print(f"  rank 0 sends {per_step / 1e6:8.3f} MB/step for {what}")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
