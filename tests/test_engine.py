"""SpeculativeEngine end to end on a tiny random Llama target with the toy drafter (tests/toy_drafter.py)."""
from __future__ import annotations

import itertools

import pytest
import torch

from pipeline.dspark.config import DrafterConfig
from pipeline.dspark.drafter import DSparkDrafter
from pipeline.engine.engine import SpecConfig, SpeculativeEngine
from pipeline.ops.sampling import SamplingParams, probs_from_logits
from pipeline.engine.cost_table import CostTable
from pipeline.engine.scheduler import FixedDepth
from pipeline.engine.target_runner import TargetRunner
from toy_drafter import (CharTokenizer, chi2_pvalue, greedy_reference, joint_counts, make_toy_drafter,
                         one_thread, tiny_llama)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_thread()

GAMMA = 4
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [12], [40, 41, 42, 43, 44]]
NTOK = 20
# a non-flat SPS curve so 'hardware' / 'async' really choose ragged depths
COST = CostTable({1: 0.040, 2: 0.043, 4: 0.047, 8: 0.055, 12: 0.07, 16: 0.09, 32: 0.15})


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=64, seed=0)


@pytest.fixture(scope="module")
def refs(target):
    return [greedy_reference(target, p, NTOK) for p in PROMPTS]


def _engine(target, noise=0.3, scheduler="fixed", method="standard", draft_ids=None, drafter=True, gamma=GAMMA,
            **kw):
    tr = TargetRunner(target, "float32", device="cpu", max_seq_len=128, init_len=16)
    dr = make_toy_drafter(target, noise=noise, block_size=gamma, draft_ids=draft_ids) if drafter else None
    spec = SpecConfig(method="dspark" if drafter else None, scheduler=scheduler, rejection_sample_method=method,
                      cost_table=COST, confidence_threshold=0.3, **kw)
    return SpeculativeEngine(tr, dr, spec, **{k: v for k, v in [("tokenizer", None)]})


@pytest.mark.parametrize("scheduler,method,subset", [
    ("fixed", "standard", False), ("threshold", "standard", True), ("hardware", "standard", False),
    ("async", "block", True), ("fixed", "block", False)])
def test_greedy_equals_target_greedy(target, refs, scheduler, method, subset):
    draft_ids = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:48] if subset else None
    eng = _engine(target, scheduler=scheduler, method=method, draft_ids=draft_ids)
    outs = eng.generate(PROMPTS, SamplingParams(), max_tokens=NTOK)
    for o, r in zip(outs, refs):
        assert o.output_ids == r
        assert o.finish_reason == "length"
    st = outs[0].stats
    assert st.rounds > 0 and st.accepted > 0  # multi-token rounds happened
    assert not eng.target._used and eng.drafter.live_states == 0  # everything released


def test_no_speculation_baseline(target, refs):
    eng = _engine(target, drafter=False)
    outs = eng.generate(PROMPTS, SamplingParams(), max_tokens=NTOK)
    assert [o.output_ids for o in outs] == refs
    assert outs[0].stats.rounds == NTOK - 1 and outs[0].stats.tau == 1.0


def test_no_drafting_when_nothing_is_verified(target, refs):
    """depth 0 (e.g. a fully loaded cluster): the engine decodes plainly and never runs a drafting round, while the
    drafter's context still follows the accepted tokens (a later round may draft again)."""
    eng = _engine(target, scheduler=FixedDepth(0))
    calls = []
    orig = eng.drafter.propose
    eng.drafter.propose = lambda *a, **k: calls.append(1) or orig(*a, **k)
    outs = eng.generate(PROMPTS, SamplingParams(), max_tokens=NTOK)
    assert [o.output_ids for o in outs] == refs
    assert not calls and eng.timers.skipped_drafts >= eng.timers.steps - 2  # all but the prefill and the last
    assert outs[0].stats.tau == 1.0 and outs[0].stats.verified == 0
    eng.scheduler = FixedDepth(None)  # drafting resumes on the context that was kept up to date
    outs = eng.generate(PROMPTS, SamplingParams(), max_tokens=NTOK)
    assert [o.output_ids for o in outs] == refs and calls and outs[0].stats.accepted > 0


class _EveryThird(FixedDepth):
    """Drafts one round in three (a back-off pattern) and verifies everything when it does."""

    def __init__(self):
        super().__init__(None)
        self.n = 0

    def draft_this_round(self, num_requests):
        self.n += 1
        return self.n % 3 == 0


