"""Verification-depth schedulers (docs/dspark.md §6.3, §7), priced by the SPS(B) cost table (pipeline/engine/cost_table.py).

Every scheduler maps one round's drafts to a depth L_r in {0..limit_r} per request: how many of the γ drafts the
target verifies (the round then costs L_r + 1 target tokens).  Inputs are the drafter's confidence LOGITS z_{r,k}
([R, γ] tensor or None); schedulers that use calibrated probabilities apply Sequential Temperature Scaling
(c_k = σ(z_k / T_k), identity when no temperatures are given).

Losslessness: with token-wise (or block) verification, a depth rule is lossless iff the event "x_{r,j} is verified"
depends only on x_{r,<j} (the confidence c_{r,j} is computed from x_{r,j-1}, never from x_{r,j}).  FixedDepth,
StaticThreshold, Algorithm1 (thanks to the early stop) and AsyncCapacity satisfy it; the look-ahead /
no-break search (``Algorithm1(early_stop=False)``) does not -- docs/dspark.md Appendix A, see tests/test_scheduler.py.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from pathlib import Path
from typing import Sequence

import torch

from pipeline.dspark.calibration import OnlineCalibration, calibrated_confidence
from pipeline.engine.cost_table import CostTable

SCHEDULERS = ("fixed", "threshold", "hardware", "async")


# ----------------------------------------------------------------------------------------------------- helpers
def survival(conf: torch.Tensor, limits: Sequence[int]) -> torch.Tensor:
    """a_{r,j} = prod_{i<=j} c_{r,i}, zeroed beyond each request's max depth.  [R, γ] float64."""
    a = conf.double().cumprod(-1)
    g = a.shape[-1]
    md = torch.as_tensor(list(limits), dtype=torch.long, device=a.device).clamp(0, g)
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
                         base_tau: float = 0.0, budget: int | None = None, round_seconds=None):
    """Algorithm 1.  Returns (depths, K) where K is the number of admitted draft tokens.

    early_stop=True: stop at the first candidate that does not raise Θ = τ·SPS(B) (lossless).  False: walk the whole
    sorted list and keep the best prefix (the 'unconstrained' search; lossy if used on current confidences).
    base_tokens / base_tau: target tokens and emitted tokens per round of OTHER work on the same hardware, so that
    Θ = (base_tau + τ)·SPS(base_tokens + B) (0, 0 = the paper's Algorithm 1); budget caps B (this batch's tokens).
    round_seconds: B -> seconds of the whole round (default: the table's step time t(base_tokens + B)); with it
    Θ = (base_tau + τ) / round_seconds(B), so costs the table does not hold (the drafting round, engine overhead,
    a live correction of the profile) enter the objective.  They are fixed before the round: still lossless.
    """
    if round_seconds is None:
        round_seconds = lambda b: cost.step_time(base_tokens + b)  # noqa: E731
    R = a.shape[0]
    ents = sorted_candidates(a)
    B, tau = R, float(R)
    best = (base_tau + tau) / round_seconds(B)
    best_k = 0
    for k, (v, r, j) in enumerate(ents, start=1):
        B += 1
        tau += v
        if budget is not None and B > budget:
            break
        th = (base_tau + tau) / round_seconds(B)
        if th > best:
            best, best_k = th, k
        elif early_stop:
            break
    depths = [0] * R
    for v, r, j in ents[:best_k]:
        depths[r] = max(depths[r], j)
    return depths, best_k


def admitted_survival(a: torch.Tensor, depths: Sequence[int]) -> float:
    """Σ_r Σ_{j <= L_r} a_{r,j}: the expected number of accepted drafts of a round verified at these depths."""
    g = a.shape[-1]
    L = torch.as_tensor(list(depths), dtype=torch.long, device=a.device)
    keep = torch.arange(g, device=a.device)[None, :] < L[:, None]
    return float(torch.where(keep, a.double(), torch.zeros_like(a, dtype=torch.float64)).sum())


def ema(old: float | None, new: float, weight: float) -> float:
    """Exponential moving average; the first value (old None) starts it."""
    return new if old is None else old + weight * (new - old)


