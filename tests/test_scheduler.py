"""Verification-depth schedulers and the SPS cost table (docs/dspark.md §6.3, §7, Appendix A)."""
from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from pipeline.engine.rejection_sampler import RejectionSampler
from pipeline.ops.sampling import SamplingParams
from pipeline.dspark.calibration import OnlineCalibration
from pipeline.engine.scheduler import (AsyncCapacity, FixedDepth, Algorithm1, LiveRoundCost, StaticThreshold,
                                       gain_bucket, make_scheduler, sorted_candidates, survival)
from pipeline.engine.cost_table import CostTable


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    from toy_drafter import one_thread

    yield from one_thread()


def logit(p):
    return math.log(p / (1 - p))


def Z(rows):
    """confidence probabilities -> logits tensor"""
    return torch.tensor([[logit(c) for c in r] for r in rows], dtype=torch.float64)


# ------------------------------------------------------------------------------------------------ cost table
def test_cost_table_interpolation_and_roundtrip(tmp_path):
    ct = CostTable({1: 0.040, 4: 0.070, 8: 0.090})
    assert ct.step_time(1) == pytest.approx(0.040)
    assert ct.step_time(2) == pytest.approx(0.050)
    assert ct.step_time(6) == pytest.approx(0.080)
    assert ct.step_time(12) == pytest.approx(0.110)  # last slope extrapolated
    assert ct.sps(8) == pytest.approx(1 / 0.090)
    assert ct.step_time(100000) > ct.step_time(8)
    p = tmp_path / "sps.json"
    ct.save(p)
    ct2 = CostTable.load(p)
    assert [ct2.sps(b) for b in range(1, 20)] == [ct.sps(b) for b in range(1, 20)]
    assert CostTable.from_sps([1, 0.5, 0.45]).sps(3) == pytest.approx(0.45)


def test_cost_table_profile_times_the_runner():
    from pipeline.engine.target_runner import TargetRunner
    from toy_drafter import tiny_llama

    r = TargetRunner(tiny_llama(), "float32", device="cpu", max_seq_len=128)
    ct = CostTable.profile(r, batch_sizes=(1, 3, 9), context_len=20, repeats=1, warmup=1)
    assert [b for b, _ in ct.points] == [1, 3, 9] and all(t > 0 for _, t in ct.points)
    assert ct.meta["context_len"] == 20
    assert not r._used  # profiling slots released


def test_implausible_profiles_are_measured_again(tmp_path):
    """A cached table caught under contention (1 token slower than 16) is replaced by a fresh profile."""
    from pipeline.engine.cost_table import MAX_INVERSION, ProfileSpec, cost_table_key, load_or_profile_cost_table
    from pipeline.engine.target_runner import TargetRunner
    from toy_drafter import tiny_llama

    assert CostTable({1: 0.1, 2: 0.15, 8: 0.2}).inversion() == 0.0
    bad = CostTable({1: 0.46, 2: 1.72, 16: 1.09, 32: 2.34})  # the table an overloaded machine once produced
    assert bad.inversion() == pytest.approx(1.72 / 1.09 - 1) and bad.inversion() > MAX_INVERSION
    target = tmp_path / "target"
    tiny_llama().save_pretrained(target)
    opts = ProfileSpec(target=str(target), cache_dir=str(tmp_path / "cache"), batch_sizes=[1, 2, 4], context_len=8,
                       repeats=1)
    runner = TargetRunner.from_pretrained(str(target), "float32", device="cpu")
    path = tmp_path / "cache" / f"sps-{cost_table_key(opts, 4, runner.linear_backend)}.json"
    assert cost_table_key(opts, 4, "packed") != cost_table_key(opts, 4, "smallm")  # each back end its own curve
    path.parent.mkdir()
    bad.save(path)
    table, got_path, profiled = load_or_profile_cost_table(runner, opts, 4)
    assert profiled and got_path == path and [b for b, _ in table.points] == [1, 2, 4]
    assert CostTable.load(path).points == table.points and "inversion" in table.meta


def test_a_reproduced_inversion_is_kept_as_the_hardware_curve(tmp_path, monkeypatch):
    """Two profiles that agree on a non-monotone curve (MKL's slow 1-2 row GEMM on an AMD EPYC): kept after the
    second attempt, cached, and loaded next time without profiling again."""
    from pipeline.engine import cost_table
    from pipeline.engine.cost_table import ProfileSpec, cost_table_key, load_or_profile_cost_table, same_shape

    curves = iter([{1: 0.057, 2: 0.100, 4: 0.041, 8: 0.044}, {1: 0.060, 2: 0.105, 4: 0.043, 8: 0.045},
                   {1: 0.010, 2: 0.011, 4: 0.012, 8: 0.013}])
    calls = []

    def fake_profile(runner, **kw):
        calls.append(kw)
        return CostTable(next(curves))

    monkeypatch.setattr(cost_table.CostTable, "profile", staticmethod(fake_profile))
    assert same_shape(CostTable({1: 1.0, 2: 2.0}), CostTable({1: 1.1, 2: 1.9}))
    assert not same_shape(CostTable({1: 1.0, 2: 2.0}), CostTable({1: 1.0, 2: 2.5}))
    target = tmp_path / "target"
    target.mkdir()
    opts = ProfileSpec(target=str(target), cache_dir=str(tmp_path / "cache"), batch_sizes=[1, 2, 4, 8])
    table, path, profiled = load_or_profile_cost_table(None, opts, 8)
    assert profiled and len(calls) == 2 and table.meta["inversion_reproduced"]
    assert table.step_time(1) == pytest.approx(0.060) and table.verify_time(1) == pytest.approx(0.043)
    again, _, profiled = load_or_profile_cost_table(None, opts, 8)
    assert not profiled and len(calls) == 2 and again.points == table.points
    assert path.name == f"sps-{cost_table_key(opts, 8)}.json"