def test_drafter_context_catches_up_lazily_after_skipped_rounds(target, refs):
    """Rounds that skip drafting do not touch the drafter: their verified tokens wait in the request and reach the
    drafter's context, in order and at the right positions, just before the next drafting round (the toy drafter
    asserts consecutive positions and recovers the tokens from the aux features)."""
    eng = _engine(target, scheduler=_EveryThird())
    events, full = [], [tuple(p + r) for p, r in zip(PROMPTS, refs)]
    orig_prop, orig_ext, orig_step = eng.drafter.propose, eng.drafter.extend_context, eng.step

    def propose(states, anchors, *a, **k):
        for st, x in zip(states, anchors.tolist()):  # context + anchor = a prefix of prompt + greedy output
            ctx = tuple(st.tokens) + (x,)
            assert any(f[:len(ctx)] == ctx for f in full), ctx
        events.append("propose")
        return orig_prop(states, anchors, *a, **k)

    def extend(*a, **k):
        events.append("extend")
        return orig_ext(*a, **k)

    def step():
        events.append("|")
        return orig_step()

    eng.drafter.propose, eng.drafter.extend_context, eng.step = propose, extend, step
    outs = eng.generate(PROMPTS, SamplingParams(), max_tokens=NTOK)
    assert [o.output_ids for o in outs] == refs
    assert outs[0].stats.accepted > 0 and eng.timers.skipped_drafts > 0
    rounds = " ".join(events).split("|")[1:]
    # the drafter is touched only in rounds that draft: pending extensions, then the proposal
    assert all(r.split() in ([], ["propose"]) or r.split()[-1] == "propose" for r in rounds), rounds
    assert any(r.split().count("extend") > len(PROMPTS) for r in rounds)  # several rounds caught up at once
    assert not eng.target._used and eng.drafter.live_states == 0


def test_batched_equals_single_with_join_and_leave(target, refs):
    single = []
    for p in PROMPTS:
        eng = _engine(target)
        single.append(eng.generate([p], SamplingParams(), max_tokens=NTOK)[0].output_ids)
    assert single == refs
    eng = _engine(target, scheduler="hardware")
    a = eng.add_request(PROMPTS[0], max_tokens=NTOK)
    eng.step()
    eng.step()
    b = eng.add_request(PROMPTS[1], max_tokens=NTOK)
    c = eng.add_request(PROMPTS[2], max_tokens=NTOK)
    eng.step()
    d = eng.add_request(PROMPTS[3], max_tokens=NTOK)
    eng.step()
    ab = eng.abort(c)
    assert ab.finished and ab.finish_reason == "abort" and ab.output_ids == refs[2][:len(ab.output_ids)]
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.output_ids
    assert done[a] == refs[0] and done[b] == refs[1] and done[d] == refs[3]
    assert not eng.target._used


def test_eos_inside_accepted_drafts(target, refs):
    """A perfect drafter (its LM == the target): every draft is accepted, so the EOS arrives as an accepted draft
    in the middle of a round; nothing after it is emitted and τ counts up to and including the EOS."""
    ref = refs[1]
    # an output index that is the 2nd..4th draft of a round (index 0 comes from the prefill)
    k = next(i for i in range(2, NTOK) if ref[i] not in ref[:i] and (i - 1) % (GAMMA + 1) in (1, 2, 3))
    eos = ref[k]
    eng = _engine(target, noise=0.0)
    eng.eos_token_ids = frozenset([eos])
    o = eng.generate([PROMPTS[1]], SamplingParams(), max_tokens=NTOK)[0]
    assert o.output_ids == ref[:k + 1]
    assert o.finish_reason == "stop" and o.stop_reason == eos
    st = o.stats
    assert st.emitted == k  # the prefill token is not a round
    full_rounds = (k - 1) // (GAMMA + 1)
    assert st.rounds == full_rounds + 1 and st.accepted >= k - 1 - full_rounds
    # ignore_eos / extra stop ids
    eng2 = _engine(target, noise=0.0)
    eng2.eos_token_ids = frozenset([eos])
    o2 = eng2.generate([PROMPTS[1]], SamplingParams(), max_tokens=NTOK, ignore_eos=True)[0]
    assert o2.output_ids == ref
    o3 = eng2.generate([PROMPTS[1]], SamplingParams(), max_tokens=NTOK, stop_token_ids=[ref[k + 1]],
                       ignore_eos=True)[0]
    assert o3.output_ids == ref[:ref.index(ref[k + 1]) + 1] and o3.stop_reason == ref[k + 1]


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 6, 7])
def test_max_tokens_never_exceeded(target, refs, max_tokens):
    eng = _engine(target, noise=0.0)
    outs = eng.generate(PROMPTS, SamplingParams(), max_tokens=max_tokens)
    for o, r in zip(outs, refs):
        assert o.output_ids == r[:max_tokens] and o.finish_reason == "length"
        st = o.stats
        assert st.emitted == max_tokens - 1
        # the budget caps the depth: no round verifies drafts it could not emit
        assert st.verified <= max(0, max_tokens - 1 - st.rounds)


