"""Training and evaluation loops shared by the demo, `zenflow finetune`, the examples and the
accuracy benchmark. One loop for every optimizer, so that only the optimizer differs."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zenflow.tools.finetune.data import Example


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=True)


def _clips_itself(opt: torch.optim.Optimizer) -> bool:
    import zenflow
    return isinstance(opt, (zenflow.ZenFlowAdamW, zenflow.OffloadAdamW))


def _sync(opt: torch.optim.Optimizer) -> None:
    # ZenFlow may have a host update in flight; evaluation and saving must see it installed.
    if hasattr(opt, "synchronize"):
        opt.synchronize()


@dataclass
class Encoded:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)

    def to(self, device) -> Encoded:
        return Encoded(self.input_ids.to(device), self.attention_mask.to(device),
                       self.labels.to(device))


def encode(examples: list[Example], tokenizer, max_length: int) -> Encoded:
    """Tokenise once, padded to `max_length` (fixed shapes keep the step time steady)."""
    if max_length < 8:
        raise ValueError(f"max_length={max_length} is not allowed: use at least 8 tokens")
    a = [e.text_a for e in examples]
    b = [e.text_b for e in examples] if examples and examples[0].text_b is not None else None
    enc = tokenizer(a, b, truncation=True, max_length=max_length, padding="max_length",
                    return_tensors="pt")
    return Encoded(enc["input_ids"], enc["attention_mask"],
                   torch.tensor([e.label for e in examples], dtype=torch.long))


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)   # forward+backward+step, seconds
    opt_times: list[float] = field(default_factory=list)    # inside optimizer.step(), seconds
    wall_s: float = 0.0
    stats: dict = field(default_factory=dict)                # optimizer.stats() when it has one

    def summary(self) -> dict:
        return {
            "steps": len(self.losses),
            "final_loss_avg10": statistics.fmean(self.losses[-10:]) if self.losses else None,
            "median_step_s": statistics.median(self.step_times) if self.step_times else None,
            "median_opt_step_s": statistics.median(self.opt_times) if self.opt_times else None,
            "wall_s": self.wall_s,
        }


def _batches(n: int, batch_size: int, steps: int, seed: int):
    """`steps` index batches drawn epoch by epoch from seeded permutations of range(n)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    for _ in range(steps):
        if len(order) < batch_size:
            order = torch.cat([order, torch.randperm(n, generator=g)])
        yield order[:batch_size]
        order = order[batch_size:]


def fit(model: torch.nn.Module, optimizer: torch.optim.Optimizer, compute_loss, n_examples: int,
        *, steps: int, batch_size: int, seed: int = 0, scheduler=None,
        clip_grad_norm: float | None = None, progress: bool = True, desc: str = "train") -> TrainResult:
    """Generic loop: `compute_loss(index_tensor) -> loss`. Gradient clipping is done here for
    optimizers that do not clip themselves (ZenFlow/Offload take `max_grad_norm` instead)."""
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps={steps} and batch_size={batch_size} must both be at least 1")
    if batch_size > n_examples:
        raise ValueError(f"batch_size={batch_size} is larger than the {n_examples} training examples")
    external_clip = clip_grad_norm if clip_grad_norm and not _clips_itself(optimizer) else None
    res = TrainResult()
    model.train()
    t_start = time.perf_counter()
    with _progress(steps, desc, progress) as bar:
        for idx in _batches(n_examples, batch_size, steps, seed):
            t0 = time.perf_counter()
            loss = compute_loss(idx)
            loss.backward()
            if external_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), external_clip)
            t1 = time.perf_counter()
            optimizer.step()
            t2 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()
            res.losses.append(float(loss.detach()))
            res.step_times.append(t2 - t0)
            res.opt_times.append(t2 - t1)
            bar.set_postfix(loss=f"{res.losses[-1]:.3f}")
            bar.update(1)
    _sync(optimizer)
    res.wall_s = time.perf_counter() - t_start
    if hasattr(optimizer, "stats"):
        res.stats = dict(optimizer.stats())
    return res


def train_classifier(model, optimizer, data: Encoded, **kw) -> TrainResult:
    def loss_of(idx):
        loss, _ = model(data.input_ids[idx], data.attention_mask[idx], data.labels[idx])
        return loss
    return fit(model, optimizer, loss_of, len(data), **kw)


@torch.no_grad()
def evaluate_classifier(model, data: Encoded, batch_size: int = 64, progress: bool = False,
                        desc: str = "eval") -> float:
    """Accuracy on `data`."""
    model.eval()
    correct = 0
    starts = range(0, len(data), batch_size)
    with _progress(len(starts), desc, progress) as bar:
        for s in starts:
            sl = slice(s, s + batch_size)
            _, logits = model(data.input_ids[sl], data.attention_mask[sl])
            correct += int((logits.argmax(-1) == data.labels[sl]).sum())
            bar.update(1)
    model.train()
    return correct / len(data)


def lm_windows(data: bytes, context: int) -> torch.Tensor:
    """Non-overlapping windows of `context + 1` bytes (inputs and shifted targets)."""
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    n = (len(t) - 1) // context
    if n < 1:
        raise ValueError(f"text of {len(t)} bytes is too short for context={context}")
    return t[: n * context + 1].unfold(0, context + 1, context)


def train_lm(model, optimizer, windows: torch.Tensor, **kw) -> TrainResult:
    """Next-byte training; `model(inputs, targets)` returns the mean loss (zenflow.tools.bench.model.GPT)."""
    def loss_of(idx):
        w = windows[idx]
        return model(w[:, :-1], w[:, 1:])
    return fit(model, optimizer, loss_of, len(windows), **kw)


@torch.no_grad()
def evaluate_lm(model, windows: torch.Tensor, batch_size: int = 64) -> float:
    """Mean next-byte cross-entropy (nats) over all windows."""
    model.eval()
    total, count = 0.0, 0
    for s in range(0, len(windows), batch_size):
        w = windows[s: s + batch_size]
        loss = model(w[:, :-1], w[:, 1:])
        total += float(loss) * w[:, 1:].numel()
        count += w[:, 1:].numel()
    model.train()
    return total / count


def smooth(values: list[float], window: int = 10) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_loss_curves(curves: dict[str, list[float]], path: str | Path, title: str,
                     window: int = 10) -> Path:
    """One line per run (moving average over `window` steps, raw values faint behind)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        line, = ax.plot(smooth(losses, window), label=name)
        ax.plot(losses, color=line.get_color(), alpha=0.2, linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss ({window}-step average)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
