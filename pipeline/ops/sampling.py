"""Sampling parameters and the ONE function that turns logits into a sampling distribution.

The same `probs_from_logits` is applied to the target's and the drafter's logits, so temperature / top-k / top-p
shape both distributions identically (a requirement of lossless speculative sampling).  Probabilities are fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_EPS = 1e-5  # temperature below this means greedy (argmax), as in docs/dspark.md §3


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
    if params.temperature != 1.0:
        logits = logits / params.temperature
    V = logits.shape[-1]
    if 0 < params.top_k < V:
        vals, idx = torch.topk(logits, params.top_k, dim=-1)  # sorted, descending
        kth = vals[..., -1:]
        if bool(((logits >= kth).sum(-1) == params.top_k).all()):
            # no ties at the k-th value: the survivors are exactly `idx`; finish on the k candidates only
            return _finish_sorted(logits, vals, idx, params.top_p)
        logits = logits.masked_fill(logits < kth, float("-inf"))  # ties at the k-th value are all kept
    if params.top_p < 1.0:
        k = min(V, TOP_P_CANDIDATES)
        if k < V:
            vals, idx = torch.topk(logits, k, dim=-1)
            sp = (vals - torch.logsumexp(logits, -1, keepdim=True)).exp()  # probs under the full softmax
            if bool((sp.sum(-1) >= params.top_p).all()):
                # the nucleus lies inside the top-k candidates: same result as the full sort, without it
                return _finish_sorted(logits, vals, idx, params.top_p, sp)
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        return _finish_sorted(logits, sorted_logits, idx, params.top_p)
    return logits.softmax(-1)


TOP_P_CANDIDATES = 1024  # the nucleus is first searched among this many top logits (exact; see probs_from_logits)


def _finish_sorted(logits: torch.Tensor, vals: torch.Tensor, idx: torch.Tensor, top_p: float,
                   sp: torch.Tensor | None = None) -> torch.Tensor:
    """Probabilities that are zero outside the candidates ``idx`` (with logits ``vals``, sorted descending, holding
    every token that can survive); top-p keeps the smallest prefix whose mass reaches top_p (always the first).
    ``sp``: the candidates' probabilities under the distribution top-p applies to (default: softmax over vals)."""
    if top_p < 1.0:
        sp = vals.softmax(-1) if sp is None else sp
        keep = (sp.cumsum(-1) - sp) < top_p
        vals = vals.masked_fill(~keep, float("-inf"))
    return torch.zeros_like(logits).scatter_(-1, idx, vals.softmax(-1))


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None = None,
                      u: torch.Tensor | None = None) -> torch.Tensor:
    """probs [..., V] fp32 -> token ids [...] (int64).  Inverse-CDF with one uniform per row (reproducible).

    ``u``: optional pre-drawn uniforms in [0, 1), one per row (shape [...] or [rows]); lets a batch whose rows belong
    to requests with their own generators be sampled in one call.
    """
    flat = probs.reshape(-1, probs.shape[-1])
    if u is None:
        u = torch.rand(flat.shape[0], 1, generator=generator, dtype=torch.float64,
                       device=generator.device if generator is not None else flat.device).to(flat.device)
    else:
        u = u.reshape(-1, 1).to(dtype=torch.float64, device=flat.device)
    cdf = flat.double().cumsum(-1)
    cdf = cdf / cdf[:, -1:]
    idx = torch.searchsorted(cdf, u).clamp_max(flat.shape[-1] - 1)
    # never pick a zero-probability token through rounding at the boundary
    bad = flat.gather(-1, idx) <= 0
    if bad.any():
        idx[bad] = flat[bad.squeeze(-1)].argmax(-1, keepdim=True)
    return idx.squeeze(-1).reshape(probs.shape[:-1])
