"""Rejection sampler: greedy exact match, token-wise speculative sampling and block verification.

Losslessness is shown two ways:
* exact enumeration (float64) of the output distribution of one round, completed by the target to a fixed length,
  against the target's own joint distribution: standard and block, fixed depth and a depth chosen as a stopping time
  of the drafts (what the confidence schedulers do); a look-ahead depth rule is detected as lossy (control);
* a chi-square test of the batched RejectionSampler itself on thousands of ragged requests with a reduced draft
  vocabulary and top-k.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from pipeline.engine.rejection_sampler import RejectionSampler, block_weights, expand_draft_probs, token_wise_verify
from pipeline.ops.sampling import SamplingParams, probs_from_logits, sample_from_probs
from toy_drafter import chi2_pvalue


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    from toy_drafter import one_thread

    yield from one_thread()

V, G = 3, 3  # vocabulary and max drafts for the exact enumeration


def _tables(V, G, seed, conc=1.0, zero_some=False):
    """Random context-dependent distributions: tab[k] is [V**k, V], the distribution after k tokens."""
    g = torch.Generator().manual_seed(seed)
    tabs = []
    for k in range(G + 1):
        a = (-torch.log(torch.rand(V ** k, V, generator=g, dtype=torch.float64))) ** (1.0 / conc)
        if zero_some:  # some zero-probability entries (top-k-like supports)
            a[torch.rand(a.shape, generator=g) < 0.25] = 0
            a[a.sum(-1) == 0, 0] = 1.0
        tabs.append(a / a.sum(-1, keepdim=True))
    return tabs


def _idx(prefix, V):
    i = 0
    for t in prefix:
        i = i * V + t
    return i


def _exact_round(P, Q, depth_rule, method, V=V, G=G):
    """Exact distribution over V**(G+1) sequences: one round (drafts from Q, depth from depth_rule, verification),
    then target sampling to length G+1."""
    out = torch.zeros(V ** (G + 1), dtype=torch.float64)
    for x in itertools.product(range(V), repeat=G):
        px = 1.0
        for k in range(G):
            px *= float(Q[k][_idx(x[:k], V), x[k]])
        if px == 0:
            continue
        L = depth_rule(x)
        xs = list(x[:L])
        p_rows = torch.stack([P[k][_idx(xs[:k], V)] for k in range(L + 1)])
        q_rows = torch.stack([Q[k][_idx(xs[:k], V)] for k in range(L)]) if L else torch.zeros(0, V,
                                                                                              dtype=torch.float64)
        outcomes = []  # (prob, emitted tokens)
        if method == "standard":
            surv = 1.0
            for m in range(L + 1):
                if m < L:
                    a = min(1.0, float(p_rows[m, xs[m]] / q_rows[m, xs[m]]))
                    res = (p_rows[m] - q_rows[m]).clamp_min(0)
                    dist = res / res.sum() if res.sum() > 1e-12 else p_rows[m]
                    pm = surv * (1 - a)
                    surv *= a
                else:
                    dist, pm = p_rows[L], surv
                for y in range(V):
                    if pm * dist[y] > 0:
                        outcomes.append((pm * float(dist[y]), xs[:m] + [y]))
        else:
            w, h, res = block_weights(p_rows, q_rows, xs)
            for tau in range(L + 1):
                pt = 1.0 if tau == 0 else h[tau - 1]
                for j in range(tau + 1, L + 1):
                    pt *= 1 - h[j - 1]
                if tau == L:
                    dist = p_rows[L]
                else:
                    r = res[tau]
                    dist = r / r.sum() if r.sum() > 1e-12 else p_rows[tau]
                for y in range(V):
                    if pt * dist[y] > 0:
                        outcomes.append((pt * float(dist[y]), xs[:tau] + [y]))
        for po, seq in outcomes:
            # complete with target sampling
            partial = [(px * po, seq)]
            while len(partial[0][1]) < G + 1:
                nxt = []
                for pr, s in partial:
                    row = P[len(s)][_idx(s, V)]
                    nxt.extend((pr * float(row[y]), s + [y]) for y in range(V) if row[y] > 0)
                partial = nxt
            for pr, s in partial:
                out[_idx(s, V)] += pr
    return out


def _target_joint(P, V=V, G=G):
    out = torch.zeros(V ** (G + 1), dtype=torch.float64)
    for s in itertools.product(range(V), repeat=G + 1):
        pr = 1.0
        for k in range(G + 1):
            pr *= float(P[k][_idx(s[:k], V), s[k]])
        out[_idx(s, V)] = pr
    return out


RULES = {
    "fixed_full": lambda x: G,
    "fixed_1": lambda x: 1,
    "fixed_0": lambda x: 0,
    # a stopping time: whether x_{j} is verified depends on x_{<j} only
    "stopping_time": lambda x: 1 if x[0] == 0 else (2 if x[1] == 2 else G),
}


@pytest.mark.parametrize("method", ["standard", "block"])
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("seed,zero_some", [(0, False), (1, True)])
def test_exact_enumeration_lossless(method, rule, seed, zero_some):
    P = _tables(V, G, seed, zero_some=zero_some)
    Q = _tables(V, G, seed + 100, conc=0.7, zero_some=zero_some)
    got = _exact_round(P, Q, RULES[rule], method)
    want = _target_joint(P)
    assert abs(float(got.sum()) - 1) < 1e-12
    assert torch.allclose(got, want, atol=1e-12, rtol=0), float((got - want).abs().max())


@pytest.mark.parametrize("method", ["standard", "block"])
def test_exact_enumeration_detects_lookahead(method):
    """Control: a depth that depends on the very token it admits (verify x_1 only when x_1 == 0) is lossy."""
    P, Q = _tables(V, G, 3), _tables(V, G, 103)
    got = _exact_round(P, Q, lambda x: 1 if x[0] == 0 else 0, method)
    assert 0.5 * float((got - _target_joint(P)).abs().sum()) > 1e-4  # vs 1e-12 for the lossless rules


def test_block_accepts_at_least_as_much_as_standard():
    """Block verification's expected accepted length >= token-wise (Sun et al. 2024), on exact enumeration."""
    P, Q = _tables(V, G, 5), _tables(V, G, 105)

    def expected_accept(method):
        tot = 0.0
        for x in itertools.product(range(V), repeat=G):
            px = 1.0
            for k in range(G):
                px *= float(Q[k][_idx(x[:k], V), x[k]])
            p_rows = torch.stack([P[k][_idx(x[:k], V)] for k in range(G + 1)])
            q_rows = torch.stack([Q[k][_idx(x[:k], V)] for k in range(G)])
            if method == "standard":
                s, e = 1.0, 0.0
                for k in range(G):
                    s *= min(1.0, float(p_rows[k, x[k]] / q_rows[k, x[k]]))
                    e += s
            else:
                _, h, _ = block_weights(p_rows, q_rows, list(x))
                e = 0.0
                for tau in range(1, G + 1):
                    pt = h[tau - 1]
                    for j in range(tau + 1, G + 1):
                        pt *= 1 - h[j - 1]
                    e += tau * pt
            tot += px * e
        return tot

    assert expected_accept("block") >= expected_accept("standard") - 1e-12


