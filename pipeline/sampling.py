"""Sampling parameters and the ONE function that turns logits into a sampling distribution.

The same `probs_from_logits` is applied to the target's and the drafter's logits, so temperature / top-k / top-p
shape both distributions identically (a requirement of lossless speculative sampling).  Probabilities are fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_EPS = 1e-5  # temperature below this means greedy (argmax), as in DSPARK.md §3


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self):
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] (any dtype) -> fp32 probabilities [..., V] after temperature, top-k, top-p.

    Greedy -> one-hot on the argmax (ties: lowest index, as torch.argmax).
    """
    logits = logits.float()
    if params.greedy:
        out = torch.zeros_like(logits)
        out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return out
    logits = logits / params.temperature
    V = logits.shape[-1]
    if 0 < params.top_k < V:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (always keep the first token)
        cum = sorted_probs.cumsum(-1)
        drop_sorted = (cum - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """probs [..., V] fp32 -> token ids [...] (int64).  Inverse-CDF with one uniform per row (reproducible)."""
    flat = probs.reshape(-1, probs.shape[-1])
    u = torch.rand(flat.shape[0], 1, generator=generator, dtype=torch.float64)
    cdf = flat.double().cumsum(-1)
    cdf = cdf / cdf[:, -1:]
    idx = torch.searchsorted(cdf, u).clamp_max(flat.shape[-1] - 1)
    # never pick a zero-probability token through rounding at the boundary
    bad = flat.gather(-1, idx) <= 0
    if bad.any():
        idx[bad] = flat[bad.squeeze(-1)].argmax(-1, keepdim=True)
    return idx.squeeze(-1).reshape(probs.shape[:-1])
