"""A small GPT-style language model with MoE FFNs, for `schemoe train` and the examples.

Legend: B batch, L sequence length, D model dim, V vocabulary.

Blocks alternate a dense FFN and an MoE FFN (MoE in every other block, starting with the second),
pre-norm, causal self-attention via scaled_dot_product_attention, tied input/output embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import MoEConfig
from .layer import MoELayer

__all__ = ["GPTConfig", "GPT"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab: int = 256
    seq_len: int = 64
    layers: int = 4
    heads: int = 4
    moe_every: int = 2

    def __post_init__(self) -> None:
        for n in ("vocab", "seq_len", "layers", "heads", "moe_every"):
            v = getattr(self, n)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{n} must be a positive int, got {v!r}")


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"model dim {dim} must be divisible by heads={heads}")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        B, L, D = x_BLD.shape
        q, k, v = self.qkv(x_BLD).view(B, L, 3, self.heads, D // self.heads).unbind(2)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(o.transpose(1, 2).reshape(B, L, D))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: nn.Module, moe: bool) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.ffn, self.moe = _Attention(dim, heads), ffn, moe

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        if self.moe:
            y, aux = self.ffn(h)
        else:
            y, aux = self.ffn(h), h.new_zeros(())
        return x + y, aux


class GPT(nn.Module):
    """forward(tokens [B, L]) -> (logits [B, L, V], summed aux loss of the MoE layers)."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig, *, group=None, seed: int = 0) -> None:
        super().__init__()
        D = moe.experts.model_dim
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, D)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, D))
        blocks = []
        for i in range(cfg.layers):
            is_moe = (i + 1) % cfg.moe_every == 0
            if is_moe:
                ffn: nn.Module = MoELayer(moe, group=group, seed=seed * 1000 + i)
            else:
                H = moe.experts.hidden_dim
                ffn = nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D))
            blocks.append(_Block(D, cfg.heads, ffn, is_moe))
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(D)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, tokens_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if tokens_BL.dim() != 2 or tokens_BL.shape[1] > self.cfg.seq_len:
            raise ValueError(
                f"tokens must be [B, L<={self.cfg.seq_len}], got {tuple(tokens_BL.shape)}"
            )
        x = self.embed(tokens_BL) + self.pos[: tokens_BL.shape[1]]
        aux = x.new_zeros(())
        for blk in self.blocks:
            x, a = blk(x)
            aux = aux + a
        return self.ln_f(x) @ self.embed.weight.t(), aux
