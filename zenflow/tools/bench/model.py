"""The project's one GPT model (GPT- or Llama-shaped) and a synthetic token stream.

`zenflow bench`, `benchmarks/stall.py`, `benchmarks/scaling.py` and the byte-level language model
of fine-tuning (`zenflow.tools.finetune.experiments.LMExperiment`) all build this model, so a result of
one can be compared with another. It is deliberately plain (nanoGPT-like): token embeddings,
pre-norm transformer blocks, a final norm and an *untied* output head, so every weight is its own
parameter and no system has to special-case shared tensors. `arch="gpt"` is GPT-2's block (fused
qkv, GELU MLP, LayerNorm, biases, learned positions); `arch="llama"` is Llama's parameter layout
(separate q, k, v, o, SwiGLU gate/up/down, RMSNorm, no biases: seven matrices per layer, so 32
layers give Llama-2-7B's 226 matrices at any width). There is no dropout.

A byte-level model (bytes are the tokens, so no tokenizer is needed):

    model = GPT(GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_embd=128, n_head=4))
    logits = model(x)                      # x: (batch, T <= seq_len) int64 -> (batch, T, 256)
    loss = next_token_loss(logits, y)      # or model(x, y): the same loss, without the logits
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """The model's shape. The defaults are `zenflow bench`'s cpu-small preset."""
    n_layer: int = 6
    n_embd: int = 1024    # model width
    n_head: int = 16
    vocab_size: int = 8192  # 256 for a byte-level model
    seq_len: int = 32     # context: the longest sequence the model accepts (learned positions)
    arch: str = "gpt"
    ffn: int = 0          # llama: hidden width of the SwiGLU MLP (0: 8/3 n_embd, rounded to 64)

    def __post_init__(self) -> None:
        if self.arch not in ("gpt", "llama"):
            raise ValueError(f"GPTConfig.arch must be 'gpt' or 'llama', got {self.arch!r}")
        if not isinstance(self.ffn, int) or self.ffn < 0:
            raise ValueError(f"GPTConfig.ffn must be a non-negative integer, got {self.ffn!r}")
        for name in ("n_layer", "n_embd", "n_head", "vocab_size", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by "
                             f"n_head ({self.n_head})")

    @property
    def hidden(self) -> int:
        return self.ffn or 64 * max(1, round(8 * self.n_embd / 3 / 64))

    def num_matrices(self) -> int:
        return self.n_layer * (7 if self.arch == "llama" else 4) + (2 if self.arch == "llama" else 3)

    def num_params(self) -> int:
        """Parameter count without building the model (matches GPT.num_params)."""
        d, v, s, L = self.n_embd, self.vocab_size, self.seq_len, self.n_layer
        if self.arch == "llama":
            return 2 * v * d + L * (4 * d * d + 3 * d * self.hidden + 2 * d) + d
        per_block = 2 * (2 * d)                    # two LayerNorms
        per_block += 3 * d * d + 3 * d             # qkv
        per_block += d * d + d                     # attention output
        per_block += 4 * d * d + 4 * d             # mlp up
        per_block += 4 * d * d + d                 # mlp down
        return v * d + s * d + L * per_block + 2 * d + d * v


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.down = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class LlamaAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        d = cfg.n_embd
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (f(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.n_embd, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.n_embd, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        llama = cfg.arch == "llama"
        norm = nn.RMSNorm if llama else nn.LayerNorm
        self.ln1 = norm(cfg.n_embd)
        self.attn = LlamaAttention(cfg) if llama else CausalSelfAttention(cfg)
        self.ln2 = norm(cfg.n_embd)
        self.mlp = SwiGLU(cfg) if llama else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        # Llama has no learned positions (it rotates q and k; a benchmark need not).
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.n_embd) if cfg.arch == "gpt" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.RMSNorm(cfg.n_embd) if cfg.arch == "llama" else nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)  # untied on purpose
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style: N(0, 0.02), residual projections scaled down by depth.
        for name, p in self.named_parameters():
            if p.ndim >= 2:
                std = 0.02
                if name.endswith(("proj.weight", "down.weight", ".o.weight")):
                    std /= math.sqrt(2 * self.cfg.n_layer)
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) when `targets` is None, else `next_token_loss(logits, targets)`.

        Returning the loss itself keeps `model(x, y)` usable as-is by every benchmarked system,
        DeepSpeed's engine included."""
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len {self.cfg.seq_len}")
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return logits if targets is None else next_token_loss(logits, targets)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits (B, T, vocab) against targets (B, T). The softmax runs in
    fp32 so that bf16/fp16 logits lose no precision in the loss."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class TokenStream:
    """A deterministic, learnable synthetic token stream.

    Tokens live in a small random subset of the vocabulary (`active` tokens) and follow a fixed
    random cycle through it (next = succ[current]) with a fraction of random replacements. The
    loss therefore falls within a few steps (first the unigram, then the bigram structure), which
    makes final losses comparable across systems, and every system sees identical batches.
    """

    def __init__(self, vocab_size: int, seq_len: int, batch_size: int, seed: int = 0,
                 noise: float = 0.1, active: int = 256) -> None:
        self.vocab_size, self.seq_len, self.batch_size = vocab_size, seq_len, batch_size
        self.noise = noise
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        self._tokens = torch.randperm(vocab_size, generator=gen)[:min(active, vocab_size)]
        n = len(self._tokens)
        self._succ = torch.zeros(vocab_size, dtype=torch.long)
        self._succ[self._tokens] = self._tokens[torch.randperm(n, generator=gen)]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets for `step`; a pure function of (seed, step)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        B, T = self.batch_size, self.seq_len + 1
        seq = torch.empty(B, T, dtype=torch.long)
        n = len(self._tokens)
        seq[:, 0] = self._tokens[torch.randint(n, (B,), generator=g)]
        for t in range(1, T):
            seq[:, t] = self._succ[seq[:, t - 1]]
            noisy = torch.rand(B, generator=g) < self.noise
            seq[noisy, t] = self._tokens[torch.randint(n, (int(noisy.sum()),), generator=g)]
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