def test_token_wise_verify_handworked():
    p = torch.tensor([[0.2, 0.8], [0.5, 0.5]])
    q = torch.tensor([[0.6, 0.4]])
    # accept x=0 iff u < 0.2/0.6 = 1/3
    assert token_wise_verify(p, q, [0], [0.30], 0.5) == (1, 0)  # bonus from p[1]: u=0.5 -> cdf [0.5, 1] -> 0
    m, t = token_wise_verify(p, q, [0], [0.34], 0.0)
    assert m == 0 and t == 1  # residual max(p-q,0) = [0, 0.4] -> always token 1


def test_expand_draft_probs_maps_into_full_vocab():
    q = torch.tensor([[0.25, 0.75]])
    full = expand_draft_probs(q, torch.tensor([3, 1]), 5)
    assert full.tolist() == [[0.0, 0.75, 0.0, 0.25, 0.0]]


def test_greedy_exact_match_and_mixed_batch():
    V_ = 6
    logits = torch.full((7, V_), -5.0)
    am = [2, 4, 1, 0, 3, 5, 5]
    logits[torch.arange(7), torch.tensor(am)] = 5.0
    # request 0: rows 0..3 (L=3), request 1: rows 4..6 (L=2)
    drafts = torch.tensor([[2, 4, 3], [3, 5, 0]])
    q = torch.full((2, 3, V_), 1.0 / V_)
    s = RejectionSampler("standard")
    g = torch.Generator().manual_seed(0)
    res = s(logits, [0, 4, 7], drafts, [3, 2], q, torch.arange(V_), [SamplingParams()] * 2, [g, g])
    assert res.num_accepted == [2, 2] and res.tokens == [[2, 4, 1], [3, 5, 5]]
    # greedy rows stay exact-match when batched with a sampled request
    res2 = s(logits, [0, 4, 7], drafts, [3, 2], q, torch.arange(V_),
             [SamplingParams(), SamplingParams(temperature=1.0)], [g, g])
    assert res2.num_accepted[0] == 2 and res2.tokens[0] == [2, 4, 1]


