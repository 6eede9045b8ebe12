"""Fine-tuning quality: does ZenFlow fine-tune a pretrained causal LM as well as AdamW?

A byte-level GPT (zenflow.tools.bench.model.GPT: 4 layers, context 64) is pretrained with AdamW on
one corpus (cached after the first run), then fine-tuned on the other with each optimizer, over
several seeds (the seed sets the batch order; the pretrained weights and the data split never
change). Two directions: Shakespeare -> BBC News at width 128 (the default) and BBC News ->
Shakespeare at width 256. Each run is scored after `synchronize()` on held-out text of the new
domain and of the old one. Within a seed the systems run in a rotated order. Writes
benchmarks/results/<name>.json and <name>.png.

The default systems are the windows a GPU runs: on a GPU the device is several times faster than
the host, so ZenFlow's windows are 4-16 steps long, where on this CPU machine the host keeps up
after one step. Fixed `update_interval` 4 and 8, and the default auto windows with the host
emulated as slow (`emulated_host_steps`, a benchmark-only setting of
zenflow.tools.finetune.optim.make_optimizer), show what a GPU user gets.

    python benchmarks/finetune_quality.py                       # the default comparison
    python benchmarks/finetune_quality.py --direction bbc-to-shakespeare --seeds 0
    python benchmarks/finetune_quality.py --systems AdamW "ZenFlow default" --seeds 0

`--dtype bf16`: the model's parameters (and so its gradients) in bf16, as a GPU fine-tune keeps
them, against `OffloadAdamW` (fp32 master weights and moments, the weights rounded to bf16 after
every step: what ZeRO-Offload computes) as the baseline instead of torch's AdamW (which would keep
bf16 moments on a bf16 model). This CPU has no bf16 matrix units (a bf16 forward and backward is
10-17x slower than fp32 here), so by default the forward and backward run in fp32 on the exact
fp32 values of the bf16 parameters and the gradients come back rounded to bf16
(`--bf16-compute emulated`); `--bf16-compute native` runs them in bf16 (a spot check).
Held-out losses are always computed in fp32 arithmetic on the (bf16) weights. `--lr-ulp F` sets
the peak learning rate to F bf16 ulps of the median matrix weight (|w|) of the pretrained model:
0.1 is a 7B fine-tune's regime (lr 2e-5 on weights of ~0.02), where an AdamW step rounds away in
bf16 unless it lands on a master copy. Each system's share of the baseline's improvement over the
pretrained model, (L0 - L) / (L0 - L_base), is in the summary too.

    python benchmarks/finetune_quality.py --dtype bf16 --systems OffloadAdamW "moments, U=4"
    python benchmarks/finetune_quality.py --dtype bf16 --lr-ulp 0.1 --systems OffloadAdamW ...

`--ranks N`: the ZenFlow systems train as N data-parallel replicas (gloo ranks on this machine,
spawned by torch.multiprocessing; each the same model and seed, each 1/N of every batch; the
gradients widened to fp32, averaged by one all_reduce before step() and rounded back; each rank a
plain ZenFlowAdamW, under which "factored" fits each rank's row block: docs/semantics.md); the
other systems in one process, the same full-batch training. Runs record `ranks`.

    python benchmarks/finetune_quality.py --dtype bf16 --ranks 2 --systems "factored, 2.5 B/param, U=4"
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from zenflow.tools.bench.harness import machine_info
from zenflow.tools.bench.model import GPT, GPTConfig
from zenflow.tools.finetune.optim import make_optimizer


@dataclass(frozen=True)
class Direction:
    pretrain: str        # corpus the model is pretrained on (the old domain)
    finetune: str        # corpus it is fine-tuned on (the new domain)
    model: GPTConfig


DIRECTIONS = {
    "shakespeare-to-bbc": Direction("shakespeare", "bbc", GPTConfig(
        n_layer=4, n_embd=128, n_head=4, vocab_size=256, seq_len=64)),
    "bbc-to-shakespeare": Direction("bbc", "shakespeare", GPTConfig(
        n_layer=4, n_embd=256, n_head=4, vocab_size=256, seq_len=64)),
}


@dataclass(frozen=True)
class System:
    kind: str                       # make_optimizer's kind
    kwargs: dict                    # ZenFlow settings
    emulated_host_steps: int = 0    # auto windows: the host as slow as on a GPU
    # A device budget an offloading user has: device_sum_budget = this many bytes per matrix
    # element of the model (0: the kwargs' own budget). 2.5: Llama-2-7B bf16 on one 80 GB H100
    # beside 20 GiB of activations; 5.7: the same with no activations (README, "zenflow estimate").
    budget_bytes_per_param: float = 0.0
    # A prototype rule (benchmarks/prototypes/bf16_rules.py): kind "prototype", kwargs its
    # settings.


# The seeds' ZenFlow block (DeepSpeed's zf_config.json): k=0.05, U=4, overlap, select "auto",
# DeepSpeed's arithmetic (one AdamW step per window on the mean gradient, no lookahead).
SEEDS_BLOCK = dict(topk_ratio=0.05, update_interval=4, install_lookahead=0.0)
MOMENTS = dict(deferred_credit="moments", device_sum_budget=1 << 40)
BF16_SUMS = dict(deferred_credit="mean", device_sum_budget=1 << 40, device_sum_dtype="bfloat16")
SYSTEMS = {
    "AdamW": System("adamw", {}),
    "OffloadAdamW": System("offload", {}),
    # The defaults, with the windows this machine gives them (one step: the host keeps up).
    "ZenFlow default": System("zenflow", {}),
    # The windows a GPU runs.
    "seeds' block, U=4": System("zenflow", SEEDS_BLOCK),
    "seeds' block, U=8": System("zenflow", dict(SEEDS_BLOCK, update_interval=8)),
    "defaults, U=4": System("zenflow", dict(update_interval=4)),
    "defaults, U=8": System("zenflow", dict(update_interval=8)),
    "defaults, host 4 steps slow": System("zenflow", {}, emulated_host_steps=4),
    "defaults, host 8 steps slow": System("zenflow", {}, emulated_host_steps=8),
    # deferred_credit="moments" where the window sums fit the device, as a GPU's budget holds
    # them (emulated: the CPU "device", which by default sums nothing, gets a budget for all).
    "moments, one-step windows": System("zenflow", dict(MOMENTS)),
    "moments, U=4": System("zenflow", dict(MOMENTS, update_interval=4)),
    "moments, U=8": System("zenflow", dict(MOMENTS, update_interval=8)),
    "moments, host 4 steps slow": System("zenflow", dict(MOMENTS), emulated_host_steps=4),
    # The bf16 table (issue 36): "mean" with fp32 sums (on the host here; the same additions bit
    # for bit as fp32 device sums) and with bf16 device sums; "moments" with the budget an
    # offloading user has.
    "mean, fp32 sums, U=4": System("zenflow", dict(update_interval=4, deferred_credit="mean")),
    "mean, fp32 sums, U=8": System("zenflow", dict(update_interval=8, deferred_credit="mean")),
    "mean, bf16 sums, U=4": System("zenflow", dict(update_interval=4, **BF16_SUMS)),
    "mean, bf16 sums, U=8": System("zenflow", dict(update_interval=8, **BF16_SUMS)),
    "mean, host 4 steps slow": System("zenflow", dict(deferred_credit="mean"),
                                      emulated_host_steps=4),
    "moments, 2.5 B/param, U=4": System("zenflow", dict(
        deferred_credit="moments", device_sum_dtype="bfloat16", update_interval=4), 0, 2.5),
    "moments, 2.5 B/param, U=8": System("zenflow", dict(
        deferred_credit="moments", device_sum_dtype="bfloat16", update_interval=8), 0, 2.5),
    # deferred_credit="factored" (the prototype's "factored", rounded to nearest) with bf16 sums
    # in the budget an offloading user has
    "factored, 2.5 B/param, U=4": System("zenflow", dict(
        deferred_credit="factored", device_sum_dtype="bfloat16", update_interval=4), 0, 2.5),
    "factored, 2.5 B/param, U=8": System("zenflow", dict(
        deferred_credit="factored", device_sum_dtype="bfloat16", update_interval=8), 0, 2.5),
    # The auto windows `zenflow estimate` predicts with its defaults for Llama-2-7B bf16 on one
    # H100 (forward+backward 0.5 s, 20 GiB of activations; benchmarks/README.md, bf16), the
    # defaults with the host emulated that many steps slow: 14 steps; 16, the longest "auto"
    # window, since the estimate models the host as placed and the fused device step (the
    # install's bus time asks for 18); with an H100's PCIe Gen5 link (estimate_llama2_7b.py's
    # "1xH100") 10, and 5 with the model attached (per-layer installs: the forward hides part of
    # the copy); with "auto"'s install budget at 8% of the window (zenflow/optim/windows.py) 7,
    # 3 attached, and 5 on 4xA100 (4 and the step after the ranks' vote); 3 on 4xA100 attached
    # since DDP's installs went per layer (2 and the vote)
    **{f"factored, 2.5 B/param, host {steps} steps slow": System("zenflow", dict(
        deferred_credit="factored", device_sum_dtype="bfloat16"), steps, 2.5)
       for steps in (14, 16, 10, 5, 7, 3, 4, 2)},
    # ... with Adam's moments in bf16 on the host (host_moments_dtype, issue 37): 4 bytes less
    # host memory a parameter
    "factored, bf16 host moments, U=4": System("zenflow", dict(
        deferred_credit="factored", device_sum_dtype="bfloat16", update_interval=4,
        host_moments_dtype="bfloat16"), 0, 2.5),
    "factored, bf16 host moments, U=8": System("zenflow", dict(
        deferred_credit="factored", device_sum_dtype="bfloat16", update_interval=8,
        host_moments_dtype="bfloat16"), 0, 2.5),
    "factored, bf16 host moments, host 16 steps slow": System("zenflow", dict(
        deferred_credit="factored", device_sum_dtype="bfloat16",
        host_moments_dtype="bfloat16"), 16, 2.5),
    "moments, 5.7 B/param, U=4": System("zenflow", dict(
        deferred_credit="moments", update_interval=4), 0, 5.7),
    "moments, 5.7 B/param, U=8": System("zenflow", dict(
        deferred_credit="moments", update_interval=8), 0, 5.7),
    # Options measured before (one-step windows unless said).
    "ZenFlow DeepSpeed auto (auto_ratio=0.99)": System("zenflow", dict(auto_ratio=0.99,
                                                                        install_lookahead=0.0)),
    "ZenFlow sync U=4": System("zenflow", dict(update_interval=4, overlap_step=False)),
    "ZenFlow sync U=4, window credit": System("zenflow", dict(
        update_interval=4, overlap_step=False, deferred_credit="window")),
    "ZenFlow U=4, window credit": System("zenflow", dict(update_interval=4,
                                                         deferred_credit="window")),
    "ZenFlow k=0.2, U=4": System("zenflow", dict(topk_ratio=0.2, update_interval=4)),
}


def _prototype_systems() -> dict[str, System]:
    """The candidate rules of benchmarks/prototypes/bf16_rules.py, as "proto <name>"."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "prototypes"))
    from bf16_rules import CANDIDATES
    return {f"proto {name}": System("prototype", settings) for name, settings in CANDIDATES.items()}


