"""The models trained: an MLP and a small GPT-style transformer, both deterministic (no dropout).

`build_model(spec, seed)` gives bit-identical parameters for the same (spec, seed) in every
process, so every rank starts from the same state and a restart from step 0 is exact.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from failbench_ray.spec import ModelSpec


class MLP(nn.Module):
    """Hidden layers are (Linear, ReLU) pairs, so a pipeline stage or a tensor-parallel pair
    never splits a layer from its activation."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        dims = [spec.input_dim] + [spec.hidden_dim] * spec.depth
        hidden = [
            nn.Sequential(nn.Linear(a, b), nn.ReLU())
            for a, b in zip(dims[:-1], dims[1:], strict=True)
        ]
        self.layers = nn.Sequential(*hidden, nn.Linear(dims[-1], spec.num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Heads are derived from the local width so a column-parallel q/k/v still works.
        q, k, v = (
            m(x).view(b, t, self.n_heads, -1).transpose(1, 2) for m in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TokenEmbedding(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.tok = nn.Embedding(spec.vocab_size, spec.d_model)
        self.pos = nn.Embedding(spec.seq_len, spec.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class LMHead(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(spec.d_model)
        self.head = nn.Linear(spec.d_model, spec.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed = TokenEmbedding(spec)
        self.blocks = nn.Sequential(
            *[Block(spec.d_model, spec.n_heads) for _ in range(spec.n_layers)]
        )
        self.lm_head = LMHead(spec)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.blocks(self.embed(idx)))


def layers(model: nn.Module) -> list[nn.Module]:
    """The model as a sequence of layers, in order (what pipeline stages are cut from)."""
    if isinstance(model, MLP):
        return list(model.layers)
    assert isinstance(model, Transformer)
    return [model.embed, *model.blocks, model.lm_head]


def layer_count(spec: ModelSpec) -> int:
    return spec.depth + 1 if spec.kind == "mlp" else spec.n_layers + 2


def build_model(spec: ModelSpec, seed: int) -> nn.Module:
    """The model with deterministic initial parameters for `seed`."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return MLP(spec) if spec.kind == "mlp" else Transformer(spec)
    finally:
        torch.random.set_rng_state(gen_state)


def loss_fn(spec: ModelSpec, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if spec.kind == "transformer":
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    return F.cross_entropy(output, target)


def param_count(spec: ModelSpec) -> int:
    """Parameters of the model, computed without building it (to size the state up front)."""
    if spec.kind == "mlp":
        i, h, c = spec.input_dim, spec.hidden_dim, spec.num_classes
        # closed form, not a list of `depth` layers: a spec may ask for any depth (and is
        # then refused by the size cap, not by an overflow)
        return (i * h + h) + (spec.depth - 1) * (h * h + h) + (h * c + c)
    d = spec.d_model
    per_block = 4 * (d * d + d) + 2 * (2 * d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return (
        spec.vocab_size * d
        + spec.seq_len * d
        + spec.n_layers * per_block
        + 2 * d
        + d * spec.vocab_size
        + spec.vocab_size
    )


def human_bytes(n: float) -> str:
    units = ["B", "KB", "MB", "GB", "TB"]
    i = min(int(math.log(max(n, 1), 1024)), len(units) - 1)
    return f"{n / 1024**i:.1f} {units[i]}"