def test_sps_profile_lock_is_bounded_and_dies_with_its_holder(tmp_path, monkeypatch):
    """Another live profiler: a named LockTimeout within the bound.  A profiler killed while holding the lock (a
    replica stopped mid-profile): the next one profiles at once."""
    import signal
    import subprocess
    import sys

    from pipeline.core.file_lock import LockTimeout
    from pipeline.engine import cost_table
    from pipeline.engine.cost_table import PROFILE_LOCK, ProfileSpec, load_or_profile_cost_table

    monkeypatch.setattr(cost_table.CostTable, "profile", staticmethod(lambda runner, **kw: CostTable({1: 0.01, 2: 0.012})))
    target = tmp_path / "target"
    target.mkdir()
    opts = ProfileSpec(target=str(target), cache_dir=str(tmp_path / "cache"), batch_sizes=[1, 2])
    hold = ("import sys, time; from pipeline.core.file_lock import file_lock\n"
            "with file_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(600)\n")
    (tmp_path / "cache").mkdir()
    p = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / "cache" / PROFILE_LOCK)], stdout=subprocess.PIPE,
                         text=True, cwd=Path(__file__).resolve().parent.parent)
    assert p.stdout.readline().strip() == "held"
    try:
        t0 = time.monotonic()
        with pytest.raises(LockTimeout, match="the SPS profile"):
            load_or_profile_cost_table(None, opts, 2, lock_timeout_s=0.5)
        assert time.monotonic() - t0 < 5
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    table, path, profiled = load_or_profile_cost_table(None, opts, 2, lock_timeout_s=0.5)
    assert profiled and table.points == [(1, 0.01), (2, 0.012)]
    assert sorted(x.name for x in path.parent.iterdir()) == sorted([path.name, PROFILE_LOCK])  # no temporaries


# ------------------------------------------------------------------------------------------------ simple rules
def test_fixed_depth_and_static_threshold():
    assert FixedDepth(3).schedule(None, [7, 2, 0]) == [3, 2, 0]
    assert FixedDepth().schedule(None, [7, 2]) == [7, 2]
    z = Z([[0.9, 0.95, 0.4, 0.99], [0.3, 0.9, 0.9, 0.9], [0.8, 0.8, 0.8, 0.8]])
    # L = number of leading drafts with RAW per-step σ(z) >= θ (not the cumulative product)
    assert StaticThreshold(0.5).schedule(z, [4, 4, 4]) == [2, 0, 4]
    assert StaticThreshold(0.5).schedule(z, [1, 4, 3]) == [1, 0, 3]
    assert StaticThreshold(0.0).schedule(z, [4, 4, 4]) == [4, 4, 4]


# ------------------------------------------------------------------------------------------------ Algorithm 1
def algorithm1_reference(c, sps, max_depth):
    """docs/dspark.md §7, written out literally (python floats, no shortcuts)."""
    R = len(c)
    a = [[0.0] * len(c[0]) for _ in range(R)]
    for r in range(R):
        acc = 1.0
        for j in range(len(c[r])):
            acc *= c[r][j]
            a[r][j] = acc if j < max_depth[r] else 0.0
    E = [(a[r][j], j + 1, r) for r in range(R) for j in range(len(c[r])) if a[r][j] > 0]
    E.sort(key=lambda e: (-e[0], e[1], e[2]))
    ell = [0] * R
    B, tau = R, float(R)
    best, best_ell = R * sps(R), [0] * R
    for v, j, r in E:
        ell[r] = j
        B += 1
        tau += v
        th = tau * sps(B)
        if th > best:
            best, best_ell = th, list(ell)
        else:
            break
    return best_ell


@pytest.mark.parametrize("seed", range(20))
def test_hardware_aware_matches_literal_algorithm(seed):
    g = torch.Generator().manual_seed(seed)
    R, gam = int(torch.randint(1, 9, (1,), generator=g)), 7
    c = (0.3 + 0.7 * torch.rand(R, gam, generator=g, dtype=torch.float64)).tolist()
    md = torch.randint(0, gam + 1, (R,), generator=g).tolist()
    # a realistic non-flat curve: ~flat up to 8 tokens, then growing
    ct = CostTable({1: 0.042, 2: 0.045, 4: 0.047, 8: 0.05, 16: 0.07, 32: 0.12, 64: 0.21})
    got = Algorithm1(ct).schedule(Z(c), md)
    assert got == algorithm1_reference(c, ct.sps, md)
    assert all(0 <= d <= m for d, m in zip(got, md))


