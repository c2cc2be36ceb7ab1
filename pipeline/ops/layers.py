"""Building blocks shared by the drafter (``pipeline.dspark.drafter``) and the target runner
(``pipeline.engine.target_runner``), and the full-vocabulary logsumexp of the target's LM head (stored with the
hidden states, used by the drafter's losses).

Both follow transformers' Llama / Qwen3 numerics bit for bit: RMSNorm takes fp32 statistics, casts back, then
scales; RoPE is neox-style (rotate the two halves of each head).
"""
from __future__ import annotations

import torch
import torch.nn as nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d], weight [d] -> weight * (x / rms(x)) with the statistics in fp32 and the result in x's dtype."""
    dt = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dt)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., h] -> [..., h]: (x1, x2) -> (-x2, x1) over the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., h]; cos / sin broadcastable to x (the caller lines up the head axis)."""
    return x * cos + rotate_half(x) * sin


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """[h/2] fp32 inverse frequencies theta^(-2i/h), computed in float64 as transformers does."""
    return (1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))).float()


class Rotary(nn.Module):
    """neox-style RoPE: cos/sin [..., h] for integer positions [...]."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta), persistent=False)

    def forward(self, pos: torch.Tensor, dtype: torch.dtype):
        f = pos.float()[..., None] * self.inv_freq  # [..., h/2]
        emb = torch.cat((f, f), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


@torch.no_grad()
def full_vocab_lse(last_hidden: torch.Tensor, lm_head_weight: torch.Tensor, chunk: int = 8192,
                   rows: int = 1024) -> torch.Tensor:
    """logsumexp_v (h · W_v) in fp32 for h [T, d] (use the stored bf16 values), W [V, d] -> [T]; the logits are
    never materialised beyond [rows, chunk]."""
    h = last_hidden.float()
    W = lm_head_weight.float()
    out = torch.empty(h.shape[0], device=h.device)
    for r0 in range(0, h.shape[0], rows):
        hr = h[r0:r0 + rows]
        acc = torch.full((hr.shape[0],), float("-inf"), device=h.device)  # stays -inf for an empty W
        for c0 in range(0, W.shape[0], chunk):
            acc = torch.logaddexp(acc, torch.logsumexp(hr @ W[c0:c0 + chunk].T, dim=-1))
        out[r0:r0 + rows] = acc
    return out
