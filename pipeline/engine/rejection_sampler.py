"""Verification of draft blocks against the target: greedy exact match, token-wise speculative sampling (standard) and
block verification (Sun et al. 2024, vLLM ``rejection_sample_method: block``).

Conventions (one round of one request, docs/dspark.md §6):
* the target scored ``[x_0, x_1..x_L]`` and gives L+1 logits rows; row k is p_t(. | x_{<=k}), so rows 0..L-1 judge the
  drafts x_1..x_L and row L is the bonus distribution;
* the drafter gives the tokens x_1..x_L as TARGET ids and q_k over its draft vocabulary together with ``draft_ids``
  (target id of each draft index); q is zero outside the draft vocabulary once mapped into the full vocabulary;
* the result of a round is m (accepted drafts) and m+1 tokens: x_1..x_m plus one target token (residual or bonus).

Target probabilities always come from :func:`pipeline.ops.sampling.probs_from_logits` on fp32 logits with the request's
SamplingParams (the same function shapes the draft distribution), so temperature / top-k / top-p are identical on both
sides.  Greedy requests (T < 1e-5) use exact match against the target argmax whatever the draft's q is.

Losslessness of ``block`` is proven in tests/test_rejection_sampler.py by exact enumeration (fixed depth AND a depth
chosen as a stopping time of the draft, the case the confidence schedulers produce) plus a chi-square test of this
implementation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pipeline.ops.sampling import SamplingParams, probs_from_logits, sample_from_probs

RESIDUAL_EPS = 1e-9  # residual mass below this -> fall back to p (docs/dspark.md §6)
METHODS = ("standard", "block")


# ----------------------------------------------------------------------------------------------------- primitives
def expand_draft_probs(q: torch.Tensor, draft_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """q [..., V_d] over the draft vocabulary -> [..., V] over the target vocabulary (zero elsewhere)."""
    if draft_ids is None or (q.shape[-1] == vocab_size and _is_identity(draft_ids)):
        return q.float()
    out = q.new_zeros(*q.shape[:-1], vocab_size, dtype=torch.float32)
    out[..., draft_ids.to(q.device)] = q.float()
    return out


_ID_CACHE: dict = {}


def _is_identity(draft_ids: torch.Tensor) -> bool:
    key = (draft_ids.data_ptr(), draft_ids.numel(), draft_ids.device.type)
    hit = _ID_CACHE.get(key)
    if hit is None or hit[0] is not draft_ids:
        v = bool(torch.equal(draft_ids.cpu(), torch.arange(draft_ids.numel())))
        _ID_CACHE.clear() if len(_ID_CACHE) > 64 else None
        _ID_CACHE[key] = (draft_ids, v)
        return v
    return hit[1]


def _target_to_draft(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Inverse map [V]: draft index of each target id, -1 where the target id is not in the draft vocabulary."""
    key = ("inv", draft_ids.data_ptr(), draft_ids.numel(), vocab_size, draft_ids.device.type)
    hit = _ID_CACHE.get(key)
    if hit is not None and hit[0] is draft_ids:
        return hit[1]
    inv = torch.full((vocab_size,), -1, dtype=torch.long, device=draft_ids.device)
    inv[draft_ids] = torch.arange(draft_ids.numel(), device=draft_ids.device)
    _ID_CACHE[key] = (draft_ids, inv)
    return inv


def token_wise_verify(p: torch.Tensor, q_full: torch.Tensor, x: Sequence[int], u_accept: Sequence[float],
                      u_final: float) -> tuple[int, int]:
    """Reference token-wise speculative sampling for ONE request (docs/dspark.md §6).

    p [L+1, V] target probs, q_full [L, V] draft probs (full vocab), x the L drafts.  Accept x_k iff
    u_k < min(1, p_k(x_k) / q_k(x_k)); on the first reject sample normalize(max(p - q, 0)) (p when the residual mass is
    ~0); if all L are accepted sample the bonus from p_L.  Returns (m, token).
    """
    L = len(x)
    m = 0
    while m < L:
        pk, qk = float(p[m, x[m]]), float(q_full[m, x[m]])
        if not (u_accept[m] * qk < pk):  # u < p/q without dividing (q > 0 for a sampled token)
            break
        m += 1
    if m < L:
        res = (p[m] - q_full[m]).clamp_min(0)
        dist = res if float(res.sum()) > RESIDUAL_EPS else p[m]
    else:
        dist = p[L]
    tok = int(sample_from_probs(dist.unsqueeze(0), u=torch.tensor([u_final], dtype=torch.float64))[0])
    return m, tok