def test_hardware_aware_handworked():
    # SPS flat up to 4 tokens then halves: one request, c = (0.9, 0.8, 0.5)
    ct = CostTable.from_sps({1: 10.0, 4: 10.0, 5: 5.0})
    d = Algorithm1(ct).schedule(Z([[0.9, 0.8, 0.5]]), [3])
    assert d == [3]  # all three fit in B <= 4 and each raises tau
    ct2 = CostTable.from_sps({1: 10.0, 2: 10.0, 3: 5.0})
    assert Algorithm1(ct2).schedule(Z([[0.9, 0.8, 0.5]]), [3]) == [1]  # the B=3 cliff stops it
    # load: two requests share the flat region; the higher-survival candidates win
    d = Algorithm1(ct).schedule(Z([[0.9, 0.9, 0.9], [0.6, 0.9, 0.9]]), [3, 3])
    assert d == [2, 0]  # B = 2 + 2 = 4: (0,1)=.9, (0,2)=.81 admitted; (0,3)=.729 would need B=5 -> stop


def test_ties_prefer_smaller_j_and_keep_prefixes():
    a = survival(torch.tensor([[1.0, 1.0, 0.5], [1.0, 1.0, 1.0]], dtype=torch.float64), [3, 3])
    ents = sorted_candidates(a)
    assert [(r, j) for _, r, j in ents[:5]] == [(0, 1), (1, 1), (0, 2), (1, 2), (1, 3)]
    for K in range(len(ents) + 1):  # every prefix of the order is prefix-closed per request
        chosen = {(r, j) for _, r, j in ents[:K]}
        assert all((r, j - 1) in chosen for r, j in chosen if j > 1)


def test_calibration_temperatures_used():
    ct = CostTable.from_sps({1: 1.0, 2: 0.62})
    z = Z([[0.7]])
    # raw c = 0.7: tau 1.7 * 0.62 = 1.054 > 1 -> admitted; sharpened/flattened with T=3 -> c ~ 0.57 -> not admitted
    assert Algorithm1(ct).schedule(z, [1]) == [1]
    assert Algorithm1(ct, temperatures=[3.0]).schedule(z, [1]) == [0]


# ------------------------------------------------------------------------------------------------ Appendix A
PT = torch.tensor([0.7, 0.3], dtype=torch.float64)  # target
PD = torch.tensor([0.5, 0.5], dtype=torch.float64)  # draft
C1 = 0.8
C2 = {0: 0.99, 1: 0.01}  # c_2 depends on the drafted x_1
SPS_A = CostTable.from_sps([1.0, 0.5, 0.45])


def first_token_distribution(depth_of):
    """Exact P(first emitted token) for one request, γ = 2: x_1 ~ PD, depth = depth_of(x_1), token-wise verification
    of x_1 when depth >= 1 (accept w.p. min(1, PT/PD), else residual), target sample when depth == 0."""
    out = torch.zeros(2, dtype=torch.float64)
    res = (PT - PD).clamp_min(0)
    res = res / res.sum()
    for x1 in (0, 1):
        px = float(PD[x1])
        if depth_of(x1) >= 1:
            a = min(1.0, float(PT[x1] / PD[x1]))
            out[x1] += px * a
            out += px * (1 - a) * res
        else:
            out += px * PT
    return out


def test_appendix_a_early_stop_is_lossless_lookahead_is_not():
    early = Algorithm1(SPS_A)
    look = Algorithm1(SPS_A, early_stop=False)
    conf = {x1: Z([[C1, C2[x1]]]) for x1 in (0, 1)}
    # early stop: admitting x_1 drops Θ from 1.0 to 1.8*0.5 = 0.9 -> stop, whatever x_1 is
    assert [early.schedule(conf[x], [2])[0] for x in (0, 1)] == [0, 0]
    # look-ahead: for x_1 = 0, admitting x_2 too gives (1.8 + 0.792)*0.45 = 1.166 > 1 -> depth 2
    assert [look.schedule(conf[x], [2])[0] for x in (0, 1)] == [2, 0]
    d_early = first_token_distribution(lambda x: early.schedule(conf[x], [2])[0])
    d_look = first_token_distribution(lambda x: look.schedule(conf[x], [2])[0])
    assert torch.allclose(d_early, PT, atol=1e-12)
    assert torch.allclose(d_look, torch.tensor([0.85, 0.15], dtype=torch.float64), atol=1e-12)


def test_appendix_a_async_capacity_is_lossless():
    """Capacity from confidences two rounds old, then top-K by current survival: the current x_1 cannot change
    whether x_1 is admitted.  Enumerate over the (lagged) history too."""
    for hist in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        def depth_of(x1):
            s = AsyncCapacity(SPS_A, lag=2)
            for h in hist:  # two earlier rounds with some drafted tokens
                s.schedule(Z([[C1, C2[h]]]), [2])
            return s.schedule(Z([[C1, C2[x1]]]), [2])[0]
        assert torch.allclose(first_token_distribution(depth_of), PT, atol=1e-12), hist