@pytest.mark.parametrize("method", ["standard", "block"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=3)])
def test_batched_sampler_chi_square(method, params):
    """Thousands of ragged requests in ONE sampler call; drafts over a reduced draft vocabulary (ids 0, 2, 3).
    Emitted tokens, completed by the target to G+1 tokens, follow the target's joint distribution."""
    Vt, Gt, N = 4, 3, 8000
    g = torch.Generator().manual_seed(1234)
    Plog = [torch.randn(Vt ** k, Vt, generator=g) * 1.5 for k in range(Gt + 2)]
    draft_ids = torch.tensor([0, 2, 3])
    # the draft is a noisy version of the target (so multi-token acceptance is common)
    Qlog = [Plog[k][:, draft_ids] + 0.7 * torch.randn(Vt ** k, 3, generator=g) for k in range(Gt + 1)]
    Ptab = [probs_from_logits(t, params) for t in Plog]
    # drafts: sampled from q (same SamplingParams shaping as the target, over the draft vocab)
    x = torch.zeros(N, Gt, dtype=torch.long)
    q = torch.zeros(N, Gt, 3)
    pref = torch.zeros(N, dtype=torch.long)
    for k in range(Gt):
        qk = probs_from_logits(Qlog[k][pref], params)
        di = sample_from_probs(qk, g)
        x[:, k] = draft_ids[di]
        q[:, k] = qk
        pref = pref * Vt + x[:, k]
    # depths: a stopping-time rule, some requests with depth 0 (independent of the tokens)
    depths = [0 if i % 7 == 0 else (1 if int(x[i, 0]) == 0 else (2 if int(x[i, 1]) == 2 else 3)) for i in range(N)]
    rows, offs = [], [0]
    for i in range(N):
        p_ = 0
        for k in range(depths[i] + 1):
            rows.append(Plog[k][p_])
            if k < depths[i]:
                p_ = p_ * Vt + int(x[i, k])
        offs.append(len(rows))
    logits = torch.stack(rows)
    res = RejectionSampler(method)(logits, offs, x, depths, q, draft_ids, [params] * N, [g] * N)
    # complete every output to G+1 tokens with the target
    seqs = []
    for i in range(N):
        assert len(res.tokens[i]) == res.num_accepted[i] + 1 <= depths[i] + 1
        assert res.tokens[i][:-1] == x[i, :res.num_accepted[i]].tolist()
        seqs.append(list(res.tokens[i]))
    for k in range(Gt + 1):
        need = [i for i in range(N) if len(seqs[i]) == k]
        if need:
            pr = torch.tensor([_idx(seqs[i], Vt) for i in need])
            ys = sample_from_probs(Ptab[k][pr], g).tolist()
            for i, y in zip(need, ys):
                seqs[i].append(y)
    counts = torch.bincount(torch.tensor([_idx(s, Vt) for s in seqs]), minlength=Vt ** (Gt + 1))
    pval = chi2_pvalue(counts, _target_joint(Ptab, Vt, Gt))
    assert pval > 1e-3, pval
    # acceptance actually happened (the test exercises multi-token rounds)
    assert sum(res.num_accepted) > N // 3


def _probs_reference(logits, params):
    """probs_from_logits as first written (full sort for top-p): the fast paths must agree with it."""
    logits = logits.float() / params.temperature
    V_ = logits.shape[-1]
    if 0 < params.top_k < V_:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sl, idx = torch.sort(logits, dim=-1, descending=True)
        sp = sl.softmax(-1)
        drop = torch.zeros_like(sp, dtype=torch.bool).scatter(-1, idx, (sp.cumsum(-1) - sp) >= params.top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def test_probs_from_logits_fast_paths_match_full_sort():
    import pipeline.ops.sampling as S

    g = torch.Generator().manual_seed(0)
    cases = []
    for V_ in (7, 300, 5000):
        for sc in (0.5, 3.0, 10.0):
            cases.append(torch.randn(2, 3, V_, generator=g) * sc)
    # the nucleus just inside / just outside the top candidates (normalisation must be over the FULL vocabulary)
    V_ = 3000
    x = torch.full((2, V_), -30.0)
    x[:, :S.TOP_P_CANDIDATES] = torch.log(torch.tensor(0.95 / S.TOP_P_CANDIDATES))
    x[:, S.TOP_P_CANDIDATES:] = torch.log(torch.tensor(0.05 / (V_ - S.TOP_P_CANDIDATES)))
    x += 1e-3 * torch.randn(x.shape, generator=g)
    cases.append(x)
    ties = torch.randint(0, 4, (4, 50), generator=g).float()  # many ties at the k-th value
    cases.append(ties)
    for x in cases:
        for p in (SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_p=0.949),
                  SamplingParams(temperature=1.0, top_p=0.951), SamplingParams(temperature=0.7, top_k=20, top_p=0.8),
                  SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.3, top_k=2, top_p=0.5)):
            a, b = probs_from_logits(x, p), _probs_reference(x, p)
            assert torch.equal(a > 0, b > 0), (x.shape, p)
            assert torch.allclose(a, b, atol=1e-6), (x.shape, p)
