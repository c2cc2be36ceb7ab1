"""Verification-depth schedulers (DSPARK.md §6.3, §7) and the SPS(B) cost table.

Every scheduler maps one round's drafts to a depth L_r in {0..max_depth_r} per request: how many of the γ drafts the
target verifies (the round then costs L_r + 1 target tokens).  Inputs are the drafter's confidence LOGITS z_{r,k}
([R, γ] tensor or None); schedulers that use calibrated probabilities apply Sequential Temperature Scaling
(c_k = σ(z_k / T_k), identity when no temperatures are given).

Losslessness: with token-wise (or block) verification, a depth rule is lossless iff the event "x_{r,j} is verified"
depends only on x_{r,<j} (the confidence c_{r,j} is computed from x_{r,j-1}, never from x_{r,j}).  FixedDepth,
StaticThreshold, HardwareAwarePrefix (thanks to the early stop) and AsyncCapacity satisfy it; the look-ahead /
no-break search (``HardwareAwarePrefix(early_stop=False)``) does not -- DSPARK.md Appendix A, see tests/test_scheduler.py.
"""
from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Sequence

import torch

SCHEDULERS = ("fixed", "threshold", "hardware", "async")


# ----------------------------------------------------------------------------------------------------- cost table
class CostTable:
    """Target step time t(B) for B tokens in one forward, and SPS(B) = 1 / t(B).

    Built from measured points (B -> seconds), piecewise-linear in between, linear extrapolation (last segment's slope,
    never decreasing) beyond the last point.  Lookups are O(1) from a dense array up to ``dense_max``.
    """

    def __init__(self, step_seconds: dict, meta: dict | None = None, dense_max: int = 4096):
        if not step_seconds:
            raise ValueError("empty cost table")
        pts = sorted((int(b), float(t)) for b, t in step_seconds.items())
        if pts[0][0] < 1 or any(t <= 0 for _, t in pts):
            raise ValueError(f"bad cost table points {pts}")
        self.points = pts
        self.meta = dict(meta or {})
        self._dense_max = max(dense_max, pts[-1][0])
        self._t = [0.0] + [self._interp(b) for b in range(1, self._dense_max + 1)]
        self._sps = [0.0] + [1.0 / t for t in self._t[1:]]

    def _interp(self, b: int) -> float:
        pts = self.points
        if b <= pts[0][0]:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if b <= b1:
                return t0 + (t1 - t0) * (b - b0) / (b1 - b0)
        if len(pts) == 1:
            return pts[0][1]
        (b0, t0), (b1, t1) = pts[-2], pts[-1]
        slope = max(0.0, (t1 - t0) / (b1 - b0))
        return t1 + slope * (b - b1)

    def step_time(self, B: int) -> float:
        return self._t[B] if 1 <= B <= self._dense_max else self._interp(max(1, int(B)))

    def sps(self, B: int) -> float:
        return self._sps[B] if 1 <= B <= self._dense_max else 1.0 / self._interp(max(1, int(B)))

    @classmethod
    def from_sps(cls, sps: dict | Sequence[float], **kw) -> "CostTable":
        """From SPS values: a dict B -> steps/s, or a sequence (SPS(1), SPS(2), ...)."""
        items = sps.items() if isinstance(sps, dict) else enumerate(sps, start=1)
        return cls({int(b): 1.0 / float(s) for b, s in items}, **kw)

    @classmethod
    def flat(cls, seconds: float = 1.0) -> "CostTable":
        return cls({1: seconds})

    @classmethod
    def profile(cls, runner, batch_sizes: Sequence[int] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
                context_len: int = 300, max_tokens_per_request: int = 8, repeats: int = 5,
                warmup: int = 2) -> "CostTable":
        """Time the target runner's forward for each B (``TargetRunner.time_forward``: B new tokens over
        ceil(B / max_tokens_per_request) requests with ``context_len`` cached tokens each)."""
        pts = {int(b): runner.time_forward(int(b), context_len=context_len,
                                           max_tokens_per_request=max_tokens_per_request, repeats=repeats,
                                           warmup=warmup) for b in batch_sizes}
        meta = {"context_len": context_len, "max_tokens_per_request": max_tokens_per_request, "repeats": repeats,
                "device": str(getattr(runner, "device", "")), "dtype": str(getattr(runner, "dtype", "")),
                "threads": torch.get_num_threads()}
        return cls(pts, meta=meta)

    def to_dict(self) -> dict:
        return {"step_seconds": {str(b): t for b, t in self.points}, "meta": self.meta}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "CostTable":
        d = json.loads(Path(path).read_text())
        return cls({int(b): float(t) for b, t in d["step_seconds"].items()}, meta=d.get("meta"))