def test_appendix_a_monte_carlo_through_rejection_sampler():
    """The same counterexample through the real RejectionSampler (2000 samples): look-ahead is biased towards 0."""
    g = torch.Generator().manual_seed(7)
    N = 2000
    logits = torch.log(PT.float()).repeat(3, 1)
    s = RejectionSampler("standard")
    prm = SamplingParams(temperature=1.0)

    def run(sched):
        n0 = 0
        for _ in range(N):
            x1 = int(torch.rand(1, generator=g) < 0.5)  # ~PD
            x2 = int(torch.rand(1, generator=g) < 0.5)
            d = sched.schedule(Z([[C1, C2[x1]]]), [2])[0]
            r = s(logits[:d + 1], [0, d + 1], torch.tensor([[x1, x2]]), [d],
                  PD.float().repeat(1, 2, 1), torch.arange(2), [prm], [g])
            n0 += r.tokens[0][0] == 0
        return n0 / N

    f_early, f_look = run(Algorithm1(SPS_A)), run(Algorithm1(SPS_A, early_stop=False))
    se = math.sqrt(0.7 * 0.3 / N)
    assert abs(f_early - 0.7) < 4 * se
    assert abs(f_look - 0.85) < 4 * math.sqrt(0.85 * 0.15 / N)


# ------------------------------------------------------------------------------------------------ async capacity
def test_async_capacity_uses_confidences_from_two_rounds_earlier():
    ct = CostTable({1: 1.0, 3: 1.0, 4: 2.0})  # flat to B = 3, then a cliff
    s = AsyncCapacity(ct, lag=2)
    hi = Z([[0.99, 0.99, 0.99]])
    lo = Z([[0.05, 0.05, 0.05]])
    # no history yet: verify everything
    assert s.schedule(lo, [3]) == [3]  # round 0; its own best capacity: B = 3 (any admission helps while flat)
    assert s.schedule(hi, [3]) == [3]  # round 1
    assert s.capacity() == 3  # for round 2: from round 0
    assert s.schedule(hi, [3]) == [2]  # B = 1 + 2
    # a steep table: low confidences are never worth verifying, high ones are (past the dip at B = 2)
    s2 = AsyncCapacity(CostTable.from_sps([1.0, 0.5, 0.49, 0.48]), lag=2)
    s2.schedule(lo, [3])
    s2.schedule(hi, [3])
    assert s2.capacity() == 1  # from lo: never worth it
    assert s2.schedule(hi, [3]) == [0]
    assert s2.capacity() == 4  # from hi (no break past the dip at B = 2): tau 3.97 * 0.48 > 1
    assert s2.schedule(lo, [3]) == [3]


def test_drafting_skipped_only_when_nothing_can_be_verified():
    assert not FixedDepth(0).draft_this_round(3) and FixedDepth(2).draft_this_round(3)
    assert FixedDepth(None).draft_this_round(3)
    lo = Z([[0.05, 0.05, 0.05]])
    s = AsyncCapacity(CostTable.from_sps([1.0, 0.5, 0.49, 0.48]), lag=2, refresh_every=3)
    assert s.draft_this_round(1)  # no history yet
    s.schedule(lo, [3])
    s.schedule(lo, [3])
    assert s.capacity() == 1  # R bonus tokens only: nothing to verify
    # skipped twice, then one probe round drafts so the capacity history can follow the load; the next probe comes
    # after 5 skipped rounds (the interval doubles while probes keep saying no)
    assert [s.draft_this_round(1) for _ in range(9)] == [False] * 2 + [True] + [False] * 5 + [True]
    hi = Z([[0.99, 0.99, 0.99]])
    s.schedule(hi, [3])
    s.schedule(hi, [3])
    assert s.capacity() == 4 and s.draft_this_round(1)  # sure drafts pay: drafting resumes every round
    assert [s.draft_this_round(1) for _ in range(3)] == [True] * 3


def test_hardware_prefix_backs_off_after_a_round_that_admitted_nothing():
    ct = CostTable.from_sps([1.0, 0.9, 0.85, 0.8])  # low-confidence drafts are not worth verifying, sure ones are
    s = Algorithm1(ct, refresh_every=3)
    assert s.draft_this_round(1)  # no history yet
    assert s.schedule(Z([[0.05, 0.05, 0.05]]), [3]) == [0]
    # nothing admitted: two rounds without drafting, then one drafts again to look
    assert [s.draft_this_round(1) for _ in range(3)] == [False, False, True]
    assert s.schedule(Z([[0.05, 0.05, 0.05]]), [3]) == [0]  # the probe says no again: wait 5 rounds, then 11, ...
    assert [s.draft_this_round(1) for _ in range(6)] == [False] * 5 + [True]
    assert s.schedule(Z([[0.05, 0.05, 0.05]]), [3]) == [0]
    assert [s.draft_this_round(1) for _ in range(12)] == [False] * 11 + [True]
    assert s.schedule(Z([[0.99, 0.99, 0.99]]), [3]) != [0]  # worth it now: drafting resumes every round
    assert [s.draft_this_round(1) for _ in range(3)] == [True, True, True]
    off = Algorithm1(ct, refresh_every=1)
    off.schedule(Z([[0.05, 0.05, 0.05]]), [3])
    assert off.draft_this_round(1)
    s.schedule(Z([[0.05, 0.05, 0.05]]), [3])
    s.reset()
    assert s.draft_this_round(1)
    with pytest.raises(ValueError):
        Algorithm1(ct, refresh_every=0)