def gain_bucket(R: int) -> int:
    """The realized gain is kept per batch size class: 1, 2, 3, then the power of two nearest R (4: 4-5, 8: 6-11,
    16: 12-22, ...), so a batch that moves by a request or two as streams come and go keeps its verdict."""
    R = int(R)
    return R if R <= 3 else 1 << round(math.log2(R))


class LiveRoundCost:
    """What a round costs beyond the profiled target step, measured live (the engine reports every round through
    ``VerificationScheduler.observe_round``):

      * draft seconds of one drafting round (block forward + sequential loop + confidences) for R requests (an EMA
        per R, interpolated between observed R, flat beyond them; 0 until a round was drafted);
      * overhead seconds per round outside drafting and the target forward (rejection sampler, bookkeeping);
      * the target forward's seconds per round shape (R requests, B tokens; an EMA per shape), so the price of B
        tokens for R requests follows what such forwards take in this process, not only the profile's shape: a
        profile taken while other processes start on the same cores can price 8 tokens at 1.4x one token when live
        they cost about the same.  Between the B measured at one R the price is linear in B; beyond them it follows
        the profile's shape from the nearest measured one (so each deeper verification measured moves the price of
        the next); an R never measured gets the profile at ``scale`` (``target_price``);
      * scale = measured / profiled target step time over all rounds (an EMA), so a table profiled on a quieter or
        busier machine is corrected to today's speed without changing its shape;
      * what drafting actually gave, per R: the realized gain = tokens per second of the rounds that drafted (those
        that then verified nothing included: they paid for the drafts) ÷ those of a plain round of the same R (a
        measured plain round of that R when there is one, else the model's), as a ratio of averaged tokens and
        seconds (a running mean over the first 1/gain_alpha drafted rounds, then an EMA), trusted from
        ``min_gain_rounds`` rounds on: one round's accepted count is too noisy (0..γ) to judge by.  The model
        prices a round by its token count B alone, but a ragged verification batch (a few deep rows among many
        single-token ones) pads its attention to R x max depth, so it costs more than the table's price for its B
        (measurements: docs/results/load_test.md).  The realized gain tells the schedulers when drafting stopped
        paying: below ``loss_margin`` (0.9, a margin for the noise of a shared machine), per batch size class
        (``gain_bucket``).

    Round time (drafted): target_R(B) + overhead + draft(R); not drafted: target_R(R) + overhead.
    """

    def __init__(self, alpha: float = 0.2, gain_alpha: float = 0.05, min_gain_rounds: int = 8,
                 loss_margin: float = 0.9):
        self.alpha = float(alpha)
        self.gain_alpha = float(gain_alpha)
        self.min_gain_rounds = int(min_gain_rounds)
        self.loss_margin = float(loss_margin)
        self.draft: dict = {}
        self.draft_best: dict = {}  # R -> the fastest drafting round of R requests seen (the best case)
        self.drafted_rounds = 0
        self.overhead_s = 0.0
        self.scale = 1.0
        self.rounds = 0
        self.plain_s: dict = {}  # R -> EMA seconds of a round that drafted nothing
        self.plain_at: dict = {}  # R -> the round count at the last round of R requests that drafted nothing
        self.target_by_shape: dict = {}  # R -> {B: EMA seconds of the target forward of R requests, B tokens}
        # gain_bucket(R) -> [drafted rounds, mean tokens per request, mean round seconds, mean plain-round seconds]
        self._drafted: dict = {}

    def _ema(self, old: float | None, new: float) -> float:
        return ema(old, new, self.alpha)

    def observe(self, cost: CostTable, num_drafted: int, draft_s: float, target_tokens: int, target_s: float,
                round_s: float, verified: int = 0, accepted: int = 0) -> None:
        """verified / accepted: drafts verified and accepted over the round's requests (0 / 0: none verified)."""
        R = int(target_tokens) - int(verified)  # requests in the round (one anchor row each)
        if R > 0 and round_s > 0:
            if num_drafted == 0:
                self.plain_s[R] = self._ema(self.plain_s.get(R), float(round_s))
                self.plain_at[R] = self.rounds
            else:  # a drafted round, whatever it verified: one that admitted nothing paid for its drafts too
                plain = self.plain_s.get(R)
                if plain is None:
                    plain = self.scale * cost.step_time(R) + self.overhead_s
                v = self._drafted.setdefault(gain_bucket(R), [0, 0.0, 0.0, 0.0])
                v[0] += 1
                w = max(1.0 / v[0], self.gain_alpha)
                for i, x in ((1, (R + int(accepted)) / R), (2, float(round_s)), (3, plain)):
                    v[i] += w * (x - v[i])
        if num_drafted > 0 and draft_s > 0:
            self.draft[int(num_drafted)] = self._ema(self.draft.get(int(num_drafted)), float(draft_s))
            self.draft_best[int(num_drafted)] = min(self.draft_best.get(int(num_drafted), math.inf), float(draft_s))
            self.drafted_rounds += 1
        if R > 0 and target_s > 0:
            shape = self.target_by_shape.setdefault(R, {})
            shape[int(target_tokens)] = self._ema(shape.get(int(target_tokens)), float(target_s))
        if target_tokens > 0 and target_s > 0:
            ratio = min(10.0, max(0.1, target_s / cost.step_time(int(target_tokens))))
            self.scale = self._ema(self.scale if self.rounds else None, ratio)
            self.overhead_s = self._ema(self.overhead_s if self.rounds else None,
                                        max(0.0, round_s - target_s - draft_s))
            self.rounds += 1

    def target_price(self, cost: CostTable, R: int, base: int = 0, verify: bool = False):
        """B -> seconds of the target forward of a round of R requests and B tokens, beside ``base`` target tokens of
        other work: between the B measured at this R, linear in B; below and beyond them, the nearest measured
        forward scaled by the profile's shape (``verify``: the price a verification round gets,
        ``CostTable.verify_time``); an R never measured, the profile at the overall ``scale``."""
        table = cost.verify_time if verify else cost.step_time
        shape = self.target_by_shape.get(int(R))
        if not shape:
            scale = self.scale
            return lambda B: scale * table(base + B)  # noqa: E731
        pts = sorted(shape.items())
        bs = [b for b, _ in pts]

        def price(B: int) -> float:
            i = bisect.bisect_left(bs, B)
            if i < len(bs) and bs[i] == B:
                t = pts[i][1]
            elif i == 0 or i == len(bs):
                b0, t0 = pts[0] if i == 0 else pts[-1]
                t = t0 * table(B) / table(b0)
            else:
                (b0, t0), (b1, t1) = pts[i - 1], pts[i]
                t = t0 + (t1 - t0) * (B - b0) / (b1 - b0)
            return t * table(base + B) / table(B) if base else t
        return price

    def plain_stale(self, R: int, every: int) -> bool:
        """True when drafting has been measured and a plain round of R requests has not, or not within the last
        ``every`` rounds (the reference the realized gain and the live price of a plain round stand on)."""
        return self.drafted_rounds > 0 and self.rounds - self.plain_at.get(int(R), -math.inf) > every

    def new_table(self) -> None:
        """The profiled table was replaced: the scale (relative to the old one) starts over."""
        self.scale, self.rounds = 1.0, 0

    def drafting_lost(self, R: int) -> bool:
        """True when the drafted rounds of about R requests measured so far (at least ``min_gain_rounds``) gave
        under ``loss_margin`` x the tokens per second of plain rounds (fewer observed: False, the model decides)."""
        v = self._drafted.get(gain_bucket(R))
        return v is not None and v[0] >= self.min_gain_rounds and self.realized_gain(R) < self.loss_margin

    def realized_gain(self, R: int) -> float | None:
        """Tokens/s of the drafted rounds of about R requests (``gain_bucket``) ÷ a plain round's (None before
        any): averaged tokens per request per round x averaged plain-round seconds ÷ averaged round seconds."""
        v = self._drafted.get(gain_bucket(R))
        return None if v is None else v[1] * v[3] / v[2]

    def draft_seconds(self, R: int, best: bool = False) -> float:
        """Seconds of a drafting round of R requests (EMA per R, interpolated); best: the fastest seen instead (a
        request's first drafting round also feeds its whole prompt to the drafter, once)."""
        table = self.draft_best if best else self.draft
        if not table:
            return 0.0
        if R in table:
            return table[R]
        ks = sorted(table)
        if R <= ks[0]:
            return table[ks[0]]
        if R >= ks[-1]:
            return table[ks[-1]]
        hi = next(k for k in ks if k > R)
        lo = max(k for k in ks if k < R)
        return table[lo] + (table[hi] - table[lo]) * (R - lo) / (hi - lo)

    def to_dict(self) -> dict:
        return {"draft_s": {str(k): round(v, 5) for k, v in sorted(self.draft.items())},
                "overhead_s": round(self.overhead_s, 5), "scale": round(self.scale, 4), "rounds": self.rounds,
                "plain_s": {str(k): round(v, 5) for k, v in sorted(self.plain_s.items())},
                "target_ms": {str(r): {str(b): round(t * 1e3, 2) for b, t in sorted(d.items())}
                              for r, d in sorted(self.target_by_shape.items())},  # R -> B -> ms
                "realized_gain": {str(k): [v[0], round(self.realized_gain(k), 4)] for k, v in
                                  sorted(self._drafted.items())}}  # bucket -> [rounds, gain]


