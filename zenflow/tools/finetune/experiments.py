"""The two experiments that the demo, the example and the accuracy benchmark run, each as one
call: fine-tune MiniLM on BBC News, and train a byte-level GPT (`zenflow.tools.bench.model.GPT`) from
random weights on Shakespeare. The optimizer is the only thing that differs between calls with
the same seed."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zenflow.tools.finetune.train import TrainResult


@dataclass
class BBCSetting:
    max_length: int = 32     # first tokens of each article: the title and lead carry the topic
    batch_size: int = 16
    steps: int = 100
    lr: float = 1e-4
    warmup: int = 10
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    split_seed: int = 0      # the held-out articles never change with the run's seed


@dataclass
class LMSetting:
    context: int = 64        # bytes per training window: the model's seq_len
    dim: int = 128
    layers: int = 4
    heads: int = 4
    batch_size: int = 32
    steps: int = 300
    lr: float = 1e-3
    warmup: int = 20
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    eval_windows: int = 512  # held-out windows scored (of ~7.6k), fixed: the first ones
    n_test_plays: int = 4
    split_seed: int = 0

    def model_config(self):
        """The byte-level GPT this setting trains (0.87M parameters at the defaults)."""
        from zenflow.tools.bench.model import GPTConfig
        return GPTConfig(vocab_size=256, seq_len=self.context, n_embd=self.dim,
                         n_layer=self.layers, n_head=self.heads)


@dataclass
class RunResult:
    kind: str
    seed: int
    metric: float            # accuracy (BBC) or mean held-out loss in nats per byte (LM)
    train: TrainResult = field(repr=False, default=None)


def linear_schedule(optimizer, warmup: int, total: int):
    """Linear warm-up then linear decay to 0."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class BBCExperiment:
    """Data and tokenisation done once; `run(kind, seed)` trains a fresh model and scores it."""

    def __init__(self, setting: BBCSetting = BBCSetting(), device=None):
        from zenflow.tools.finetune.data import load_bbc_news
        from zenflow.tools.finetune.models import load_tokenizer
        from zenflow.tools.finetune.train import encode
        self.setting = s = setting
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.data = load_bbc_news(test_fraction=0.2, seed=s.split_seed)
        tok = load_tokenizer()
        self.train = encode(self.data.train, tok, s.max_length).to(self.device)
        self.test = encode(self.data.test, tok, s.max_length).to(self.device)

    def run(self, kind: str, seed: int, progress: bool = True, desc: str | None = None,
            **zenflow_kwargs) -> RunResult:
        from zenflow.tools.finetune.models import load_classifier
        from zenflow.tools.finetune.optim import make_optimizer
        from zenflow.tools.finetune.train import evaluate_classifier, train_classifier
        s = self.setting
        model, _ = load_classifier(self.data.num_labels, seed=seed)
        model.to(self.device)
        opt = make_optimizer(kind, model.parameters(), lr=s.lr, weight_decay=s.weight_decay,
                             max_grad_norm=s.max_grad_norm, **zenflow_kwargs)
        try:
            res = train_classifier(model, opt, self.train, steps=s.steps, batch_size=s.batch_size,
                                   seed=seed, scheduler=linear_schedule(opt, s.warmup, s.steps),
                                   clip_grad_norm=s.max_grad_norm, progress=progress,
                                   desc=desc or f"{kind} seed {seed}")
            acc = evaluate_classifier(model, self.test, progress=progress,
                                      desc=f"{desc or kind} eval")
        finally:
            if hasattr(opt, "close"):
                opt.close()
        return RunResult(kind, seed, acc, res)


class LMExperiment:
    def __init__(self, setting: LMSetting = LMSetting(), device=None):
        from zenflow.tools.finetune.data import shakespeare_bytes
        from zenflow.tools.finetune.train import lm_windows
        self.setting = s = setting
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        train, test, self.test_plays = shakespeare_bytes(seed=s.split_seed, n_test=s.n_test_plays)
        self.train = lm_windows(train, s.context).to(self.device)
        self.test = lm_windows(test, s.context)[: s.eval_windows].to(self.device)

    def run(self, kind: str, seed: int, progress: bool = True, desc: str | None = None,
            **zenflow_kwargs) -> RunResult:
        from zenflow.tools.bench.model import GPT
        from zenflow.tools.finetune.optim import make_optimizer
        from zenflow.tools.finetune.train import evaluate_lm, train_lm
        s = self.setting
        torch.manual_seed(seed)     # the model's initial weights
        model = GPT(s.model_config()).to(self.device)
        opt = make_optimizer(kind, model.parameters(), lr=s.lr, weight_decay=s.weight_decay,
                             max_grad_norm=s.max_grad_norm, **zenflow_kwargs)
        try:
            res = train_lm(model, opt, self.train, steps=s.steps, batch_size=s.batch_size,
                           seed=seed, scheduler=linear_schedule(opt, s.warmup, s.steps),
                           clip_grad_norm=s.max_grad_norm, progress=progress,
                           desc=desc or f"{kind} seed {seed}")
            loss = evaluate_lm(model, self.test)
        finally:
            if hasattr(opt, "close"):
                opt.close()
        return RunResult(kind, seed, loss, res)