def test_make_scheduler():
    ct = CostTable.flat()
    assert isinstance(make_scheduler("fixed", num_speculative_tokens=3), FixedDepth)
    assert isinstance(make_scheduler("hardware", cost_table=ct), Algorithm1)
    assert isinstance(make_scheduler("async", cost_table=ct), AsyncCapacity)
    with pytest.raises(ValueError):
        make_scheduler("hardware")
    with pytest.raises(ValueError):
        make_scheduler("nope")


def test_drafting_cost_enters_the_objective_and_the_draft_or_not_decision():
    """The paper's Θ = τ·SPS(B) prices only the target step.  Once the engine reports that a drafting round costs
    0.6 s (the step itself 1.0-1.3 s), the same drafts that paid before no longer do: the drafted round admits MORE
    (the drafting cost is sunk and amortised) but the scheduler stops drafting for the next rounds."""
    ct = CostTable({1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3})
    half = Z([[0.5, 0.5, 0.5]])  # survival 0.5, 0.25, 0.125
    # each round's gain decides the next alone; no control rounds (test_control_rounds_measure_a_plain_round)
    s = Algorithm1(ct, refresh_every=2, gain_ema=None, control_every=None)
    assert s.schedule(half, [3]) == [2]  # 1.75 / 1.2 beats 1.5 / 1.1 and 1.875 / 1.3
    assert s.last_gain == pytest.approx(1.75 / 1.2) and s.draft_this_round(1)
    s.observe_round(1, draft_s=0.6, target_tokens=3, target_s=1.2, round_s=1.8)
    assert s.live.draft_seconds(1) == pytest.approx(0.6) and s.live.scale == pytest.approx(1.0)
    assert s.schedule(half, [3]) == [3]  # 1.875 / 1.9 > 1.75 / 1.8 > 1.5 / 1.7
    assert s.last_gain == pytest.approx((1.875 / 1.9) / 1.0) and s.last_gain < 1
    assert [s.draft_this_round(1) for _ in range(2)] == [False, True]  # skip, then probe (too few rounds measured)
    for _ in range(3):
        s.observe_round(1, draft_s=0.6, target_tokens=3, target_s=1.2, round_s=1.8)
    s.schedule(half, [3])
    # even the best case (survival 0.5, 0.25, 0.125 at the measured 0.6 s) loses: skip, and no probe is spent
    assert [s.draft_this_round(1) for _ in range(40)] == [False] * 40 and s.model_skips == 40
    # a live target twice as slow as the profile: the drafting cost weighs half as much -> drafting pays again
    for _ in range(40):
        s.observe_round(1, draft_s=0.6, target_tokens=3, target_s=2.4, round_s=3.0)
    assert s.live.scale == pytest.approx(2.0, rel=1e-3)
    s.schedule(half, [3])
    assert s.last_gain > 1 and s.draft_this_round(1)


def test_cost_model_skips_drafting_where_it_cannot_pay_and_resumes_when_the_load_falls():
    """A compute-bound machine: a round costs 10 ms per target token beyond 4 (a few tokens are nearly free, 16 are
    not), drafting 5 ms.  At 16 requests even drafts as sure as the surest seen cannot pay: no drafting, no probe
    rounds; at 2 requests they can, and the first round at that load drafts."""
    ct = CostTable({1: 0.020, 4: 0.021, 8: 0.060, 16: 0.140, 32: 0.300, 64: 0.620, 128: 1.26})
    s = Algorithm1(ct, control_every=None)
    sure = Z([[0.9, 0.9, 0.9]] * 2)
    assert s.draft_this_round(2) and not s.drafting_cannot_pay(2)  # nothing measured yet: draft and measure
    # the first drafting round also feeds the prompts to the drafter (50 ms): the bound takes the fastest round
    for k, draft_s in enumerate([0.050, 0.005, 0.006, 0.005]):
        assert not s.drafting_cannot_pay(16)  # fewer than GATE_MIN_ROUNDS measured: no verdict yet
        s.schedule(sure, [3, 3])
        s.observe_round(2, draft_s=draft_s, target_tokens=8, target_s=ct.step_time(8),
                        round_s=ct.step_time(8) + draft_s)
    assert s.live.draft_seconds(2, best=True) == 0.005 and s.live.draft_seconds(2) > 0.005
    assert s.drafting_cannot_pay(16) and not s.drafting_cannot_pay(2)
    assert [s.draft_this_round(16) for _ in range(100)] == [False] * 100  # no probe at 16 requests
    assert s.model_skips == 100
    assert s.draft_this_round(2)  # the load fell: drafting resumes at once
    # the bound is an upper bound: with the budget the R bonus tokens leave no room, no drafting either
    s.set_round(0, 17)
    assert s.drafting_cannot_pay(16)