# ----------------------------------------------------------------------------------------------------- schedulers
class VerificationScheduler:
    """depths = scheduler.schedule(conf_logits [R, γ] or None, limits: the most drafts each request may verify)."""

    name = "base"
    needs_confidence = False

    def schedule(self, conf_logits: torch.Tensor | None, limits: Sequence[int]) -> list:
        raise NotImplementedError

    takes_round_budget = False  # True: schedule() keeps the round's draft budget itself (set_round)

    def draft_this_round(self, num_requests: int) -> bool:
        """False when this round will verify no draft whatever the drafter proposes: the engine then skips the
        drafting round (block forward, sequential loop, confidences) and decodes one token per request."""
        return True

    def set_round(self, other_tokens: int, budget: int | None) -> None:
        """Before a round is drafted: the target tokens of this round's other work (prefill chunks) and the most
        target tokens the decoding requests may use (their anchors plus verified drafts; None: no cap).  Both are
        fixed before any draft exists, so a depth rule that respects them stays lossless.  Schedulers that do not
        take the budget get their requests' limits cut to it by the engine."""

    def observe_round(self, num_drafted: int, draft_s: float, target_tokens: int, target_s: float,
                      round_s: float) -> None:
        """The engine's measurements of a decode round (no prefill in it): requests drafted and the drafting
        seconds, target tokens and forward seconds, the whole round's seconds.  Cost-aware schedulers learn from
        them; the others ignore them."""

    def observe_acceptance(self, verified: Sequence[int], accepted: Sequence[int]) -> None:
        """After a drafted round: drafts verified (L) and accepted (m) per row of the last ``schedule`` call."""

    def reset(self) -> None:
        pass


