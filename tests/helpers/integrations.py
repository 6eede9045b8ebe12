"""The tiny models, data and settings of the framework tests (tests/test_integrations.py,
test_framework_callbacks.py): a one-layer BERT and its token dataset for Hugging Face Trainer, an
MLP, its data and a LightningModule for Lightning. Skips the importing test module when
transformers or Lightning is missing."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zenflow

transformers = pytest.importorskip("transformers")
L = pytest.importorskip("lightning.pytorch")

ZF = dict(lr=1e-2, weight_decay=0.01, topk_ratio=0.25, update_interval=2, overlap_step=True,
          select_strategy="step", select_interval=4)


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n=32, length=12, vocab=64, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(4, vocab, (n, length), generator=g)
        self.labels = (self.ids[:, 0] % 2).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]),
                "labels": self.labels[i]}


def tiny_bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=16, num_labels=2,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def xy(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long())


class LitModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = mlp()
        self.closure_calls = 0
        self.optimizer = None

    def training_step(self, batch, batch_idx):
        # Lightning runs this inside the closure it passes to optimizer.step(closure=...).
        self.closure_calls += 1
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        self.optimizer = zenflow.ZenFlowAdamW(self.parameters(), **ZF)
        return self.optimizer