def test_one_unpromising_round_does_not_stop_drafting():
    """gain_ema (default 0.1): the draft-or-not decision follows an average of the drafted rounds' gains, so one
    round whose confidences promise little amid rounds that pay does not stop drafting (measured single stream on
    gsm8k with a bf16 AMX target: 1.46x the plain decoder against 1.35x when every low round started a back-off),
    while rounds that keep promising less than a plain round do."""
    ct = CostTable({1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15})
    good, low = Z([[0.9, 0.9, 0.9]]), Z([[0.01, 0.01, 0.01]])
    per_round, averaged = Algorithm1(ct, gain_ema=None, control_every=None), Algorithm1(ct, control_every=None)
    for s in (per_round, averaged):
        for _ in range(5):
            s.schedule(good, [3])
            s.observe_round(1, draft_s=0.2, target_tokens=4, target_s=1.15, round_s=1.4)
        assert s.draft_this_round(1)
        s.schedule(low, [3])
        assert s.last_gain < 1
    assert not per_round.draft_this_round(1)  # one low round: back off
    assert averaged.draft_this_round(1)  # the average still says drafting pays
    for _ in range(30):
        averaged.schedule(low, [3])
    assert not averaged.draft_this_round(1)
    with pytest.raises(ValueError, match="gain_ema"):
        Algorithm1(ct, gain_ema=0.0)


def test_averaged_gain_is_kept_per_load():
    """The averaged gain is kept per batch size class: rounds at one user that pay do not keep a 16-request batch,
    where drafting does not pay, drafting for the next rounds (at 16 users the first unpromising rounds back off)."""
    ct = CostTable({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 2.0, 32: 4.0, 64: 8.0, 128: 16.0})
    s = Algorithm1(ct, control_every=None)
    good = Z([[0.9] * 7])
    for _ in range(20):  # one user: drafting pays
        s.schedule(good, [7])
        s.observe_round(1, draft_s=0.05, target_tokens=8, target_s=1.2, round_s=1.3)
    assert s.last_gain > 1 and s.draft_this_round(1)
    low = Z([[0.05] * 7] * 16)  # 16 users whose drafts rarely survive: verifying costs more than it brings
    s.schedule(low, [7] * 16)
    assert s.last_gain < 1
    assert not s.draft_this_round(16)  # the one-user average does not vouch for 16 users
    assert s.draft_this_round(1)  # and 16 users' verdict does not stop drafting at one user


def test_live_round_cost():
    ct = CostTable({1: 0.1, 8: 0.2})
    lv = LiveRoundCost(alpha=0.5)
    assert lv.draft_seconds(4) == 0.0 and lv.scale == 1.0  # nothing observed yet: the paper's model
    lv.observe(ct, 2, 0.02, 8, 0.4, 0.45)
    assert lv.scale == pytest.approx(2.0) and lv.overhead_s == pytest.approx(0.03)
    lv.observe(ct, 8, 0.06, 8, 0.2, 0.3)
    assert lv.scale == pytest.approx(1.5)  # EMA
    assert lv.draft_seconds(2) == pytest.approx(0.02) and lv.draft_seconds(8) == pytest.approx(0.06)
    assert lv.draft_seconds(5) == pytest.approx(0.04)  # interpolated
    assert lv.draft_seconds(1) == pytest.approx(0.02) and lv.draft_seconds(16) == pytest.approx(0.06)  # flat ends
    lv.observe(ct, 0, 0.0, 0, 0.0, 0.1)  # a round without a target forward changes nothing
    assert lv.rounds == 2


def test_online_calibration_corrects_an_over_confident_head():
    """The head says 0.9 per step but live traffic accepts nothing: after a few observed rounds the survival the
    scheduler uses falls, Algorithm 1 stops admitting, and drafting backs off.  An honest head is left alone."""
    oc = OnlineCalibration(decay=1.0, prior=4.0)
    a = survival(torch.full((2, 3), 0.9, dtype=torch.float64), [3, 3])
    assert torch.equal(oc.apply(a), a)  # nothing observed: identity
    oc.observe(a, verified=[3, 1], accepted=[0, 1])
    # position 1: predicted 0.9 + 0.9, realised 0 + 1; position 2: predicted 0.81, realised 0
    assert oc.ratio(3).tolist() == pytest.approx([(1 + 4) / (1.8 + 4), 4 / 4.81, 4 / 4.729])
    b = oc.apply(a)
    assert (b <= a).all() and (b[:, 1:] <= b[:, :-1]).all()  # lower, still a survival curve
    assert OnlineCalibration().apply(torch.ones(1, 3, dtype=torch.float64)).max() <= 1.0

    ct = CostTable({1: 1.0, 2: 1.5, 3: 1.6, 4: 1.7})  # the first draft costs half a step, later ones little
    conf = Z([[0.9, 0.9, 0.9]])
    s = Algorithm1(ct, refresh_every=2)
    assert s.schedule(conf, [3]) == [3]
    for _ in range(10):
        d = s.schedule(conf, [3])
        s.observe_acceptance(d, [0])  # every draft rejected
    assert s.schedule(conf, [3]) == [0]
    for _ in range(20):  # the drafting decision follows the average gain (gain_ema): rounds that admit nothing but
        d = s.schedule(conf, [3])  # pay for drafting (as the engine reports every round) bring it below 1
        s.observe_acceptance(d, [0] if d[0] else [])
        s.observe_round(1, draft_s=0.2, target_tokens=1 + d[0], target_s=1.0, round_s=1.2)
    assert not s.draft_this_round(1)
    honest = Algorithm1(ct, refresh_every=2)
    for i in range(10):
        d = honest.schedule(conf, [3])
        honest.observe_acceptance(d, [3 if i % 10 < 7 else 0])  # accepted ~ as predicted (0.9, 0.81, 0.73)
    assert honest.schedule(conf, [3]) == [3] and honest.draft_this_round(1)
    off = Algorithm1(ct, online_calibration=False)
    for _ in range(10):
        off.observe_acceptance(off.schedule(conf, [3]), [0])
    assert off.schedule(conf, [3]) == [3]