# ----------------------------------------------------------------------------------------------------- helpers
def calibrated_confidence(conf_logits: torch.Tensor, temperatures: Sequence[float] | None = None) -> torch.Tensor:
    """c_k = σ(z_k / T_k) in float64 (STS, DSPARK.md §4); T = 1 where not given."""
    z = conf_logits.double()
    if temperatures is not None:
        T = torch.ones(z.shape[-1], dtype=torch.float64)
        t = torch.as_tensor(list(temperatures)[:z.shape[-1]], dtype=torch.float64)
        T[:t.numel()] = t
        z = z / T.to(z.device)
    return torch.sigmoid(z)


def survival(conf: torch.Tensor, max_depth: Sequence[int]) -> torch.Tensor:
    """a_{r,j} = prod_{i<=j} c_{r,i}, zeroed beyond each request's max depth.  [R, γ] float64."""
    a = conf.double().cumprod(-1)
    g = a.shape[-1]
    md = torch.as_tensor(list(max_depth), dtype=torch.long, device=a.device).clamp(0, g)
    keep = torch.arange(g, device=a.device)[None, :] < md[:, None]
    return torch.where(keep, a, torch.zeros_like(a))


def sorted_candidates(a: torch.Tensor) -> list:
    """E = {(r, j): a_{r,j} > 0} sorted by a descending; ties -> smaller j, then smaller r (keeps prefixes).
    j is 1-based.  Returns [(a, r, j), ...]."""
    R, g = a.shape
    vals = a.reshape(-1).tolist()
    ents = [(v, i // g, i % g + 1) for i, v in enumerate(vals) if v > 0]
    ents.sort(key=lambda e: (-e[0], e[2], e[1]))
    return ents


def greedy_prefix_search(a: torch.Tensor, cost: CostTable, early_stop: bool = True, base_tokens: int = 0,
                         base_tau: float = 0.0, budget: int | None = None):
    """Algorithm 1.  Returns (depths, K) where K is the number of admitted draft tokens.

    early_stop=True: stop at the first candidate that does not raise Θ = τ·SPS(B) (lossless).  False: walk the whole
    sorted list and keep the best prefix (the 'unconstrained' search; lossy if used on current confidences).
    base_tokens / base_tau: target tokens and emitted tokens per round of OTHER work on the same hardware, so that
    Θ = (base_tau + τ)·SPS(base_tokens + B) (0, 0 = the paper's Algorithm 1); budget caps B (this batch's tokens).
    """
    R = a.shape[0]
    ents = sorted_candidates(a)
    B, tau = R, float(R)
    best = (base_tau + tau) * cost.sps(base_tokens + B)
    best_k = 0
    for k, (v, r, j) in enumerate(ents, start=1):
        B += 1
        tau += v
        if budget is not None and B > budget:
            break
        th = (base_tau + tau) * cost.sps(base_tokens + B)
        if th > best:
            best, best_k = th, k
        elif early_stop:
            break
    depths = [0] * R
    for v, r, j in ents[:best_k]:
        depths[r] = max(depths[r], j)
    return depths, best_k


# ----------------------------------------------------------------------------------------------------- schedulers
class VerificationScheduler:
    """depths = scheduler.schedule(conf_logits [R, γ] or None, max_depth per request)."""

    name = "base"
    needs_confidence = False

    def schedule(self, conf_logits: torch.Tensor | None, max_depth: Sequence[int]) -> list:
        raise NotImplementedError

    def draft_this_round(self, num_requests: int) -> bool:
        """False when this round will verify no draft whatever the drafter proposes: the engine then skips the
        drafting round (block forward, sequential loop, confidences) and decodes one token per request."""
        return True

    def reset(self) -> None:
        pass


class FixedDepth(VerificationScheduler):
    """Verify min(k, max_depth) drafts (k = None: all of them)."""

    name = "fixed"

    def __init__(self, k: int | None = None):
        self.k = k

    def schedule(self, conf_logits, max_depth):
        return [int(m) if self.k is None else min(int(self.k), int(m)) for m in max_depth]

    def draft_this_round(self, num_requests):
        return self.k is None or self.k > 0


class StaticThreshold(VerificationScheduler):
    """L = number of leading drafts whose RAW per-step confidence σ(z_k) >= θ (DeepSpec's ``--confidence-threshold``:
    truncate before the first k with σ(z_k) < θ).  θ <= 0 -> full depth."""

    name = "threshold"
    needs_confidence = True

    def __init__(self, theta: float):
        self.theta = float(theta)

    def schedule(self, conf_logits, max_depth):
        if self.theta <= 0 or conf_logits is None:
            return [int(m) for m in max_depth]
        ok = (torch.sigmoid(conf_logits.double()) >= self.theta).long().cumprod(-1).sum(-1).tolist()
        return [min(int(o), int(m)) for o, m in zip(ok, max_depth)]


class _SharedHardware:
    """Other work on the same hardware (B_0 target tokens, τ_0 emitted tokens per round; set before a round, so the
    depth rule stays lossless) and an optional cap on this batch's target tokens.  B_0 = τ_0 = 0, no budget: the
    paper's Algorithm 1 on its own batch."""

    base_tokens: int = 0
    base_tau: float = 0.0
    budget: int | None = None

    def set_load(self, base_tokens: int, base_tau: float) -> None:
        self.base_tokens, self.base_tau = int(base_tokens), float(base_tau)

    def _search(self, a: torch.Tensor, early_stop: bool):
        return greedy_prefix_search(a, self.cost, early_stop=early_stop, base_tokens=self.base_tokens,
                                    base_tau=self.base_tau, budget=self.budget)

    def _budget_left(self, num_requests: int) -> bool:
        """False when the R bonus tokens alone use up the budget."""
        return self.budget is None or self.budget > num_requests

    def _draft_unless_idle(self, num_requests: int, nothing_to_verify: bool) -> bool:
        """The drafting decision both schedulers share: never when the R bonus tokens alone use up the budget;
        while the past rounds say nothing would be verified, skip, but draft every ``refresh_every``-th such round
        anyway so the decision can follow the load."""
        if not self._budget_left(num_requests):
            return False
        if nothing_to_verify and self._skipped + 1 < self.refresh_every:
            self._skipped += 1
            return False
        self._skipped = 0
        return True


class HardwareAwarePrefix(_SharedHardware, VerificationScheduler):
    """DSPARK.md §7, Algorithm 1: greedy admission of (r, j) by calibrated survival a_{r,j}, maximising
    Θ = τ·SPS(B), with the early stop (first non-improving candidate ends the search).

    early_stop=False gives the look-ahead variant, kept only to demonstrate that it is NOT lossless.

    Back-off: when a drafted round admitted no draft at all, the next ``refresh_every - 1`` rounds skip drafting
    (decode one token per request) and the one after drafts again to look.  The decision uses past rounds only, so it
    stays lossless; it saves the drafting cost while the drafts are not worth verifying.  refresh_every=1: off.
    """

    name = "hardware"
    needs_confidence = True

    def __init__(self, cost: CostTable, temperatures: Sequence[float] | None = None, early_stop: bool = True,
                 budget: int | None = None, refresh_every: int = 4):
        if refresh_every < 1:
            raise ValueError(f"refresh_every must be >= 1, got {refresh_every}")
        self.cost = cost
        self.temperatures = temperatures
        self.early_stop = early_stop
        self.budget = budget
        self.last_theta = None
        self.refresh_every = refresh_every
        self._nothing_admitted = False
        self._skipped = 0

    def reset(self):
        self._nothing_admitted = False
        self._skipped = 0

    def schedule(self, conf_logits, max_depth):
        if conf_logits is None:
            raise ValueError("HardwareAwarePrefix needs confidence logits (a DSpark drafter)")
        a = survival(calibrated_confidence(conf_logits, self.temperatures), max_depth)
        depths, _ = self._search(a, self.early_stop)
        self._nothing_admitted = not any(depths)
        return depths

    def draft_this_round(self, num_requests):
        return self._draft_unless_idle(num_requests, self._nothing_admitted)


class AsyncCapacity(_SharedHardware, VerificationScheduler):
    """DSPARK.md §7 production adaptation: the capacity (total verify tokens B_cap) comes from the UNCONSTRAINED
    (no-break) search on confidences from ``lag`` rounds earlier; this round admits the top-(B_cap - R) candidates
    ranked by their CURRENT survival a_{r,j} (ties -> smaller j, so each request keeps a prefix).

    B_cap never depends on this round's tokens, and (r, j) is admitted iff fewer than K candidates outrank it, which
    depends only on x_{r,<j} and on other requests: lossless.  Before ``lag`` rounds of history exist,
    ``initial_capacity`` (None -> verify everything) is used.
    """

    name = "async"
    needs_confidence = True

    def __init__(self, cost: CostTable, temperatures: Sequence[float] | None = None, lag: int = 2,
                 initial_capacity: int | None = None, refresh_every: int = 4, budget: int | None = None):
        if lag < 1:
            raise ValueError("lag must be >= 1 (lag 0 would use the current tokens: lossy)")
        self.cost = cost
        self.temperatures = temperatures
        self.lag = lag
        self.initial_capacity = initial_capacity
        self._hist: deque = deque(maxlen=lag)
        self.last_capacity = None
        self.refresh_every = refresh_every
        self._skipped = 0
        self.budget = budget

    def reset(self):
        self._hist.clear()
        self._skipped = 0

    def draft_this_round(self, num_requests):
        """Skip drafting while the lagged capacity leaves no verify token beyond the R bonus tokens; every
        ``refresh_every``-th such round drafts anyway so the capacity history follows the load.  A budget used up
        by the bonus tokens alone skips drafting outright."""
        cap = self.capacity()
        return self._draft_unless_idle(num_requests, cap is not None and cap <= num_requests)

    def capacity(self) -> int | None:
        """Total verify tokens B_cap for the coming round (None: no history yet)."""
        if len(self._hist) < self.lag:
            return self.initial_capacity
        return self._hist[0]

    def schedule(self, conf_logits, max_depth):
        if conf_logits is None:
            raise ValueError("AsyncCapacity needs confidence logits (a DSpark drafter)")
        R = len(max_depth)
        a = survival(calibrated_confidence(conf_logits, self.temperatures), max_depth)
        cap = self.capacity()
        K = sum(int(m) for m in max_depth) if cap is None else max(0, int(cap) - R)
        if self.budget is not None:
            K = min(K, max(0, self.budget - R))
        depths = [0] * R
        for v, r, j in sorted_candidates(a)[:K]:
            depths[r] = max(depths[r], j)
        self.last_capacity = R + K if cap is not None else None
        # this round's capacity, used `lag` rounds from now
        _, k_best = self._search(a, early_stop=False)
        self._hist.append(R + k_best)
        return depths


def make_scheduler(name: str | VerificationScheduler | None, *, num_speculative_tokens: int | None = None,
                   cost_table: CostTable | str | Path | None = None, threshold: float = 0.0,
                   temperatures: Sequence[float] | None = None, lag: int = 2) -> VerificationScheduler:
    if isinstance(name, VerificationScheduler):
        return name
    name = name or "fixed"
    if name == "fixed":
        return FixedDepth(num_speculative_tokens)
    if name == "threshold":
        return StaticThreshold(threshold)
    if isinstance(cost_table, (str, Path)):
        cost_table = CostTable.load(cost_table)
    if name in ("hardware", "async") and cost_table is None:
        raise ValueError(f"scheduler {name!r} needs a cost table (CostTable.profile(runner) or a JSON file)")
    if name == "hardware":
        return HardwareAwarePrefix(cost_table, temperatures)
    if name == "async":
        return AsyncCapacity(cost_table, temperatures, lag=lag)
    raise ValueError(f"unknown scheduler {name!r}; choose from {SCHEDULERS}")
