"""Calibration of the confidence head (docs/dspark.md §4): offline Sequential Temperature Scaling, its metrics,
and the online correction the cost-aware schedulers apply to live traffic.

Offline (STS): on held-out full-length rounds with logits z [N, γ] and prefix labels y [N, γ] (y_{n,k} = 1 iff the
first k drafts were all accepted), fit T_1..T_γ left to right: T_k = argmin_T ECE(Π_{i<k} σ(z_i/T_i) · σ(z_k/T),
y_k), with earlier temperatures fixed.  Deployed c_k = σ(z_k / T_k) (monotone in z_k: rankings unchanged).
The rounds come from real engine rollouts: ``pipeline.eval.sts_rollouts``.

Online: ``OnlineCalibration`` compares realised acceptance with predicted survival over recent rounds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


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


def calibrated_confidence(conf_logits: torch.Tensor, temperatures: Sequence[float] | None = None) -> torch.Tensor:
    """c_k = σ(z_k / T_k) in float64 (STS, docs/dspark.md §4); T = 1 where not given."""
    z = conf_logits.double()
    if temperatures is not None:
        T = torch.ones(z.shape[-1], dtype=torch.float64)
        t = torch.as_tensor(list(temperatures)[:z.shape[-1]], dtype=torch.float64)
        T[:t.numel()] = t
        z = z / T.to(z.device)
    return torch.sigmoid(z)


class OnlineCalibration:
    """Realised acceptance vs predicted survival, per depth position, over recent rounds (docs/dspark.md §4 calibrates
    the confidence head offline, on held-out training data; live traffic can differ, and an over-confident head makes
    Algorithm 1 verify drafts that are then rejected).

    After each round the engine reports, per drafted request, how many drafts were verified (L) and accepted (m).
    For every position j <= L the scheduler had predicted survival a_j; the realised event is m >= j.  With
    exponentially decayed sums P_j (predicted) and A_j (realised) and a prior of ``prior`` pseudo-rounds at ratio 1,
    the correction is ρ_j = (A_j + prior) / (P_j + prior) and the scheduler uses a'_j = min(1, ρ_j · a_j), made
    non-increasing in j.  ρ comes from past rounds only, so the depth rule stays lossless.
    """

    def __init__(self, decay: float = 0.98, prior: float = 4.0):
        self.decay, self.prior = float(decay), float(prior)
        self.pred = torch.zeros(0, dtype=torch.float64)  # grows to γ on first use
        self.real = torch.zeros(0, dtype=torch.float64)

    def _grow(self, g: int):
        if self.pred.numel() < g:
            pad = torch.zeros(g - self.pred.numel(), dtype=torch.float64)
            self.pred, self.real = torch.cat([self.pred, pad]), torch.cat([self.real, pad.clone()])

    def ratio(self, g: int) -> torch.Tensor:
        self._grow(g)
        return ((self.real + self.prior) / (self.pred + self.prior))[:g]

    def apply(self, a: torch.Tensor) -> torch.Tensor:
        """a [R, γ] survival -> corrected survival (same zeros beyond each request's max depth)."""
        if a.numel() == 0:
            return a
        rho = self.ratio(a.shape[-1]).to(a.device)
        out = (a.double() * rho).clamp(max=1.0)
        return torch.cummin(out, dim=-1).values

    def observe(self, a: torch.Tensor, verified: Sequence[int], accepted: Sequence[int]) -> None:
        """a [R, γ] the survival the round was scheduled with; verified L_r, accepted m_r per row."""
        g = a.shape[-1]
        self._grow(g)
        j = torch.arange(1, g + 1)
        L = torch.as_tensor(list(verified), dtype=torch.long)[:, None]
        m = torch.as_tensor(list(accepted), dtype=torch.long)[:, None]
        seen = (j[None, :] <= L).double()
        self.pred[:g] = self.decay * self.pred[:g] + (a.double().cpu() * seen).sum(0)
        self.real[:g] = self.decay * self.real[:g] + ((j[None, :] <= m).double() * seen).sum(0)

    def to_dict(self) -> dict:
        return {"ratio": [round(float(x), 4) for x in self.ratio(self.pred.numel())]}