def test_stop_strings(target, refs):
    tok = CharTokenizer()
    ref = refs[0]
    full = tok.decode(ref)
    k = next(i for i in range(3, NTOK - 1) if full.find(full[i:i + 2]) == i)
    stop = full[k:k + 2]
    tr = TargetRunner(target, "float32", device="cpu", max_seq_len=128)
    eng = SpeculativeEngine(tr, make_toy_drafter(target, noise=0.0, block_size=GAMMA),
                            SpecConfig(method="dspark"), tokenizer=tok)
    o = eng.generate([PROMPTS[0]], SamplingParams(), max_tokens=NTOK, stop=[stop, "never-there"])[0]
    assert o.output_ids == ref[:k + 2]
    assert o.text == full[:k] and o.finish_reason == "stop" and o.stop_reason == stop
    # string prompts go through the tokenizer
    o2 = eng.generate([tok.decode(PROMPTS[0])], SamplingParams(), max_tokens=4)[0]
    assert o2.output_ids == ref[:4] and o2.text == full[:4]


def test_stats_perfect_drafter(target):
    eng = _engine(target, noise=0.0)
    o = eng.generate([PROMPTS[0]], SamplingParams(), max_tokens=1 + 3 * (GAMMA + 1))[0]
    st = o.stats
    assert st.rounds == 3 and st.tau == GAMMA + 1
    assert st.acceptance_rate() == [1.0] * GAMMA and st.verified == 3 * GAMMA
    d = st.to_dict()
    assert d["tau"] == GAMMA + 1
    assert eng.timers.steps == 4 and eng.timers.target_s > 0


def test_seeded_request_reproducible_in_any_batch(target):
    p = SamplingParams(temperature=1.0, seed=123)
    e1 = _engine(target, scheduler="hardware")
    alone = e1.generate([PROMPTS[1]], p, max_tokens=12)[0].output_ids
    e2 = _engine(target, scheduler="hardware")
    outs = e2.generate(PROMPTS, [SamplingParams(temperature=1.0), p, SamplingParams(), p], max_tokens=12)
    assert outs[1].output_ids == alone


def test_spec_config_validation(target):
    with pytest.raises(ValueError):
        SpecConfig(method="eagle")
    with pytest.raises(ValueError):
        SpecConfig.from_dict({"method": "dspark", "bogus": 1})
    assert SpecConfig.from_dict({"method": "dspark", "num_speculative_tokens": 3}).num_speculative_tokens == 3
    with pytest.raises(ValueError):
        _engine(target, num_speculative_tokens=GAMMA + 1)
    eng = _engine(target, noise=0.0, num_speculative_tokens=2)
    o = eng.generate([PROMPTS[0]], SamplingParams(), max_tokens=7)[0]
    assert o.stats.rounds == 2 and o.stats.verified == 4


# ------------------------------------------------------------------------------------------------ distribution
def _exact_joint(model, prompt, n, params, V):
    """Exact target distribution of the first n generated tokens (enumerate all prefixes)."""
    seqs = list(itertools.product(range(V), repeat=n - 1))
    with torch.no_grad():
        ids = torch.tensor([list(prompt) + list(s) for s in seqs])
        logits = model(ids).logits[:, len(prompt) - 1:].float()  # [S, n, V]
    probs = probs_from_logits(logits, params).double()
    joint = torch.zeros(V ** n, dtype=torch.float64)
    for si, s in enumerate(seqs):
        pre = 1.0
        for k in range(n - 1):
            pre *= float(probs[si, k, s[k]])
        base = 0
        for t in s:
            base = base * V + t
        for y in range(V):
            joint[base * V + y] = pre * float(probs[si, n - 1, y])
    return joint


