"""Confidence head, its soft label, and Sequential Temperature Scaling (docs/dspark.md §4).

    c_k = σ(w·[h_k; W1[x_{k-1}]] + b)          `confidence_head.proj`, Linear(d + r -> 1), kept in fp32
    soft label  c*_k = clamp(1 - ½‖p_d,k - p_t,k‖₁, 0, 1), detached

c_k estimates P(x_k accepted | x_1..x_{k-1} accepted); prefix survival is a_k = Π_{i<=k} c_i.

STS: on held-out full-length rounds with logits z [N, γ] and prefix labels y [N, γ] (y_{n,k} = 1 iff the first k
drafts were all accepted), fit T_1..T_γ left to right: T_k = argmin_T ECE(Π_{i<k} σ(z_i/T_i) · σ(z_k/T), y_k), with
earlier temperatures fixed.  Deployed c_k = σ(z_k / T_k) (monotone in z_k: rankings unchanged).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

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


def apply_sts(logits: torch.Tensor, temperatures) -> torch.Tensor:
    """logits [..., γ] -> logits / T_k (None temperatures: unchanged)."""
    if temperatures is None:
        return logits
    t = torch.as_tensor(temperatures, dtype=logits.dtype, device=logits.device)
    return logits / t


# --- metrics (per position) ------------------------------------------------------------------------------------
def ece(probs: torch.Tensor, labels: torch.Tensor, n_bins: int = 20) -> float:
    """Expected calibration error with `n_bins` equal-width bins on [0, 1]: Σ_b |B_b|/N · |mean(p) - mean(y)|."""
    p = probs.detach().double().flatten()
    y = labels.detach().double().flatten()
    if p.numel() == 0:
        return float("nan")
    idx = (p * n_bins).long().clamp_(0, n_bins - 1)
    cnt = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, idx, torch.ones_like(p))
    sp = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, idx, p)
    sy = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, idx, y)
    return float((sp - sy).abs().sum() / p.numel())


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties); nan if one class is absent."""
    s = scores.detach().double().flatten()
    y = labels.detach().flatten().bool()
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = torch.argsort(s)
    s_sorted = s[order]
    ranks = torch.empty_like(s)
    ranks[order] = torch.arange(1, s.numel() + 1, dtype=torch.float64)
    # average ranks over ties
    uniq, inv, counts = torch.unique_consecutive(s_sorted, return_inverse=True, return_counts=True)
    if uniq.numel() < s.numel():
        csum = torch.cumsum(counts, 0).double()
        avg = csum - (counts.double() - 1) / 2
        ranks[order] = avg[inv]
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def brier(probs: torch.Tensor, labels: torch.Tensor) -> float:
    p = probs.detach().double().flatten()
    return float(((p - labels.detach().double().flatten()) ** 2).mean()) if p.numel() else float("nan")


@dataclass
class CalibrationReport:
    ece: list[float]  # per position, of the cumulative product a_k vs prefix label
    auroc: list[float]
    brier: list[float]


def calibration_report(logits: torch.Tensor, prefix_labels: torch.Tensor, temperatures=None,
                       n_bins: int = 20) -> CalibrationReport:
    """logits [N, γ] raw confidence logits, prefix_labels [N, γ] in {0,1} -> per-position ECE / AUROC / Brier of
    the survival a_k = Π_{i<=k} σ(z_i / T_i)."""
    a = torch.sigmoid(apply_sts(logits.double(), temperatures)).cumprod(-1)
    y = prefix_labels.double()
    G = logits.shape[-1]
    return CalibrationReport(ece=[ece(a[:, k], y[:, k], n_bins) for k in range(G)],
                             auroc=[auroc(a[:, k], y[:, k]) for k in range(G)],
                             brier=[brier(a[:, k], y[:, k]) for k in range(G)])


def default_sts_grid() -> torch.Tensor:
    """Log-spaced temperatures 0.05 .. 20 (161 points, includes 1.0)."""
    return torch.logspace(math.log10(0.05), math.log10(20.0), 161, dtype=torch.float64)


def fit_sts(logits: torch.Tensor, prefix_labels: torch.Tensor, grid=None, n_bins: int = 20,
            objective: str = "ece") -> list[float]:
    """Sequential temperature scaling: one temperature per position, fitted left to right by grid search.

    logits [N, γ] raw confidence logits of full-length rounds, prefix_labels [N, γ] (1 iff drafts 1..k all accepted).
    Returns [T_1, .., T_γ].  Ties on the grid prefer the temperature closest to 1.

    objective "ece" is the paper's (binned ECE of the cumulative product).  Caveat: ECE is minimised by flat
    predictions too, so on small / already-calibrated sets it can pick a very large T (loss of resolution);
    "brier" (a proper scoring rule, same left-to-right procedure) does not have that failure mode.
    """
    if objective not in ("ece", "brier"):
        raise ValueError(f"fit_sts: objective must be 'ece' or 'brier', got {objective!r}")
    score = (lambda p, y: ece(p, y, n_bins)) if objective == "ece" else brier
    z = logits.detach().double()
    y = prefix_labels.detach().double()
    if z.shape != y.shape or z.dim() != 2:
        raise ValueError(f"fit_sts: logits and prefix_labels must both be [N, γ], got {tuple(z.shape)} "
                         f"and {tuple(y.shape)}")
    grid = default_sts_grid() if grid is None else torch.as_tensor(grid, dtype=torch.float64)
    if (grid <= 0).any():
        raise ValueError("fit_sts: temperatures must be > 0")
    prefix = torch.ones(z.shape[0], dtype=torch.float64)  # Π_{i<k} σ(z_i / T_i)
    temps: list[float] = []
    for k in range(z.shape[1]):
        best = None
        for T in grid.tolist():
            e = score(prefix * torch.sigmoid(z[:, k] / T), y[:, k])
            key = (round(e, 12), abs(math.log(T)))
            if best is None or key < best[0]:
                best = (key, T)
        T_k = best[1]
        temps.append(float(T_k))
        prefix = prefix * torch.sigmoid(z[:, k] / T_k)
    return temps