def block_weights(p: torch.Tensor, q_full: torch.Tensor, x: Sequence[int]):
    """Block verification's per-prefix quantities for ONE request (Sun et al. 2024, Alg. 2).

    Returns (w, h, res): w[i] (i = 0..L) the weights p_i with p_0 = 1, p_i = min(1, p_{i-1} p(x_i)/q(x_i));
    h[i-1] (i = 1..L) the probability that prefix i is the *last* stop candidate:
      h_i = S_i / (S_i + 1 - p_i), S_i = sum_x max(p_i P(x|x^i) - Q(x|x^i), 0)   for i < L,  h_L = p_L;
    res[i] (i = 0..L-1) the unnormalised residual max(p_i P(.|x^i) - Q(.|x^i), 0).
    """
    L = len(x)
    w = [1.0]
    for i in range(L):
        qi = float(q_full[i, x[i]])
        w.append(min(1.0, w[-1] * float(p[i, x[i]]) / qi) if qi > 0 else 0.0)
    wt = torch.tensor(w[:L], dtype=torch.float64, device=p.device)
    res = (wt[:, None] * p[:L].double() - q_full[:L].double()).clamp_min(0) if L else p.new_zeros(0, p.shape[-1])
    S = res.sum(-1).tolist() if L else []
    h = []
    for i in range(1, L + 1):
        if i == L:
            h.append(w[L])
        else:
            den = S[i] + 1.0 - w[i]
            h.append(S[i] / den if den > 0 else 0.0)
    return w, h, res


def block_verify(p: torch.Tensor, q_full: torch.Tensor, x: Sequence[int], eta: Sequence[float],
                 u_final: float) -> tuple[int, int]:
    """Block verification for ONE request.  eta: L uniforms; tau = the largest i with eta_i <= h_i (0 if none)."""
    L = len(x)
    if L == 0:
        return 0, int(sample_from_probs(p[0:1], u=torch.tensor([u_final], dtype=torch.float64))[0])
    w, h, res = block_weights(p, q_full, x)
    tau = 0
    for i in range(1, L + 1):
        if eta[i - 1] <= h[i - 1]:
            tau = i
    if tau == L:
        dist = p[L]
    else:
        r = res[tau].float()
        dist = r if float(r.sum()) > RESIDUAL_EPS else p[tau]
    tok = int(sample_from_probs(dist.unsqueeze(0), u=torch.tensor([u_final], dtype=torch.float64))[0])
    return tau, tok


# ----------------------------------------------------------------------------------------------------- batched
@dataclass
class VerifyResult:
    num_accepted: list  # m_r per request
    tokens: list  # per request: [x_1..x_m, target token] (m_r + 1 ints)