def test_async_initial_capacity_before_any_history():
    """With an initial capacity and no lagged rounds yet, the decision comes from that capacity alone."""
    ct = CostTable.from_sps([1.0, 0.9, 0.85, 0.8])
    assert AsyncCapacity(ct, initial_capacity=4).draft_this_round(1)  # room beyond the bonus token
    s = AsyncCapacity(ct, initial_capacity=1, refresh_every=3)
    assert [s.draft_this_round(1) for _ in range(3)] == [False, False, True]  # nothing to verify: back off


def test_verification_priced_at_the_cheapest_larger_batch():
    """A measured fp32 table on an AMD EPYC: 1-2 tokens through MKL cost more than 4-8 through oneDNN.  At the true
    t(B) the early-stopping search stops at the bump (B = 2) and never verifies; priced at min over B' >= B the same
    drafts are verified deep, and the plain round is still priced at its own t(R)."""
    ct = CostTable({1: 0.057, 2: 0.105, 4: 0.041, 8: 0.044, 16: 0.059})
    assert ct.verify_time(2) == pytest.approx(0.041) and ct.verify_time(1) == pytest.approx(0.041)
    assert ct.verify_time(8) == pytest.approx(0.044) and ct.step_time(1) == pytest.approx(0.057)
    assert ct.verify_time(100) == pytest.approx(ct.step_time(100))
    fair = [[0.6] * 7]  # survival 0.6, 0.36, 0.22, ...: at B = 2, 1.6 / 0.105 < 1 / 0.057
    assert Algorithm1(ct, online_calibration=False).schedule(Z(fair), [7])[0] >= 4
    # the paper's search on the raw table: stops at the bump
    from pipeline.engine.scheduler import greedy_prefix_search
    assert greedy_prefix_search(survival(torch.tensor(fair, dtype=torch.float64), [7]), ct)[0] == [0]


def test_realized_gain_stops_drafting_the_model_thought_paid():
    """The model (SPS table) says verifying 16 requests x 2 tokens costs 1.2x a plain round, so sure drafts pay; the
    rounds as measured say a verifying round took 2.5x a plain one for 2x the tokens.  From the 8th such round the
    scheduler backs off (skips with probes), and resumes once the verifying rounds pay on average."""
    ct = CostTable({16: 1.0, 32: 1.2, 64: 1.6})
    s = Algorithm1(ct, refresh_every=3, online_calibration=False, control_every=None)
    sure = Z([[0.95] * 3] * 16)
    for _ in range(4):  # plain rounds: 16 tokens in 1.0 s
        s.observe_round(0, 0.0, 16, 1.0, 1.0)
    assert s.live.plain_s[16] == pytest.approx(1.0)

    def verifying_round(accepted_each):
        depths = s.schedule(sure, [3] * 16)
        assert sum(depths) > 0 and s.last_gain > 1  # the model: it pays
        s.observe_acceptance(depths, [accepted_each] * 16)
        s.observe_round(16, 0.3, 16 + sum(depths), 2.2, 2.5)

    for k in range(8):
        assert s.draft_this_round(16)  # fewer than 8 verifying rounds: the model decides
        verifying_round(1)  # 32 tokens in 2.5 s: 12.8 tok/s against 16
    assert s.live.realized_gain(16) == pytest.approx((32 / 2.5) / 16)
    assert s.live.drafting_lost(16) and not s.live.drafting_lost(4) and not s.live.drafting_lost(8)
    assert [gain_bucket(r) for r in (1, 2, 3, 4, 5, 6, 11, 12, 22, 23)] == [1, 2, 3, 4, 4, 8, 8, 16, 16, 32]
    assert [s.draft_this_round(16) for _ in range(3)] == [False, False, True]  # skip, skip, probe
    verifying_round(2)  # a probe that pays (48 tokens) is one round of 9: the mean still says no
    assert s.live.drafting_lost(16) and s.live.drafting_lost(14)  # 12-22 requests share the verdict
    assert [s.draft_this_round(16) for _ in range(6)] == [False] * 5 + [True]
    # the load halves: probe at once (the back-off was about 16 requests), and 8 requests have no verdict yet
    s.schedule(Z([[0.05] * 3] * 16), [3] * 16)  # a probe at 16 that admits nothing
    assert not s.draft_this_round(16) and s.draft_this_round(8)
    assert s.schedule(Z([[0.95] * 3] * 8), [3] * 8) != [0] * 8 and s.draft_this_round(8)
    for _ in range(30):
        verifying_round(3)
    assert not s.live.drafting_lost(16) and s.live.realized_gain(16) > 1
    assert s.live.to_dict()["realized_gain"]["16"][0] == 39
    # a drafted round that verified nothing (all depths 0) counts: it paid for its drafts and gave one token each
    before = s.live.realized_gain(16)
    s.observe_acceptance([0] * 16, [0] * 16)
    s.observe_round(16, 0.3, 16, 1.0, 1.3)
    assert s.live.to_dict()["realized_gain"]["16"][0] == 40 and s.live.realized_gain(16) < before
    s.observe_round(0, 0.0, 16, 1.0, 1.0)  # a plain round is not a drafted one
    assert s.live.to_dict()["realized_gain"]["16"][0] == 40


