"""The two small models most optimizer tests train, and a loss for each step: an MLP and a
pre-norm transformer block. MODELS maps a name to (make, loss_fn); make() seeds its own
initial weights, loss_fn(model, step) draws step's batch from its own seeded generator."""
import torch


class TinyTransformerBlock(torch.nn.Module):
    """A pre-norm transformer block with a head: matrices of several shapes, vectors, embedding."""

    def __init__(self, vocab=23, dim=16, heads=2, seq=6):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.norm1 = torch.nn.LayerNorm(dim)
        self.attn = torch.nn.MultiheadAttention(dim, heads, bias=False, batch_first=True)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(4 * dim, dim))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        return self.head(x)


def make_mlp():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24),
                               torch.nn.Tanh(), torch.nn.Linear(24, 5))


def make_block():
    torch.manual_seed(2)
    return TinyTransformerBlock()


def mlp_loss(model, step):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 12, generator=g)
    y = torch.randn(16, 5, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


def block_loss(model, step):
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, 23, (4, 6), generator=g)
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 23),
                                             tokens[:, 1:].reshape(-1))


MODELS = {"mlp": (make_mlp, mlp_loss), "transformer_block": (make_block, block_loss)}
