"""The fixed-shape (padded) forwards behind CUDA graphs (pipeline/engine/cuda_graphs.py), on CPU: padding rows, tokens and
keys to buckets gives the ragged path's outputs - the target forward (logits, aux hidden states, the KV cache it
leaves), the DSpark drafting round (tokens, q, confidence), and the engine's greedy and seeded outputs."""
from __future__ import annotations

import pytest
import torch

from pipeline.engine.cuda_graphs import StaticDraftProposer, StaticShapes, StaticTargetForward
from pipeline.dspark.config import DrafterConfig
from pipeline.dspark.drafter import DSparkDrafter
from pipeline.engine.engine import SpecConfig, SpeculativeEngine
from pipeline.ops.sampling import SamplingParams
from pipeline.engine.target_runner import TargetRunner
from test_drafter import D, randomize, tiny_cfg
from test_target_runner import CFG, _model
from toy_drafter import greedy_reference, one_thread, tiny_llama


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_thread()


# buckets that force padding of rows (3 -> 4), tokens (5 -> 8) and keys (to powers of two from 8)
SHAPES = StaticShapes(row_buckets=(1, 2, 4, 8), token_buckets=(1, 2, 8), min_keys=8)


def test_buckets():
    s = StaticShapes(row_buckets=(4, 1, 2), max_tokens=5)
    assert s.row_buckets == (1, 2, 4) and s.token_buckets == (1, 2, 3, 4, 5)
    assert [s.rows(n) for n in (1, 3, 4, 5)] == [1, 4, 4, None]
    assert s.tokens(5) == 5 and s.tokens(6) is None
    assert s.keys(1) == 64 and s.keys(65) == 128 and s.keys(65, cap=100) == 100 and s.keys(100, cap=90) == 100
    with pytest.raises(ValueError, match="row_buckets"):
        StaticShapes(row_buckets=(0, 2))
    with pytest.raises(ValueError, match="CUDA"):
        StaticTargetForward(TargetRunner(_model("llama"), "float32", device="cpu"), s, capture=True)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_padded_target_forward_equals_ragged(kind):
    """Three requests (non-contiguous slots, permuted order, different cache lengths and new-token counts) through
    the padded forward == the ragged forward: logits, aux hidden states, and - by continuing both runners - the K/V
    they wrote.  mistral's sliding window (6) is shorter than the contexts."""
    m = _model(kind)
    g = torch.Generator().manual_seed(2)
    V = CFG["vocab_size"]
    ctx = [torch.randint(0, V, (n,), generator=g) for n in (7, 15, 3)]
    new = [torch.randint(0, V, (n,), generator=g) for n in (4, 1, 5)]
    more = [torch.randint(0, V, (n,), generator=g) for n in (2, 2, 1)]
    outs = {}
    for padded in (False, True):
        r = TargetRunner(m, "float32", device="cpu", init_slots=2, init_len=8)
        junk = r.alloc()
        slots = [r.alloc() for _ in ctx]
        r.free(junk)
        r.forward(slots, ctx, logits_last=1)  # a 15-token prompt: eager in both runners
        if padded:
            r.static_forward = StaticTargetForward(r, SHAPES, capture=False)
            assert r.static_forward.pad_slot not in slots
        order = [2, 0, 1]
        a = r.forward([slots[i] for i in order], [new[i] for i in order], aux_layer_ids=[0, 2, 3])
        b = r.forward(slots, more, logits_last=[1, 2, 1], aux_layer_ids=[3])
        outs[padded] = (a, b, [r.length(s) for s in slots])
        if padded:
            assert r.static_forward.runs == 2  # both rounds ran padded: (4 rows, 8 tokens), (4 rows, 2 tokens)
            assert {k[:2] for k in r.static_forward.entries} == {(4, 2)}  # the cache grew: (4, 8) was dropped
            assert r.length(r.static_forward.pad_slot) == 0
    (a0, b0, l0), (a1, b1, l1) = outs[False], outs[True]
    assert l0 == l1 == [len(c) + len(n) + len(x) for c, n, x in zip(ctx, new, more)]
    for x, y in ((a0, a1), (b0, b1)):
        assert x.logit_offsets == y.logit_offsets and x.token_offsets == y.token_offsets
        torch.testing.assert_close(y.logits, x.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y.aux_hidden, x.aux_hidden, atol=1e-5, rtol=1e-5)


