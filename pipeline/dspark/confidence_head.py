"""Confidence head and its soft label (docs/dspark.md §4); its calibration is in ``pipeline.dspark.calibration``.

    c_k = σ(w·[h_k; W1[x_{k-1}]] + b)          `confidence_head.proj`, Linear(d + r -> 1), kept in fp32
    soft label  c*_k = clamp(1 - ½‖p_d,k - p_t,k‖₁, 0, 1), detached

c_k estimates P(x_k accepted | x_1..x_{k-1} accepted); prefix survival is a_k = Π_{i<=k} c_i.
"""
from __future__ import annotations

import torch
import torch.nn as nn


class ConfidenceHead(nn.Module):
    def __init__(self, hidden_size: int, markov_rank: int = 0):
        super().__init__()
        self.proj = nn.Linear(hidden_size + markov_rank, 1)  # fp32 always (see `_apply`)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, h: torch.Tensor, prev_emb: torch.Tensor | None = None) -> torch.Tensor:
        """h [..., d], prev_emb [..., r] or None -> logits [...] fp32."""
        x = h.float() if prev_emb is None else torch.cat([h.float(), prev_emb.float()], dim=-1)
        return self.proj(x).squeeze(-1)

    def _apply(self, fn, recurse=True):
        # keep the head fp32 whatever dtype the drafter is cast to (it is tiny; logits feed calibration)
        super()._apply(fn, recurse)
        for p in self.parameters():
            if p.dtype != torch.float32:
                p.data = p.data.float()
        return self


def soft_label(l1: torch.Tensor) -> torch.Tensor:
    """l1 = ‖p_d - p_t‖₁ [...] -> c* = clamp(1 - l1/2, 0, 1), detached."""
    return (1.0 - 0.5 * l1.detach().float()).clamp_(0.0, 1.0)