SYSTEMS.update(_prototype_systems())
# The GPU regime: 7 systems x 3 seeds, about 25 minutes on the 2-core machine (width 128).
DEFAULT_SYSTEMS = ["AdamW", "ZenFlow default", "seeds' block, U=4", "defaults, U=4",
                   "seeds' block, U=8", "defaults, U=8", "defaults, host 4 steps slow"]


@dataclass(frozen=True)
class Setting:
    pretrain_steps: int = 1500
    pretrain_lr: float = 1e-3
    steps: int = 300
    lr: float = 5e-4
    dtype: str = "fp32"          # the model's parameters: "fp32" or "bf16"
    compute: str = "native"      # bf16: "emulated" (fp32 forward and backward) or "native"
    warmup: int = 20
    batch_size: int = 32
    max_grad_norm: float = 1.0
    weight_decay: float = 0.01
    eval_windows: int = 512


# -- data -------------------------------------------------------------------------------------
SEQ_LEN = 64   # both directions' context
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def corpora(direction: Direction) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{'old': the pretraining corpus (train, test), 'new': the fine-tuning one} as byte tensors.
    Held-out text is whole plays / whole articles never seen in training."""
    from zenflow.tools.finetune.data import bbc_news_articles, shakespeare_bytes, split_by_article

    def as_tensor(data: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    shakespeare_train, shakespeare_test, _ = shakespeare_bytes(seed=0, n_test=4)
    bbc_train, bbc_test = split_by_article(bbc_news_articles(), test_fraction=0.2, seed=0)
    join = lambda ex: "\n\n".join(e.text_a for e in ex).encode("utf-8")
    corpus = {"shakespeare": (as_tensor(shakespeare_train), as_tensor(shakespeare_test)),
              "bbc": (as_tensor(join(bbc_train)), as_tensor(join(bbc_test)))}
    return {"old": corpus[direction.pretrain], "new": corpus[direction.finetune]}


def batch(stream: torch.Tensor, batch_size: int, generator: torch.Generator):
    starts = torch.randint(len(stream) - SEQ_LEN - 1, (batch_size,), generator=generator)
    seq = torch.stack([stream[s:s + SEQ_LEN + 1] for s in starts.tolist()])
    return seq[:, :-1], seq[:, 1:]


def forward(model: GPT, x: torch.Tensor, y: torch.Tensor, compute: str = "native") -> torch.Tensor:
    """The model's loss. `compute="emulated"` (a bf16 model on a CPU without bf16 matrix units):
    the forward and backward run in fp32 on the exact fp32 values of the parameters, and each
    parameter's gradient comes back through the upcast rounded to the parameter's dtype."""
    if compute == "native" or all(p.dtype == torch.float32 for p in model.parameters()):
        return model(x, y)
    params = {name: p.float() for name, p in model.named_parameters()}
    return torch.func.functional_call(model, params, (x, y))


@torch.no_grad()
def held_out_loss(model: GPT, stream: torch.Tensor, windows: int) -> float:
    """Mean next-byte loss over `windows` evenly spaced windows of the held-out stream, in fp32
    arithmetic on the model's weights (a bf16 model's weights widened exactly)."""
    model.eval()
    span = SEQ_LEN + 1
    starts = torch.linspace(0, len(stream) - span - 1, windows).long().tolist()
    total = 0.0
    for i in range(0, windows, 128):
        seq = torch.stack([stream[s:s + span] for s in starts[i:i + 128]])
        total += float(forward(model, seq[:, :-1], seq[:, 1:], "emulated")) * len(seq)
    model.train()
    return total / windows


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 numbers at |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


def median_matrix_weight(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> float:
    """The median |w| over every element of the matrices (ndim >= 2), in `dtype`."""
    values = torch.cat([w.to(dtype).float().abs().flatten() for w in weights.values()
                        if w.ndim >= 2])
    return float(values.median())


def schedule(step: int, warmup: int, total: int) -> float:
    """Linear warm-up, then linear decay to zero."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