def test_padded_draft_round_equals_propose():
    """Three requests with different context lengths, padded to 4 rows and 16 context slots: the same tokens and
    the same q / logits / confidence as DSparkDrafter.propose, greedy (the Markov loop inside the fixed-shape part)
    and sampled (seeded: the same random draws)."""
    m = randomize(DSparkDrafter(tiny_cfg(markov_head_type="rnn"))).eval()
    g = torch.Generator().manual_seed(0)
    states = []
    for n in (1, 5, 11):
        st = m.new_state(capacity=4)
        m.extend_context(st, torch.randn(n, 3 * D, generator=g))
        states.append(st)
    anchors = torch.tensor([5, 6, 7])
    static = StaticDraftProposer(m, SHAPES, capture=False)
    for params in (SamplingParams(), SamplingParams(temperature=0.8, top_k=40)):
        ref = m.propose(states, anchors, params, torch.Generator().manual_seed(4))
        got = static(states, anchors, params, torch.Generator().manual_seed(4))
        assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.draft_index, ref.draft_index)
        torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.q, ref.q, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got.conf_logits, ref.conf_logits, atol=1e-5, rtol=1e-5)
    assert sorted(static.entries) == [(4, 16, False), (4, 16, True)]
    # a single request (the drafter's unpadded fast path) against its padded row
    one = static(states[1:2], anchors[1:2], SamplingParams())
    assert torch.equal(one.tokens, m.propose(states[1:2], anchors[1:2], SamplingParams()).tokens)


def _engine(target, static: bool, gamma=4):
    cfg = DrafterConfig.from_target_config(target.config, num_hidden_layers=1, aux_layer_ids=[1, 2], mask_token_id=0,
                                           markov_rank=8, block_size=gamma)
    torch.manual_seed(0)
    dr = DSparkDrafter.from_target(cfg, target).eval()
    eng = SpeculativeEngine(TargetRunner(target, "float32", device="cpu", max_seq_len=128), dr,
                            SpecConfig(method="dspark", scheduler="fixed"))
    if static:
        eng.use_static_shapes(capture=False, shapes=StaticShapes(row_buckets=(1, 2, 4, 8), token_buckets=(2, 8),
                                                                 min_keys=8))
    return eng


def test_padded_engine_equals_ragged_engine():
    """The engine with every fitting forward and drafting round padded: greedy output is the target's, round by
    round the same acceptance as the unpadded engine, and a seeded sampled request gives the same tokens."""
    target = tiny_llama(vocab=64, seed=0)
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [12]]
    refs = [greedy_reference(target, p, 16) for p in prompts]
    runs = {}
    for static in (False, True):
        eng = _engine(target, static)
        greedy = eng.generate(prompts, SamplingParams(), max_tokens=16)
        sampled = eng.generate(prompts, SamplingParams(temperature=1.0, top_k=20, seed=7), max_tokens=12)
        runs[static] = (greedy, sampled, eng)
    (g0, s0, _), (g1, s1, eng) = runs[False], runs[True]
    assert [o.output_ids for o in g1] == [o.output_ids for o in g0] == refs
    assert [o.stats.accepted_at for o in g1] == [o.stats.accepted_at for o in g0]
    assert [o.output_ids for o in s1] == [o.output_ids for o in s0]
    assert eng.target.static_forward.runs > 10 and eng.static_draft.runs > 10  # the padded paths ran
    with pytest.raises(ValueError, match="CUDA target"):
        SpeculativeEngine(TargetRunner(target, "float32", device="cpu"), eng.drafter,
                          SpecConfig(method="dspark", cuda_graphs=True))


def test_padded_forward_with_an_fp32_cache_in_a_bf16_runner():
    """The fixed-shape forward shares the eager one's layer pieces, so a bf16 runner whose KV cache is fp32 (where
    attention is faster in fp32) runs padded too, with the eager forward's logits."""
    m = _model("llama").to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    ctx = [torch.randint(0, CFG["vocab_size"], (n,), generator=g) for n in (5, 7, 3)]
    new = [torch.randint(0, CFG["vocab_size"], (n,), generator=g) for n in (4, 1, 5)]
    outs = []
    for padded in (False, True):
        r = TargetRunner(m, "bfloat16", device="cpu", attention_dtype=torch.float32)
        slots = [r.alloc() for _ in ctx]
        r.forward(slots, ctx, logits_last=1)
        if padded:
            r.static_forward = StaticTargetForward(r, SHAPES, capture=False)
        outs.append(r.forward(slots, new).logits)
        if padded:
            assert r.static_forward.runs == 1 and r.k_cache.dtype == torch.float32
    torch.testing.assert_close(outs[1], outs[0], atol=1e-2, rtol=1e-2)
