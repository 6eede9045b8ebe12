"""Parameter shapes for `zenflow estimate`, without weights: from a shape list, a bench preset or a
Hugging Face config (the model is built on the meta device, so nothing is allocated)."""
from __future__ import annotations

import json
import math
import os
import re

import torch

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def parse_shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """"4096x4096*128,11008x4096,4096" -> named shapes; "*N" repeats a shape N times."""
    out = []
    for i, item in enumerate(t.strip() for t in text.split(",")):
        if not item:
            continue
        m = re.fullmatch(r"(\d+(?:x\d+)*)(?:\*(\d+))?", item.replace("X", "x").replace(" ", ""))
        if not m:
            raise ValueError(f"--shapes: cannot read {item!r}; write e.g. 4096x4096*32,4096")
        shape = tuple(int(d) for d in m.group(1).split("x"))
        if any(d < 1 for d in shape):
            raise ValueError(f"--shapes: {item!r} has a zero dimension")
        for r in range(int(m.group(2) or 1)):
            out.append((f"shape{i}" + (f"[{r}]" if m.group(2) else ""), shape))
    if not out:
        raise ValueError("--shapes: no shapes given")
    return out


def _meta_shapes(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(n, tuple(p.shape)) for n, p in module.named_parameters() if p.requires_grad]


def preset_shapes(name: str) -> tuple[list[tuple[str, tuple[int, ...]]], torch.dtype]:
    """The bench preset's model (zenflow.tools.bench.model.GPT) built on the meta device, and its dtype."""
    from zenflow.tools.bench.cli import PRESETS
    from zenflow.tools.bench.model import GPT, GPTConfig
    if name not in PRESETS:
        raise ValueError(f"--preset: unknown {name!r}; choose from {', '.join(sorted(PRESETS))}")
    spec = PRESETS[name]
    keys = ("n_layer", "n_embd", "n_head", "vocab_size", "seq_len", "arch", "ffn")
    cfg = GPTConfig(**{k: spec[k] for k in keys if k in spec})
    with torch.device("meta"):
        model = GPT(cfg)
    return _meta_shapes(model), DTYPES[spec["dtype"]]


def llama_shapes(hidden: int, layers: int, intermediate: int, vocab: int, heads: int,
                 kv_heads: int | None = None, tied: bool = False,
                 head_dim: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """Llama's parameters (q, k, v, o, gate, up, down, two RMSNorms per layer; embedding, final
    norm and, unless tied, the output head), as Hugging Face's LlamaForCausalLM names them."""
    head_dim = head_dim or hidden // heads
    kv = (kv_heads or heads) * head_dim
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
                (p + "self_attn.k_proj.weight", (kv, hidden)),
                (p + "self_attn.v_proj.weight", (kv, hidden)),
                (p + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
                (p + "mlp.gate_proj.weight", (intermediate, hidden)),
                (p + "mlp.up_proj.weight", (intermediate, hidden)),
                (p + "mlp.down_proj.weight", (hidden, intermediate)),
                (p + "input_layernorm.weight", (hidden,)),
                (p + "post_attention_layernorm.weight", (hidden,))]
    out.append(("model.norm.weight", (hidden,)))
    if not tied:
        out.append(("lm_head.weight", (vocab, hidden)))
    return out


def hf_config(source) -> object:
    """A transformers config from a folder, a config.json path or a dict (offline)."""
    from transformers import AutoConfig
    if isinstance(source, dict):
        d = dict(source)
        return AutoConfig.for_model(d.pop("model_type", "llama"), **d)
    if os.path.isdir(source):
        return AutoConfig.from_pretrained(source, local_files_only=True)
    with open(source) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--hf-config {source}: not a JSON config.json ({exc})") from None
    if not isinstance(d, dict) or "model_type" not in d:
        raise ValueError(f"--hf-config {source}: not a Hugging Face config.json (no model_type)")
    return AutoConfig.for_model(d.pop("model_type"), **d)


def hf_shapes(source) -> tuple[list[tuple[str, tuple[int, ...]]], torch.dtype | None, str]:
    """Shapes of the model a Hugging Face config describes (built on the meta device), its
    torch_dtype if it names one, and how the shapes were obtained."""
    cfg = hf_config(source)
    dtype = getattr(cfg, "torch_dtype", None) or getattr(cfg, "dtype", None)
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype.removeprefix("torch."))
    dtype = dtype if isinstance(dtype, torch.dtype) else None
    from transformers import AutoModel, AutoModelForCausalLM
    errors = []
    for auto in (AutoModelForCausalLM, AutoModel):
        try:
            with torch.device("meta"):
                model = auto.from_config(cfg)
            return _meta_shapes(model), dtype, f"{type(model).__name__} built on the meta device"
        except Exception as exc:   # an architecture this transformers does not know
            errors.append(f"{auto.__name__}: {exc}")
    needed = ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size",
              "num_attention_heads")
    if all(hasattr(cfg, k) for k in needed):
        shapes = llama_shapes(cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size,
                              cfg.vocab_size, cfg.num_attention_heads,
                              getattr(cfg, "num_key_value_heads", None),
                              bool(getattr(cfg, "tie_word_embeddings", False)),
                              getattr(cfg, "head_dim", None))
        return shapes, dtype, "Llama-shaped formula (transformers could not build the model: " \
            + "; ".join(errors) + ")"
    raise ValueError(f"cannot get parameter shapes from this config: {'; '.join(errors)}")


def activation_bytes_guess(shapes: list[tuple[str, tuple[int, ...]]], seq_len: int,
                           micro_batch: int, item: int = 2) -> tuple[int, str]:
    """A transformer's activations at the peak of its forward and backward, from its shapes
    alone, and how they were counted: 34 bytes x hidden per token and layer in a 16-bit model
    (Korthikanti et al. 2022, "Reducing activation recomputation", with a fused attention that
    keeps no seq x seq scores; no activation checkpointing), scaled by item / 2 for fp32.
    hidden: the most common vector length (the norms'), else the most common matrix width;
    layers: the matrices no larger than 4 hidden each way (not the embedding or the head) over
    12 hidden^2, a GPT layer's parameters. Llama-2-7B at 4096 tokens: 17.0 GiB."""
    from collections import Counter
    vectors = Counter(s[0] for _, s in shapes if len(s) == 1)
    widths = Counter(s[-1] for _, s in shapes if len(s) >= 2)
    hidden = (vectors or widths).most_common(1)[0][0]
    body = sum(numel(s) for _, s in shapes if len(s) >= 2 and max(s) <= 4 * hidden)
    layers = max(1, round(body / (12 * hidden * hidden)))
    nbytes = 34 * hidden * layers * seq_len * micro_batch * item // 2
    return nbytes, (f"estimated as 34 x hidden {hidden} x {layers} layers x {seq_len} tokens x "
                    f"micro-batch {micro_batch} bytes (16-bit, fused attention, no activation "
                    "checkpointing)")


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