class FixedDepth(VerificationScheduler):
    """Verify min(num_speculative_tokens, limit) drafts (None: as many as the limit allows)."""

    name = "fixed"

    def __init__(self, num_speculative_tokens: int | None = None):
        self.num_speculative_tokens = num_speculative_tokens

    def schedule(self, conf_logits, limits):
        k = self.num_speculative_tokens
        return [int(m) if k is None else min(int(k), int(m)) for m in limits]

    def draft_this_round(self, num_requests):
        return self.num_speculative_tokens is None or self.num_speculative_tokens > 0


class StaticThreshold(VerificationScheduler):
    """L = number of leading drafts whose RAW per-step confidence σ(z_k) >= θ (DeepSpec's ``--confidence-threshold``:
    truncate before the first k with σ(z_k) < θ).  θ <= 0 -> full depth."""

    name = "threshold"
    needs_confidence = True

    def __init__(self, theta: float):
        self.theta = float(theta)

    def schedule(self, conf_logits, limits):
        if self.theta <= 0 or conf_logits is None:
            return [int(m) for m in limits]
        ok = (torch.sigmoid(conf_logits.double()) >= self.theta).long().cumprod(-1).sum(-1).tolist()
        return [min(int(o), int(m)) for o, m in zip(ok, limits)]