def test_live_price_per_round_shape():
    """A profile taken while other processes start on the same cores prices 8 tokens at 2.4x one token; live, in
    this process, a forward of 8 tokens costs what one costs.  Once the rounds of one request at 1 and 8 tokens are
    measured, the price follows them (not the profile's shape) and Algorithm 1 verifies every draft; a batch size
    never measured keeps the profile's shape at the measured overall scale."""
    ct = CostTable({1: 1.0, 2: 1.2, 4: 1.6, 8: 2.4, 16: 4.0})
    conf = Z([[0.6] * 7])  # survival 0.6, 0.36, 0.22, ...
    s = Algorithm1(ct)
    assert s.schedule(conf, [7]) == [2]  # the profile's price stops the search early
    for _ in range(3):
        s.observe_round(0, draft_s=0.0, target_tokens=1, target_s=1.0, round_s=1.0)
        s.observe_acceptance([7], [2])  # the engine reports a drafted round's verification first
        s.observe_round(1, draft_s=0.05, target_tokens=8, target_s=1.0, round_s=1.05)
    assert s.schedule(conf, [7]) == [7]
    price = s.live.target_price(ct, 1)
    assert price(1) == pytest.approx(1.0) and price(4) == pytest.approx(1.0)  # linear between the measured shapes
    assert price(16) == pytest.approx(1.0 * 4.0 / 2.4)  # beyond them, the profile's shape
    assert s.live.target_price(ct, 2)(4) == pytest.approx(s.live.scale * 1.6)  # 2 requests: never measured
    assert s.live.target_price(ct, 1, base=8)(8) == pytest.approx(1.0 * 4.0 / 2.4)  # beside 8 tokens of other work
    assert s.live.to_dict()["target_ms"]["1"] == {"1": 1000.0, "8": 1000.0}


def test_control_rounds_measure_a_plain_round():
    """Drafting is judged against a plain round of the same number of requests (realized gain, live price).  Where
    drafting has run and no plain round of R requests was measured within ``control_every`` rounds, the next round
    that would draft runs plain instead and is measured.  Here the profile prices 8 tokens like 4 (flat), so without
    a measured plain round of 4 requests the model prices a plain round near a verifying one and drafting looks like
    a gain of ~1.8 (2 tokens per request per round); measured, a plain round takes 0.6 s against 1.0 s: 1.2."""
    ct = CostTable({4: 1.0, 8: 1.0, 16: 1.6})
    s = Algorithm1(ct, refresh_every=3, online_calibration=False, control_every=4)
    sure = Z([[0.95] * 3] * 4)

    def verifying_round():
        depths = s.schedule(sure, [3] * 4)
        s.observe_acceptance(depths, [1] * 4)  # 8 tokens per round
        s.observe_round(4, 0.1, 4 + sum(depths), 0.9, 1.0)

    assert s.draft_this_round(4)  # nothing measured: draft
    verifying_round()
    modelled = s.live.realized_gain(4)
    assert modelled > 1.5
    assert not s.draft_this_round(4) and s.control_rounds == 1  # drafting measured, a plain round not: control
    s.observe_round(0, 0.0, 4, 0.55, 0.6)
    assert s.live.plain_s[4] == pytest.approx(0.6)
    decisions = []
    for _ in range(10):
        d = s.draft_this_round(4)
        decisions.append(d)
        if d:
            verifying_round()
        else:
            s.observe_round(0, 0.0, 4, 0.55, 0.6)
    assert decisions[:5] == [True] * 4 + [False]  # a control round once 4 drafted rounds passed without one
    assert decisions[5:] == [True] * 4 + [False] and s.control_rounds == 3
    assert s.live.realized_gain(4) < modelled and s.live.plain_s[4] == pytest.approx(0.6)
    off = Algorithm1(ct, control_every=None)
    off.draft_this_round(4)
    depths = off.schedule(sure, [3] * 4)
    off.observe_round(4, 0.1, 4 + sum(depths), 0.9, 1.0)
    assert off.draft_this_round(4) and off.control_rounds == 0