class RejectionSampler:
    """Batched verification of one round for R requests, each with its own depth L_r and SamplingParams."""

    def __init__(self, method: str = "standard"):
        if method not in METHODS:
            raise ValueError(f"rejection_sample_method must be one of {METHODS}, got {method!r}")
        self.method = method

    def __call__(self, target_logits: torch.Tensor, logit_offsets: Sequence[int], draft_tokens: torch.Tensor | None,
                 depths: Sequence[int], q: torch.Tensor | None, draft_ids: torch.Tensor | None,
                 params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                 q_rows: Sequence[int] | None = None) -> VerifyResult:
        """target_logits [M, V] fp32 with request r's L_r+1 rows at logit_offsets[r]; draft_tokens [R_d, >=L] target
        ids; q [R_d, >=L, V_d] (None = deterministic proposals, i.e. one-hot); q_rows[r] = the row of
        draft_tokens / q that belongs to request r (default r).  A depth-0 request just samples from its one row
        (prefill, no-speculation decode)."""
        R = len(depths)
        V = target_logits.shape[-1]
        dev = target_logits.device
        q_rows = list(range(R)) if q_rows is None else list(q_rows)
        m_out = [0] * R
        tok_out: list = [None] * R

        # uniforms, drawn per request from its own generator (seeded requests stay reproducible in any batch)
        us = [torch.rand(depths[r] + 1, generator=generators[r], dtype=torch.float64) for r in range(R)]

        # group requests by sampling params: one probs_from_logits per group
        groups: dict = {}
        for r in range(R):
            groups.setdefault(params[r], []).append(r)

        draft_cpu = draft_tokens.tolist() if (draft_tokens is not None and draft_tokens.numel()) else None
        inv = None
        if q is not None and draft_ids is not None and not (q.shape[-1] == V and _is_identity(draft_ids)):
            inv = _target_to_draft(draft_ids.to(q.device), V)

        final_rows, final_u, final_owner = [], [], []
        am_all = None
        for prm, rs in groups.items():
            if prm.greedy:
                if am_all is None:  # one argmax over all rows, no row gather
                    am_all = target_logits.argmax(-1).tolist()
                self._greedy(am_all, logit_offsets, draft_cpu, depths, rs, q_rows, m_out, tok_out)
                continue
            rows = [i for r in rs for i in range(logit_offsets[r], logit_offsets[r] + depths[r] + 1)]
            if len(rows) == target_logits.shape[0] and rows == list(range(len(rows))):
                P = probs_from_logits(target_logits, prm)
            else:
                P = probs_from_logits(target_logits[torch.tensor(rows, device=dev)], prm)
            loc, o = {}, 0
            for r in rs:
                loc[r] = o
                o += depths[r] + 1
            if self.method == "block":
                for r in rs:
                    L, b = depths[r], loc[r]
                    x = draft_cpu[q_rows[r]][:L] if L else []
                    qf = self._q_full(q, q_rows[r], L, draft_ids, V, x, P.device)
                    m, t = block_verify(P[b:b + L + 1], qf, x, us[r][:L].tolist(), float(us[r][L]))
                    m_out[r], tok_out[r] = m, [*x[:m], t]
                continue
            # standard, vectorised over all (request, position) pairs of the group
            spec = [r for r in rs if depths[r] > 0]
            if spec:
                pr, pc, qr, qk, xs, uu = [], [], [], [], [], []
                for r in spec:
                    L, b, qrow = depths[r], loc[r], q_rows[r]
                    x = draft_cpu[qrow][:L]
                    pr.extend(range(b, b + L))
                    xs.extend(x)
                    qr.extend([qrow] * L)
                    qk.extend(range(L))
                idx = torch.tensor([pr, xs, qr, qk], dtype=torch.long, device=P.device)
                p_tok = P[idx[0], idx[1]].double()
                if q is None:
                    q_tok = torch.ones_like(p_tok)
                else:
                    qi = idx[1] if inv is None else inv[idx[1]]
                    q_tok = q[idx[2], idx[3], qi.clamp_min(0)].double()
                    q_tok = torch.where(qi >= 0, q_tok, torch.zeros_like(q_tok))
                u_acc = torch.cat([us[r][:depths[r]] for r in spec]).to(P.device)
                acc = (u_acc * q_tok < p_tok).tolist()
                o = 0
                for r in spec:
                    L = depths[r]
                    m = 0
                    while m < L and acc[o + m]:
                        m += 1
                    m_out[r] = m
                    o += L
            rej = [r for r in spec if m_out[r] < depths[r]]
            dist = P[torch.tensor([loc[r] + m_out[r] for r in rs], device=P.device)]
            if rej:
                rpos = {r: i for i, r in enumerate(rs)}
                ri = torch.tensor([rpos[r] for r in rej], device=P.device)
                if q is None:
                    qf = torch.zeros(len(rej), V, device=P.device)
                    qf[torch.arange(len(rej)), torch.tensor([draft_cpu[q_rows[r]][m_out[r]] for r in rej])] = 1.0
                else:
                    qsel = q[torch.tensor([q_rows[r] for r in rej], device=q.device),
                             torch.tensor([m_out[r] for r in rej], device=q.device)]
                    qf = expand_draft_probs(qsel, draft_ids, V).to(P.device)
                res = (dist[ri] - qf).clamp_min(0)
                ok = res.sum(-1, keepdim=True) > RESIDUAL_EPS
                dist[ri] = torch.where(ok, res, dist[ri])
            final_rows.append(dist)
            final_u.extend(float(us[r][depths[r]]) for r in rs)
            final_owner.extend(rs)
        if final_rows:
            D = torch.cat(final_rows) if len(final_rows) > 1 else final_rows[0]
            toks = sample_from_probs(D, u=torch.tensor(final_u, dtype=torch.float64)).tolist()
            for r, t in zip(final_owner, toks):
                m = m_out[r]
                tok_out[r] = [*(draft_cpu[q_rows[r]][:m] if m else []), t]
        return VerifyResult(num_accepted=m_out, tokens=tok_out)

    @staticmethod
    def _q_full(q, qrow, L, draft_ids, V, x, device):
        if L == 0:
            return torch.zeros(0, V, device=device)
        if q is None:
            qf = torch.zeros(L, V, device=device)
            qf[torch.arange(L), torch.tensor(x)] = 1.0
            return qf
        return expand_draft_probs(q[qrow, :L], draft_ids, V).to(device)

    @staticmethod
    def _greedy(am_all, offs, draft_cpu, depths, rs, q_rows, m_out, tok_out):
        for r in rs:
            L, o = depths[r], offs[r]
            x = draft_cpu[q_rows[r]][:L] if L else []
            m = 0
            while m < L and x[m] == am_all[o + m]:
                m += 1
            m_out[r] = m
            tok_out[r] = [*x[:m], am_all[o + m]]