class _SharedHardware:
    """What Algorithm 1's two cost-aware schedulers share.

    * Other work on the same hardware (B_0 target tokens, τ_0 emitted tokens per round; set before a round, so the
      depth rule stays lossless) and an optional cap on this batch's target tokens.  B_0 = τ_0 = 0, no budget: the
      paper's Algorithm 1 on its own batch.
    * The round's whole cost (``LiveRoundCost``): the paper's Θ = τ·SPS(B) counts only the target step, so a draft
      looks free when the drafting round itself costs a sizeable share of a step.  Here Θ = τ / (target_R(B_0 + B) +
      overhead + draft(R)), with the drafting cost, engine overhead and the target forward per round shape measured
      live (``LiveRoundCost.target_price``).
    * Whether to draft at all: after each drafted round the scheduler compares the best Θ it found with the
      throughput of a plain decoding round, (τ_0 + R) / (target_R(B_0 + R) + overhead), and the drafted rounds
      of R requests so far with the plain rounds, as measured (``LiveRoundCost.realized_gain``).  When drafting did
      not pay by either, the next rounds skip drafting (one token per request, no drafter cost), and a probe round
      drafts again after ``refresh_every - 1`` skipped rounds, doubling while probes keep saying no (up to
      ``max_skip``), so an idle drafter costs ~draft(R)/max_skip per round; when the batch halves from the largest
      one seen while idle, the next round probes at once (the load fell).  The decision uses past rounds only:
      lossless.
    * Whether drafting CAN pay at all, before any probe: the most a drafted round of R requests could give, with
      every request as sure of its drafts as the surest request of the recent drafted rounds (``best_survival``,
      per position) and the measured drafting cost, against a plain round (``drafting_cannot_pay``).  Where even
      that bound loses (a busy machine: a few more tokens per request cost nearly their full price), the round
      skips drafting without a probe; the bound rises as the load falls, so drafting resumes the first round it
      could pay.
    * Control rounds: both verdicts compare with a plain round of the same R, which a replica that drafts in every
      round never runs; the model's price for it then follows the profile's shape from the verifying rounds, and a
      profile that prices 16 tokens like 8 makes drafting look like a gain it is not (measured at 8 users: the
      realized gain read 1.25-1.39 while the throughput was 0.89x plain decoding).  So when drafting has run and no
      plain round of R requests was measured within ``control_every`` rounds, the next round that would draft runs
      plain instead and is measured (lossless: the decision uses past rounds only).
    """

    base_tokens: int = 0
    base_tau: float = 0.0
    budget: int | None = None
    round_tokens: int = 0  # this round's other target tokens (prefill chunks), from set_round
    round_budget: int | None = None  # this round's cap on the decoding requests' tokens, from set_round
    takes_round_budget = True

    def _init_shared(self, cost: CostTable, budget: int | None, refresh_every: int, max_skip: int,
                     online_calibration: bool = True, control_every: int | None = None):
        if refresh_every < 1:
            raise ValueError(f"refresh_every must be >= 1, got {refresh_every}")
        if max_skip < refresh_every - 1:
            raise ValueError(f"max_skip must be >= refresh_every - 1, got {max_skip}")
        self.cost = cost
        self.budget = budget
        self.refresh_every = int(refresh_every)
        self.max_skip = int(max_skip)
        self.live = LiveRoundCost()
        self.online = OnlineCalibration() if online_calibration else None
        self._last_a = None  # the survival matrix of the last drafted round (for observe_acceptance)
        self._skipped = 0
        self._skip_len = self.refresh_every - 1
        self._idle = False  # the last drafted round said drafting does not pay
        self._round_acceptance = (0, 0)  # (verified, accepted) of this round, from observe_acceptance
        self._idle_requests = 0  # the most requests a round had while drafting did not pay
        self.last_gain = None  # Θ(drafted) / Θ(plain) of the last drafted round
        self.best_survival = None  # [γ] EMA over drafted rounds of the highest survival a_{r,j} at each position j
        self.model_skips = 0  # rounds the bound said drafting could not pay (no probe spent)
        self.control_every = None if control_every is None else int(control_every)
        self.control_rounds = 0  # plain rounds run to measure a plain round of that many requests (control_every)

    def set_load(self, base_tokens: int, base_tau: float) -> None:
        self.base_tokens, self.base_tau = int(base_tokens), float(base_tau)

    def set_round(self, other_tokens: int, budget: int | None) -> None:
        self.round_tokens, self.round_budget = int(other_tokens), budget

    def _base(self) -> int:
        """Target tokens of the other work this round shares the hardware with: the other replicas' and this
        round's prefill chunks."""
        return self.base_tokens + self.round_tokens

    def _cap(self) -> int | None:
        """The cap on this batch's target tokens: the configured budget and the round's, whichever is lower."""
        caps = [b for b in (self.budget, self.round_budget) if b is not None]
        return min(caps) if caps else None

    def observe_round(self, num_drafted, draft_s, target_tokens, target_s, round_s):
        verified, accepted = self._round_acceptance if num_drafted else (0, 0)
        self.live.observe(self.cost, num_drafted, draft_s, target_tokens, target_s, round_s, verified, accepted)
        self._round_acceptance = (0, 0)

    def observe_acceptance(self, verified: Sequence[int], accepted: Sequence[int]) -> None:
        self._round_acceptance = (int(sum(verified)), int(sum(accepted)))
        if self.online is not None and self._last_a is not None and len(verified) == self._last_a.shape[0]:
            self.online.observe(self._last_a, verified, accepted)
        self._last_a = None

    def _survival(self, conf_logits: torch.Tensor, limits: Sequence[int]) -> torch.Tensor:
        """Calibrated survival (STS), corrected online when enabled; remembered for observe_acceptance."""
        a = survival(calibrated_confidence(conf_logits, self.temperatures), limits)
        if self.online is not None:
            a = self.online.apply(a)
        self._last_a = a
        if a.numel():
            top = a.max(dim=0).values.double()
            if self.best_survival is None or self.best_survival.numel() != top.numel():
                self.best_survival = top
            else:
                self.best_survival = self.best_survival + self.BEST_SURVIVAL_EMA * (top - self.best_survival)
        return a

    BEST_SURVIVAL_EMA = 0.1
    GATE_MIN_ROUNDS = 4  # drafting rounds measured before the bound may rule drafting out

    def drafting_cannot_pay(self, num_requests: int) -> bool:
        """True when even the best case -- each of the R requests as sure of its drafts as the surest request of
        the recent drafted rounds, admitted greedily at any depth -- gives fewer tokens per second than a plain
        round, at the measured drafting cost and this round's load.  False while nothing is known (no drafted
        round yet, or fewer than GATE_MIN_ROUNDS drafting rounds measured): a round drafts and measures.  The
        drafting cost is the fastest seen, as a best case should be."""
        R = int(num_requests)
        if self.best_survival is None or self.live.drafted_rounds < self.GATE_MIN_ROUNDS or R < 1:
            return False
        plain = (self.base_tau + R) / self._round_seconds(R, False)(R)
        drafted = self._round_seconds(R, True, best_case=True)
        cap = self._cap()
        tau, B = float(R), R
        for v in self.best_survival.tolist():  # position by position: R candidates of survival v each
            for _ in range(R):
                B += 1
                if cap is not None and B > cap:
                    return True
                tau += v
                if (self.base_tau + tau) / drafted(B) > plain:
                    return False
        return True

    def _round_seconds(self, R: int, drafted: bool, best_case: bool = False):
        """B (this batch's target tokens) -> seconds of one round, drafted or not (best_case: at the fastest
        drafting round seen)."""
        lv = self.live
        target = lv.target_price(self.cost, R, self._base(), verify=drafted)
        extra = lv.overhead_s + (lv.draft_seconds(R, best=best_case) if drafted else 0.0)
        return lambda B: target(B) + extra

    def _search(self, a: torch.Tensor, early_stop: bool):
        return greedy_prefix_search(a, self.cost, early_stop=early_stop, base_tokens=self._base(),
                                    base_tau=self.base_tau, budget=self._cap(),
                                    round_seconds=self._round_seconds(a.shape[0], True))

    def _drafting_gain(self, a: torch.Tensor, depths: Sequence[int]) -> float:
        """Θ of this drafted round at these depths ÷ Θ of a plain decoding round of the same requests."""
        R = a.shape[0]
        K = sum(int(d) for d in depths)
        drafted = (self.base_tau + R + admitted_survival(a, depths)) / self._round_seconds(R, True)(R + K)
        plain = (self.base_tau + R) / self._round_seconds(R, False)(R)
        return drafted / plain

    def _budget_left(self, num_requests: int) -> bool:
        """False when the R bonus tokens alone use up the budget."""
        cap = self._cap()
        return cap is None or cap > num_requests

    def _draft_unless_idle(self, num_requests: int, idle: bool) -> bool:
        """The drafting decision both schedulers share: never when the R bonus tokens alone use up the budget or
        when the cost model's best case cannot pay; while the past rounds say drafting does not pay, skip, with
        probe rounds at growing intervals."""
        if not self._budget_left(num_requests):
            return False
        if self.drafting_cannot_pay(num_requests):
            self.model_skips += 1
            return False
        if not idle or self.refresh_every == 1 or 2 * num_requests <= self._idle_requests:
            # drafting pays, no back-off, or the batch halved since the round that said no: look again now
            self._skipped, self._skip_len, self._idle_requests = 0, self.refresh_every - 1, 0
            if self.control_every and self.live.plain_stale(num_requests, self.control_every):
                self.control_rounds += 1  # a plain round, measured: what drafting is compared with
                return False
            return True
        self._idle_requests = max(self._idle_requests, num_requests)
        if self._skipped < self._skip_len:
            self._skipped += 1
            return False
        self._skipped = 0  # probe; if it says no again, wait twice as long before the next one
        self._skip_len = min(self.max_skip, 2 * self._skip_len + 1)
        return True

    def _reset_shared(self):
        self._skipped, self._skip_len, self._idle = 0, self.refresh_every - 1, False
        self._round_acceptance, self._idle_requests = (0, 0), 0
        self.best_survival, self.model_skips = None, 0


