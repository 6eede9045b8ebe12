"""The Llama-shaped model: Llama-2-7B's layer count (32 layers of q, k, v, o, gate, up, down, plus the
embedding and the head: 226 matrices) at a narrow width, and its token batches."""
from __future__ import annotations

import torch

from zenflow.tools.bench.model import GPT, GPTConfig, TokenStream

LLAMA = GPTConfig(arch="llama", n_layer=32, n_embd=32, n_head=4, vocab_size=64, seq_len=8)


def llama(seed: int = 0, dtype=torch.float32) -> GPT:
    torch.manual_seed(seed)
    return GPT(LLAMA).to(dtype)


def batch(step: int, size: int = 4):
    return TokenStream(LLAMA.vocab_size, LLAMA.seq_len, size, active=16).batch(step)