@pytest.mark.parametrize("case", ["standard-hardware", "block-threshold-subset-topk", "nospec", "CONTROL-lossy"])
def test_sampling_matches_target_distribution(case):
    """T > 0: the joint distribution of the first 4 generated tokens over thousands of requests (one batch) equals
    the target's exact joint distribution (chi-square).  CONTROL: a confidence computed from x_k itself makes the
    threshold depth rule lossy, and the same test must reject it."""
    V, n, N = 4, 4, 3000
    model = tiny_llama(vocab=V, hidden=32, seed=5, head_scale=2.0)
    prompt = [0, 1, 2]
    if case == "standard-hardware":
        params = SamplingParams(temperature=1.0)
        # a rising curve sized for a 3000-request batch: some requests get depth 2, others 1 (ragged verification)
        spec = SpecConfig(method="dspark", scheduler="hardware", cost_table=CostTable({1: 1.0, 20000: 1.6}), seed=1)
        dr = make_toy_drafter(model, noise=0.5, block_size=3)
    elif case == "block-threshold-subset-topk":
        params = SamplingParams(temperature=0.8, top_k=3)
        spec = SpecConfig(method="dspark", scheduler="threshold", confidence_threshold=0.4,
                          rejection_sample_method="block", seed=2)
        dr = make_toy_drafter(model, noise=0.5, block_size=3, draft_ids=torch.tensor([3, 0, 1]))
    elif case == "nospec":
        params = SamplingParams(temperature=1.0)
        spec, dr = SpecConfig(seed=3), None
    else:
        params = SamplingParams(temperature=0.8, top_k=3)
        spec = SpecConfig(method="dspark", scheduler="threshold", confidence_threshold=0.4, seed=4)
        dr = make_toy_drafter(model, noise=0.5, block_size=3, draft_ids=torch.tensor([3, 0, 1]),
                              lossy_confidence=True)
    tr = TargetRunner(model, "float32", device="cpu", max_seq_len=16, init_len=8)
    eng = SpeculativeEngine(tr, dr, spec)
    outs = eng.generate([prompt] * N, params, max_tokens=n)
    counts = joint_counts(outs, V, n)
    want = _exact_joint(model, prompt, n, params, V)
    pval = chi2_pvalue(counts, want)
    if case.startswith("CONTROL"):
        assert pval < 1e-6, pval
        return
    assert pval > 1e-3, pval
    if dr is not None:
        tot = outs[0].stats
        for o in outs[1:]:
            tot = tot.merge(o.stats)
        assert tot.accepted > 0.3 * tot.rounds  # speculation really happened
        if case == "standard-hardware":
            assert 0.1 < tot.verified_at[1] / tot.verified_at[0] < 0.9  # the scheduler chose mixed depths


def test_with_pipeline_drafter(target, refs):
    """The real DSparkDrafter (random weights) through the same engine: greedy output is still exactly the target's
    (lossless whatever the drafter quality); its nn.Module ``cfg`` and batched ``extend_contexts`` are used."""
    cfg = DrafterConfig.from_target_config(target.config, num_hidden_layers=1, aux_layer_ids=[1, 2], mask_token_id=0,
                                           markov_rank=8, block_size=GAMMA)
    dr = DSparkDrafter.from_target(cfg, target).eval()
    tr = TargetRunner(target, "float32", device="cpu", max_seq_len=128)
    eng = SpeculativeEngine(tr, dr, SpecConfig(method="dspark", scheduler="hardware", cost_table=COST))
    outs = eng.generate(PROMPTS, SamplingParams(), max_tokens=NTOK)
    assert [o.output_ids for o in outs] == refs
    outs = eng.generate(PROMPTS[:2], SamplingParams(temperature=1.0, top_k=10), max_tokens=8)
    assert all(len(o.output_ids) == 8 for o in outs)


def test_bf16_drafter_with_fp32_target_is_lossless(target, refs):
    """A drafter in bf16 (what jobs.evaluate picks with a bf16 target on a CPU with native bf16) only changes the
    proposals: against an fp32 target, greedy output is still exactly the target's, and sampling runs on the fp32
    probabilities the drafts were drawn from."""
    cfg = DrafterConfig.from_target_config(target.config, num_hidden_layers=1, aux_layer_ids=[1, 2], mask_token_id=0,
                                           markov_rank=8, block_size=GAMMA)
    dr = DSparkDrafter.from_target(cfg, target).eval().to(torch.bfloat16)
    tr = TargetRunner(target, "float32", device="cpu", max_seq_len=128)
    eng = SpeculativeEngine(tr, dr, SpecConfig(method="dspark", scheduler="fixed"))
    outs = eng.generate(PROMPTS, SamplingParams(), max_tokens=NTOK)
    assert [o.output_ids for o in outs] == refs
    assert sum(o.stats.rounds for o in outs) > 0
    prop = dr.propose([dr.new_state()], torch.tensor([3]), SamplingParams(temperature=1.0))
    assert prop.q.dtype == torch.float32
    torch.testing.assert_close(prop.q.sum(-1), torch.ones(1, GAMMA))