class Algorithm1(_SharedHardware, VerificationScheduler):
    """docs/dspark.md §7, Algorithm 1: greedy admission of (r, j) by calibrated survival a_{r,j}, maximising Θ (the
    round's tokens per second, see _SharedHardware), with the early stop (first non-improving candidate ends the
    search).  early_stop=False gives the look-ahead variant, kept only to demonstrate that it is NOT lossless.
    refresh_every=1 turns the drafting back-off off (draft every round).

    gain_ema: the draft-or-not decision for the next rounds follows an exponential average (this weight) of the
    drafted rounds' Θ(drafted) / Θ(plain), not the last round's alone: text alternates between spans a drafter
    predicts and spans it does not, and one unpromising round must not stop drafting for the next ones.  The
    average is kept per batch size class (gain_bucket), as the gain falls with the load.  The average drafts
    more of the predictable spans than the last round alone (None) does (measurements:
    docs/results/speed_single_stream.md)."""

    name = "hardware"
    needs_confidence = True

    def __init__(self, cost: CostTable, temperatures: Sequence[float] | None = None, early_stop: bool = True,
                 budget: int | None = None, refresh_every: int = 4, max_skip: int = 31,
                 online_calibration: bool = True, gain_ema: float | None = 0.1, control_every: int | None = 32):
        self._init_shared(cost, budget, refresh_every, max_skip, online_calibration, control_every)
        self.temperatures = temperatures
        self.early_stop = early_stop
        if gain_ema is not None and not 0 < gain_ema <= 1:
            raise ValueError(f"gain_ema must be in (0, 1] or None, got {gain_ema}")
        self.gain_ema = gain_ema
        self._gain_avg = {}  # gain_bucket(R) -> EMA of last_gain over the drafted rounds of about R requests

    def reset(self):
        self._reset_shared()
        self._gain_avg = {}

    def schedule(self, conf_logits, limits):
        if conf_logits is None:
            raise ValueError("Algorithm1 needs confidence logits (a DSpark drafter)")
        a = self._survival(conf_logits, limits)
        depths, _ = self._search(a, self.early_stop)
        self.last_gain = g = self._drafting_gain(a, depths)
        if self.gain_ema is None:
            self._idle = not any(depths) or g <= 1.0
        else:
            b = gain_bucket(a.shape[0])
            self._gain_avg[b] = ema(self._gain_avg.get(b), g, self.gain_ema)
        return depths

    def _idle_at(self, num_requests: int) -> bool:
        """Whether the drafted rounds so far say drafting does not pay for a round of num_requests requests: the
        last drafted round's verdict (gain_ema None), else the average gain of the drafted rounds of about that many
        requests (gain_bucket).  The gain depends on the load, so rounds at one user do not vouch for 16 users."""
        if self.gain_ema is None:
            return self._idle
        avg = self._gain_avg.get(gain_bucket(num_requests))
        return avg is not None and avg <= 1.0

    def draft_this_round(self, num_requests):
        return self._draft_unless_idle(num_requests, self._idle_at(num_requests) or
                                       self.live.drafting_lost(num_requests))


