"""A small character-level transformer language model (GPT-2's layout and initialisation, no dropout).

Pre-norm blocks (LayerNorm, causal self-attention, LayerNorm, 4x GELU MLP) on learned token and position
embeddings. Weights are initialised as GPT-2 does, normal(0, 0.02), with the projections that write into
the residual stream scaled by 1/sqrt(2 * layers): the standard for language models, and the reason their
gradients are small. No dropout: a run is a deterministic function of its seed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CharTransformer"]


class _Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        attended = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharTransformer(nn.Module):
    """``logits = model(codes)``: ``[batch, time]`` int64 codes to ``[batch, time, vocab]`` logits.

    Args:
        vocab: Number of symbols.
        d_model: Width of the residual stream (a multiple of ``heads``).
        layers: Transformer blocks.
        heads: Attention heads per block.
        context: Longest sequence (positions learned).
    """

    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"CharTransformer(d_model={d_model}, heads={heads}): d_model must be a multiple of "
                             f"heads; got {d_model} % {heads} = {d_model % heads}.")
        self.token = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        residual_std = 0.02 / math.sqrt(2 * layers)
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "out.weight")):
                nn.init.normal_(p, 0.0, residual_std)
            elif p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(codes.shape[1], device=codes.device)
        x = self.token(codes) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))