# -- pretraining (cached) -----------------------------------------------------------------------
def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "zenflow" / "finetune_quality"


def pretrained(setting: Setting, direction: Direction, data,
               progress: bool) -> dict[str, torch.Tensor]:
    key = [asdict(direction.model), setting.pretrain_steps, setting.pretrain_lr,
           setting.batch_size, torch.__version__]
    if direction.pretrain != "shakespeare":   # the first direction's cache keeps its name
        key.append(direction.pretrain)
    key = json.dumps(key, sort_keys=True)
    path = cache_dir() / f"pretrained-{hashlib.sha256(key.encode()).hexdigest()[:12]}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    torch.manual_seed(0)
    model = GPT(direction.model)
    opt = torch.optim.AdamW(model.parameters(), lr=setting.pretrain_lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1234)
    train = data["old"][0]
    for step in range(setting.pretrain_steps):
        for group in opt.param_groups:
            group["lr"] = setting.pretrain_lr * schedule(step, 50, setting.pretrain_steps)
        loss = model(*batch(train, setting.batch_size, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if progress and (step % 100 == 0 or step == setting.pretrain_steps - 1):
            print(f"  pretrain {step + 1}/{setting.pretrain_steps}  loss {loss.item():.3f}",
                  flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path)
    return model.state_dict()


# -- one fine-tune (the optimizers built as every example and benchmark builds them) ---------------
def make_model(weights, direction: Direction, setting: Setting) -> GPT:
    """The pretrained model in the setting's dtype (bf16: each weight rounded to nearest)."""
    model = GPT(direction.model)
    model.load_state_dict(weights)
    return model.to(DTYPES[setting.dtype])


def build_optimizer(system: System, model: GPT, setting: Setting):
    kwargs = dict(system.kwargs)
    if system.budget_bytes_per_param:
        kwargs["device_sum_budget"] = int(system.budget_bytes_per_param * sum(
            p.numel() for p in model.parameters() if p.ndim >= 2))
    if system.kind == "prototype":
        from bf16_rules import make_rule  # on the path: _prototype_systems
        return make_rule(model.parameters(), lr=setting.lr, weight_decay=setting.weight_decay,
                         max_grad_norm=setting.max_grad_norm, **kwargs)
    return make_optimizer(system.kind, model.parameters(), lr=setting.lr,
                          weight_decay=setting.weight_decay, max_grad_norm=setting.max_grad_norm,
                          emulated_host_steps=system.emulated_host_steps, **kwargs)


def average_gradients(model: GPT, world: int) -> None:
    """DDP's averaging, done by hand before step(): every rank's gradients (bf16 under --dtype
    bf16) widened to fp32, summed by one all_reduce over a flat buffer, divided by the ranks and
    rounded back to the gradients' dtype once."""
    import torch.distributed as dist
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.float().flatten() for g in grads])
    dist.all_reduce(flat)
    flat.div_(world)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def finetune(name: str, seed: int, weights, setting: Setting, direction: Direction,
             data, rank: int = 0, world: int = 1) -> dict | None:
    """One fine-tune. On `world` > 1 ranks (a process group up, `--ranks`): every rank the same
    model and batches, each taking its `rank`-th 1/world of every batch, the gradients averaged
    before step() (average_gradients); rank 0 evaluates and returns the run, the others None."""
    system = SYSTEMS[name]
    kind = system.kind
    model = make_model(weights, direction, setting)
    opt = build_optimizer(system, model, setting)
    gen = torch.Generator().manual_seed(seed)
    train = data["new"][0]
    share = setting.batch_size // world
    losses, times = [], []
    try:
        for step in range(setting.steps):
            for group in opt.param_groups:
                group["lr"] = setting.lr * schedule(step, setting.warmup, setting.steps)
            x, y = batch(train, setting.batch_size, gen)
            if world > 1:
                x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
            start = time.perf_counter()
            loss = forward(model, x, y, setting.compute)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if world > 1:
                average_gradients(model, world)
            if kind == "adamw":
                torch.nn.utils.clip_grad_norm_(model.parameters(), setting.max_grad_norm)
            opt.step()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        if hasattr(opt, "synchronize"):
            opt.synchronize()
        stats = opt.stats() if hasattr(opt, "stats") else {}
    finally:
        if hasattr(opt, "close"):
            opt.close()
    if world > 1:   # the whole batch's training loss: the mean of the ranks' shares
        import torch.distributed as dist
        mean = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(mean)
        losses = (mean / world).tolist()
        if rank != 0:
            return None
    return {
        "system": name, "seed": seed, "ranks": world,
        "new_loss": held_out_loss(model, data["new"][1], setting.eval_windows),
        "old_loss": held_out_loss(model, data["old"][1], setting.eval_windows),
        "train_loss_last20": statistics.fmean(losses[-20:]),
        "median_step_s": statistics.median(times[min(10, len(times) // 2):]),  # warmed up
        "reselections": stats.get("reselections"),
        "windows": stats.get("windows"),
        "moments_matrices": stats.get("moments_matrices"),   # deferred_credit "moments" on
        "mean_window_steps": (setting.steps / stats["windows"]) if stats.get("windows") else None,
        # a prototype rule's device state and bus bytes (benchmarks/prototypes/bf16_rules.py)
        "per_deferred_param": stats.get("per_deferred_param"),
        "bus_bytes_per_window_per_deferred_param":
            stats.get("bus_bytes_per_window_per_deferred_param"),
        "losses": losses,
    }


def _rank_main(rank: int, world: int, port: int, args: tuple, out: str) -> None:
    """One rank of `finetune_ranks`: gloo over 127.0.0.1, one thread; rank 0 saves the run."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        run = finetune(*args, rank=rank, world=world)
        if rank == 0:
            Path(out).write_text(json.dumps(run))
    finally:
        dist.destroy_process_group()


def finetune_ranks(name: str, seed: int, weights, setting: Setting, direction: Direction, data,
                   world: int) -> dict:
    """`finetune` as `world` data-parallel replicas (processes spawned by torch.multiprocessing,
    each a plain ZenFlowAdamW with the system's kwargs on a process group of gloo ranks)."""
    import socket
    import tempfile

    import torch.multiprocessing as mp
    if setting.batch_size % world:
        raise SystemExit(f"--ranks {world} must divide the batch ({setting.batch_size})")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        mp.spawn(_rank_main, args=(world, port, (name, seed, weights, setting, direction, data),
                                   out), nprocs=world)
        return json.loads(Path(out).read_text())


# -- report ---------------------------------------------------------------------------------------
def spread(values: list[float]) -> dict:
    return {"n": len(values), "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def summarize(runs: list[dict], systems: list[str], baseline: str = "AdamW",
              pretrained_loss: dict | None = None) -> dict:
    """Each system's losses (mean and std over seeds) and gaps against the baseline's mean; with
    the pretrained model's held-out losses, its share of the baseline's improvement on the new
    domain, (L0 - L) / (L0 - L_base), per seed (each seed's own baseline) and its mean."""
    out = {}
    base = [r for r in runs if r["system"] == baseline]
    base_new = statistics.fmean(r["new_loss"] for r in base) if base else None
    base_old = statistics.fmean(r["old_loss"] for r in base) if base else None
    base_step = statistics.median(r["median_step_s"] for r in base) if base else None
    for name in systems:
        mine = [r for r in runs if r["system"] == name]
        if not mine:
            continue
        new = spread([r["new_loss"] for r in mine])
        entry = {"new_loss": new, "old_loss": spread([r["old_loss"] for r in mine]),
                 "median_step_s": statistics.median(r["median_step_s"] for r in mine),
                 "reselections": [r["reselections"] for r in mine],
                 "mean_window_steps": [r.get("mean_window_steps") for r in mine]}
        if base_new:
            entry["new_gap_pct"] = 100.0 * (new["mean"] / base_new - 1.0)
            entry["old_gap_pct"] = 100.0 * (entry["old_loss"]["mean"] / base_old - 1.0)
            entry["step_time_vs_adamw"] = entry["median_step_s"] / base_step
            by_seed = {r["seed"]: r["new_loss"] for r in base}
            gaps = [100.0 * (r["new_loss"] / by_seed[r["seed"]] - 1.0)
                    for r in mine if r["seed"] in by_seed]
            entry["new_gap_pct_by_seed"] = spread(gaps) if gaps else None
            if pretrained_loss:
                l0 = pretrained_loss["new"]
                shares = [(l0 - r["new_loss"]) / (l0 - by_seed[r["seed"]])
                          for r in mine if r["seed"] in by_seed]
                entry["share_of_improvement"] = spread(shares) if shares else None
        out[name] = entry
    return out


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    summary = result["summary"]
    names = list(summary)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    corpus = {"bbc": "BBC News", "shakespeare": "Shakespeare"}
    direction = DIRECTIONS[result["direction"]]
    for ax, key, title in ((ax1, "new_loss", f"held-out {corpus[direction.finetune]} (new domain)"),
                           (ax2, "old_loss", f"held-out {corpus[direction.pretrain]} (old domain)")):
        means = [summary[n][key]["mean"] for n in names]
        stds = [summary[n][key]["std"] for n in names]
        ax.barh(range(len(names)), means, xerr=stds, color="tab:blue", alpha=0.7)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        lo, hi = min(means), max(means)
        ax.set_xlim(lo - 0.2 * (hi - lo + 1e-3), hi + 0.2 * (hi - lo + 1e-3))
        baseline = result.get("baseline", "AdamW")
        if baseline in summary:
            base = summary[baseline][key]["mean"]
            ax.axvline(base, color="k", lw=0.8, label=baseline)
            if key == "new_loss":
                ax.axvline(1.01 * base, color="tab:red", ls="--", lw=0.8,
                           label=f"{baseline} + 1%")
            ax.legend(fontsize=8, loc="lower right")
        ax.set_xlabel("loss (nats/byte), mean ± std over seeds")
        ax.set_title(title)
        ax.invert_yaxis()
    setting = result["setting"]
    lr = f", lr {setting['lr']:.3g}" if "lr" in setting else ""   # (results older than --lr)
    fig.suptitle(f"{result['direction']}, width {direction.model.n_embd}, "
                 f"{setting['steps']} steps, {setting.get('dtype', 'fp32')} weights"
                 f"{lr}\n{result['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge(paths: list[str], out: Path, name: str) -> int:
    """Write the runs of result files `paths` (one setting and direction) as one result."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    first = parts[0]
    for key in ("setting", "direction", "model"):
        if any(part[key] != first[key] for part in parts):
            raise SystemExit(f"--merge: the files differ in {key!r}; merge only runs of one setting")
    systems = [n for n in first["systems"] if all(n in part["systems"] for part in parts)]
    runs = [r for part in parts for r in part["runs"] if r["system"] in systems]
    result = {**first, "seeds": sorted({r["seed"] for r in runs}),
              "systems": {n: first["systems"][n] for n in systems},
              "summary": summarize(runs, systems, first.get("baseline", "AdamW"),
                                   first.get("pretrained_loss")), "runs": runs,
              "wall_s": sum(part["wall_s"] for part in parts), "merged_from": paths}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    plot(result, out / f"{name}.png")
    for system, summary in result["summary"].items():
        print(f"{system:36s} new {summary['new_loss']['mean']:.4f} "
              f"{summary.get('new_gap_pct', 0.0):+.2f}%  old {summary['old_loss']['mean']:.4f} "
              f"{summary.get('old_gap_pct', 0.0):+.2f}%")
    print(f"wrote {out / (name + '.json')}")
    return 0


def machine() -> str:
    info = machine_info("cpu")
    return f"{info['cpu']}, {info['cores']} cores, torch {info['torch']}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--direction", choices=list(DIRECTIONS), default="shakespeare-to-bbc")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--systems", nargs="*", default=DEFAULT_SYSTEMS, choices=list(SYSTEMS))
    ap.add_argument("--zenflow", nargs="+", default=[], metavar="JSON",
                    help='extra ZenFlow systems given as keyword arguments, e.g. '
                         '\'{"topk_ratio": 0.2, "update_interval": 2}\'')
    ap.add_argument("--steps", type=int, default=Setting.steps)
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                    help="the model's parameters (bf16: against OffloadAdamW, fp32 masters)")
    ap.add_argument("--bf16-compute", choices=("emulated", "native"), default="emulated",
                    help="bf16: the forward and backward in fp32 on the bf16 weights, gradients "
                         "rounded to bf16 (emulated, the default: this CPU has no bf16 units), "
                         "or in bf16 (native)")
    ap.add_argument("--lr", type=float, default=None, help=f"peak learning rate ({Setting.lr})")
    ap.add_argument("--lr-ulp", type=float, default=None, metavar="F",
                    help="peak learning rate = F bf16 ulps of the median matrix weight (0.1: a "
                         "7B fine-tune's regime)")
    ap.add_argument("--baseline", default=None,
                    help="the system gaps are measured against (AdamW; OffloadAdamW for bf16)")
    ap.add_argument("--name", default=None,
                    help="output file stem (default: finetune_quality, or finetune_quality_<direction> "
                         "for the second direction)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="combine result files of separate runs (a long comparison run seed by "
                         "seed) into --out/--name: the systems every file has, their runs, a "
                         "new summary and plot; nothing is trained")
    ap.add_argument("--ranks", type=int, default=1, metavar="N",
                    help="train the ZenFlow systems as N data-parallel replicas (gloo ranks on "
                         "this machine, each 1/N of every batch, gradients averaged by an "
                         "all_reduce before step()); the others in one process")
    ap.add_argument("--quick", action="store_true",
                    help="a tiny run to check the script works (10 pretraining steps, 10 "
                         "fine-tuning steps of 8 sequences, 32 evaluation windows); not a "
                         "measurement")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge, Path(args.out), args.name or "finetune_quality_merged")
    setting = Setting(steps=args.steps)
    if args.quick:
        setting = Setting(pretrain_steps=10, steps=10, warmup=2, eval_windows=32, batch_size=8)
    setting = replace(setting, dtype=args.dtype,
                      compute=args.bf16_compute if args.dtype != "fp32" else "native")
    if args.lr is not None:
        setting = replace(setting, lr=args.lr)
    if args.ranks < 1 or setting.batch_size % args.ranks:   # before the pretraining, not after
        ap.error(f"--ranks {args.ranks}: must be at least 1 and divide the batch of "
                 f"{setting.batch_size} sequences")
    baseline = args.baseline or ("AdamW" if args.dtype == "fp32" else "OffloadAdamW")
    for text in args.zenflow:
        kwargs = json.loads(text)
        name = "ZenFlow " + " ".join(f"{k}={v}" for k, v in kwargs.items())
        SYSTEMS[name] = System("zenflow", kwargs)
        args.systems.append(name)
    direction = DIRECTIONS[args.direction]
    if args.name is None:
        args.name = ("finetune_quality" if args.direction == "shakespeare-to-bbc"
                     else f"finetune_quality_{args.direction}")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    start = time.perf_counter()
    data = corpora(direction)
    weights = pretrained(setting, direction, data, progress=not args.quiet)
    median = median_matrix_weight(weights, DTYPES[setting.dtype])
    if args.lr_ulp is not None:
        setting = replace(setting, lr=args.lr_ulp * bf16_ulp(median))
    start_model = make_model(weights, direction, setting)
    pretrained_loss = {d: held_out_loss(start_model, data[d][1], setting.eval_windows)
                       for d in ("new", "old")}
    if not args.quiet:
        print(f"{setting.dtype} weights, median matrix |w| {median:.4g} (bf16 ulp "
              f"{bf16_ulp(median):.3g}), peak lr {setting.lr:.4g} = "
              f"{setting.lr / bf16_ulp(median):.3g} ulp; pretrained held-out new "
              f"{pretrained_loss['new']:.4f} old {pretrained_loss['old']:.4f}", flush=True)
    runs = []
    total = len(args.seeds) * len(args.systems)
    for i, seed in enumerate(args.seeds):
        order = args.systems[i % len(args.systems):] + args.systems[:i % len(args.systems)]
        for name in order:
            if args.ranks > 1 and SYSTEMS[name].kind == "zenflow":
                run = finetune_ranks(name, seed, weights, setting, direction, data, args.ranks)
            else:
                run = finetune(name, seed, weights, setting, direction, data)
            runs.append(run)
            if not args.quiet:
                print(f"[{len(runs)}/{total}] seed {seed} {name:34s} new {run['new_loss']:.4f}  "
                      f"old {run['old_loss']:.4f}  step {1e3 * run['median_step_s']:.1f} ms  "
                      f"windows {run['windows']}  reselections {run['reselections']}  "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)
    result = {"benchmark": "finetune_quality", "machine": machine(), "setting": asdict(setting),
              "direction": args.direction, "model": asdict(direction.model), "seeds": args.seeds,
              "ranks": args.ranks,
              "systems": {n: asdict(SYSTEMS[n]) for n in args.systems},
              "baseline": baseline, "median_matrix_weight": median,
              "lr_in_bf16_ulps": setting.lr / bf16_ulp(median),
              "pretrained_loss": pretrained_loss,
              "summary": summarize(runs, args.systems, baseline, pretrained_loss), "runs": runs,
              "wall_s": time.perf_counter() - start}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    plot(result, out / f"{args.name}.png")
    print(f"\n{'system':36s} {'new domain':>18s} {'gap':>8s} {'old domain':>18s} {'gap':>8s} "
          f"{'window':>7s} {'share':>6s}")
    for name, s in result["summary"].items():
        gaps = [s.get(k) for k in ("new_gap_pct", "old_gap_pct")]
        gaps = ["" if g is None else f"{g:+.2f}%" for g in gaps]
        windows = [w for w in s["mean_window_steps"] if w is not None]
        window = f"{statistics.fmean(windows):.1f}" if windows else "-"
        share = s.get("share_of_improvement")
        share = f"{100 * share['mean']:.0f}%" if share else ""
        print(f"{name:36s} {s['new_loss']['mean']:.4f} ± {s['new_loss']['std']:.4f} "
              f"{gaps[0]:>8s} {s['old_loss']['mean']:.4f} ± {s['old_loss']['std']:.4f} "
              f"{gaps[1]:>8s} {window:>7s} {share:>6s}")
    print(f"wrote {out / (args.name + '.json')} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