class AsyncCapacity(_SharedHardware, VerificationScheduler):
    """docs/dspark.md §7 production adaptation: the capacity (total verify tokens B_cap) comes from the UNCONSTRAINED
    (no-break) search on confidences from ``lag`` rounds earlier; this round admits the top-(B_cap - R) candidates
    ranked by their CURRENT survival a_{r,j} (ties -> smaller j, so each request keeps a prefix).

    B_cap never depends on this round's tokens, and (r, j) is admitted iff fewer than K candidates outrank it, which
    depends only on x_{r,<j} and on other requests: lossless.  Before ``lag`` rounds of history exist,
    ``initial_capacity`` (None -> verify everything) is used.  Drafting is skipped (with probes) while the lagged
    capacity leaves nothing to verify or the lagged round said drafting does not pay.
    """

    name = "async"
    needs_confidence = True

    def __init__(self, cost: CostTable, temperatures: Sequence[float] | None = None, lag: int = 2,
                 initial_capacity: int | None = None, refresh_every: int = 4, budget: int | None = None,
                 max_skip: int = 31, online_calibration: bool = True, control_every: int | None = 32):
        if lag < 1:
            raise ValueError("lag must be >= 1 (lag 0 would use the current tokens: lossy)")
        self._init_shared(cost, budget, refresh_every, max_skip, online_calibration, control_every)
        self.temperatures = temperatures
        self.lag = lag
        self.initial_capacity = initial_capacity
        self._hist: deque = deque(maxlen=lag)  # (capacity, drafting paid) per drafted round
        self.last_capacity = None

    def reset(self):
        self._hist.clear()
        self._reset_shared()

    def draft_this_round(self, num_requests):
        cap = self.capacity()
        paid = self._hist[0][1] if len(self._hist) >= self.lag else True  # no history yet: initial_capacity decides
        idle = (cap is not None and (cap <= num_requests or not paid)) or self.live.drafting_lost(num_requests)
        return self._draft_unless_idle(num_requests, idle)

    def capacity(self) -> int | None:
        """Total verify tokens B_cap for the coming round (None: no history yet)."""
        if len(self._hist) < self.lag:
            return self.initial_capacity
        return self._hist[0][0]

    def schedule(self, conf_logits, limits):
        if conf_logits is None:
            raise ValueError("AsyncCapacity needs confidence logits (a DSpark drafter)")
        R = len(limits)
        a = self._survival(conf_logits, limits)
        cap = self.capacity()
        K = sum(int(m) for m in limits) if cap is None else max(0, int(cap) - R)
        if self._cap() is not None:
            K = min(K, max(0, self._cap() - R))
        depths = [0] * R
        for v, r, j in sorted_candidates(a)[:K]:
            depths[r] = max(depths[r], j)
        self.last_capacity = R + K if cap is not None else None
        # this round's capacity, used `lag` rounds from now
        best_depths, k_best = self._search(a, early_stop=False)
        self.last_gain = self._drafting_gain(a, best_depths)
        self._hist.append((R + k_best, k_best > 0 and self.last_gain > 1.0))
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
        return Algorithm1(cost_table, temperatures)
    if name == "async":
        return AsyncCapacity(cost_table, temperatures, lag=lag)
    raise ValueError(f"unknown scheduler {name!r}; choose from {SCHEDULERS}")


def make_load_aware_scheduler(kind: str, cost, budget: int | None = None, lag: int = 2):
    """'hardware' -> Algorithm1, 'async' -> AsyncCapacity, both taking the cluster load through
    ``set_load(B_0, τ_0)`` and the token budget (lossless; see the module docstring).  DSparkDrafter applies its
    STS temperatures itself, so the schedulers use the raw sigmoid (temperatures=None)."""
    if kind == "hardware":
        return Algorithm1(cost, None, budget=budget)
    if kind == "async":
        return AsyncCapacity(cost, None, lag=lag, budget=budget)
    raise ValueError(f"no load-aware scheduler {kind!r}")
