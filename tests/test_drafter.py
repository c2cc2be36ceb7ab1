"""Drafter model: config, frozen params, TRAIN PATH == INFERENCE PATH, heads, anchors, draft vocab, context cache."""
import pytest
import torch

from pipeline.dspark.anchors import block_labels, make_blocks, sample_anchors
from pipeline.dspark.draft_vocab import build_draft_vocab, count_tokens, d2t_from_draft_ids, draft_ids_from_d2t
from pipeline.dspark.drafter import DSparkDrafter
from pipeline.dspark.config import DrafterConfig, DrafterConfigError, dflash_layer_ids
from pipeline.ops.sampling import SamplingParams
from pipeline.dspark.markov_head import BiasCache, GatedMarkovHead, NoHead, RNNMarkovHead, VanillaMarkovHead

torch.set_num_threads(1)  # tiny shapes: threads only add contention on the shared 2-core machine

V, D, G = 256, 64, 4

from tiny_target import tiny_target  # noqa: E402


def tiny_cfg(**kw):
    base = dict(hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                vocab_size=V, mask_token_id=3, aux_layer_ids=[1, 2, 3], block_size=G, markov_rank=16)
    base.update(kw)
    return DrafterConfig(**base)


def randomize(m: DSparkDrafter, std=0.2):
    """Make every head non-trivial (W2 / confidence head are zero-initialised)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() > 0 and "norm" not in name:
                p.normal_(0, std)
    return m


def reduced_vocab_ids(n=200):
    g = torch.Generator().manual_seed(5)
    return torch.randperm(V, generator=g)[:n].sort().values


# ---------------------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------------------
def test_dflash_layer_rule_in_our_convention():
    # DeepSpec Qwen3-4B (L=36, n=5): theirs [1,9,17,25,33] -> ours +1
    assert dflash_layer_ids(36, 5) == [2, 10, 18, 26, 34]
    assert dflash_layer_ids(40, 5) == [2, 11, 20, 29, 38]
    assert dflash_layer_ids(30, 3) == [2, 15, 28]
    ids = dflash_layer_ids(4, 3)  # tiny target: fallback keeps ids distinct and inside [0, L]
    assert ids == sorted(set(ids)) and len(ids) == 3 and 0 <= ids[0] and ids[-1] <= 4


def test_from_target_config_copies_widths():
    t = tiny_target()
    c = DrafterConfig.from_target_config(t.config, num_hidden_layers=2)
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (64, 4, 2, 16)
    assert c.vocab_size == V and c.target_num_layers == 4 and c.num_aux_layers == 3
    assert c.mask_token_id == 0  # pad token
    assert c.rope_theta == pytest.approx(10000.0)
    d = DrafterConfig.from_target_config(t.config, kind="dflash")
    assert d.markov_rank == 0 and not d.enable_confidence_head
    assert DrafterConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("kw,msg", [
    (dict(aux_layer_ids=[2, 2]), "strictly increasing"),
    (dict(aux_layer_ids=[1, 5], target_num_layers=4), "exceed"),
    (dict(num_hidden_layers=6), "1..5"),
    (dict(num_key_value_heads=3), "multiple"),
    (dict(kind="dflash"), "dflash"),
    (dict(markov_rank=0), "confidence_head_with_markov"),
    (dict(sts_temperatures=[1.0]), "sts_temperatures"),
    (dict(draft_vocab_size=V + 1), "draft_vocab_size"),
    (dict(mask_token_id=V), "mask_token_id"),
    (dict(markov_head_type="lstm"), "markov_head_type"),
])
def test_config_validation(kw, msg):
    with pytest.raises(DrafterConfigError, match=msg):
        tiny_cfg(**kw)


# ---------------------------------------------------------------------------------------------------------------
# frozen parameters
# ---------------------------------------------------------------------------------------------------------------
def test_frozen_params_get_no_grad_and_do_not_change():
    t = tiny_target()
    m = DSparkDrafter.from_target(tiny_cfg(draft_vocab_size=200), t, draft_ids=reduced_vocab_ids())
    assert torch.equal(m.embed_tokens.weight, t.model.embed_tokens.weight)
    assert torch.equal(m.lm_head.weight, t.lm_head.weight[m.draft_ids])
    frozen = {"embed_tokens.weight", "lm_head.weight"}
    assert {n for n, p in m.named_parameters() if not p.requires_grad} == frozen
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)  # deliberately ALL parameters
    T = 24
    ids = torch.randint(0, V, (1, T))
    blocks = make_blocks(ids, torch.ones(1, T), 6, G, torch.Generator().manual_seed(0))
    h = m.forward_train(torch.randn(1, T, 3 * D), ids, blocks.anchors, blocks.valid)
    out = m.block_logits(h, blocks.prev, blocks.label_mask)
    (out.logits.logsumexp(-1).sum() + out.conf_logits.sum()).backward()
    for n, p in m.named_parameters():
        assert (p.grad is None) == (n in frozen), n
    opt.step()
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n]) == (n in frozen), n


# ---------------------------------------------------------------------------------------------------------------
# TRAIN PATH == INFERENCE PATH
# ---------------------------------------------------------------------------------------------------------------
def _train_vs_inference(cfg, draft_ids=None, T=22, chunk=8):
    m = DSparkDrafter(cfg, attn_chunk_queries=chunk)
    if draft_ids is not None:
        m.set_draft_vocab(draft_ids)
    randomize(m).eval()
    torch.manual_seed(2)
    pool = m.draft_ids
    ids = pool[torch.randint(0, pool.numel(), (1, T))]  # every label inside the draft vocab
    aux = torch.randn(1, T, cfg.num_aux_layers * D)
    anchors = torch.tensor([[0, 1, 4, 7, 11, 15, 17, 0]])
    valid = torch.tensor([[True] * 7 + [False]])
    blocks = block_labels(ids, torch.ones(1, T), anchors, valid, G)
    with torch.no_grad():
        h = m.forward_train(aux, ids, anchors, valid)
        out = m.block_logits(h, blocks.prev)  # every slot
    S = anchors.shape[1]
    lg = out.logits.view(S, G, -1)
    cf = None if out.conf_logits is None else out.conf_logits.view(S, G)
    checked = 0
    for s in range(S - 1):
        p = int(anchors[0, s])
        if p + G >= T:
            continue
        st = m.new_state(capacity=2)  # forces growth (and window compaction)
        if p:  # feed the context in two pieces, as a serving loop would
            m.extend_context(st, aux[0, :p // 2])
            m.extend_context(st, aux[0, p // 2:p], start_pos=p // 2)
        prop = m.propose([st], ids[0, p:p + 1], SamplingParams(temperature=1.0),
                         forced_tokens=ids[0, p + 1:p + 1 + G][None])
        torch.testing.assert_close(prop.logits[0], lg[s].float(), atol=2e-5, rtol=1e-5)
        if cf is not None:
            torch.testing.assert_close(prop.conf_logits[0], cf[s], atol=2e-5, rtol=1e-5)
        assert torch.equal(prop.tokens[0], ids[0, p + 1:p + 1 + G])
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_train_path_equals_inference_path(head):
    _train_vs_inference(tiny_cfg(markov_head_type=head))


def test_train_equals_inference_reduced_vocab_window_and_dflash():
    _train_vs_inference(tiny_cfg(draft_vocab_size=200), draft_ids=reduced_vocab_ids())
    _train_vs_inference(tiny_cfg(context_window=5, markov_head_type="rnn"))
    _train_vs_inference(tiny_cfg(kind="dflash", markov_rank=0, enable_confidence_head=False,
                                 confidence_head_with_markov=False))
    _train_vs_inference(tiny_cfg(confidence_head_with_markov=False, num_hidden_layers=1), chunk=1000)


def _planted_greedy_sequence(head, seed, T, start, first_cut, next_anchor):
    """A tiny drafter and a sequence built from its own greedy blocks: from anchor p = start on, ids[p+1 : p+1+γ] =
    the greedy block with slot `cut` changed (cut = γ: unchanged), cut cycling by 3; the next anchor is
    next_anchor(p, cut).  -> (model, aux [T,3D], ids [T], greedy_block(p) through the inference path)."""
    m = randomize(DSparkDrafter(tiny_cfg(markov_head_type=head, draft_vocab_size=200), attn_chunk_queries=8))
    m.set_draft_vocab(reduced_vocab_ids())
    m.eval()
    torch.manual_seed(seed)
    aux = torch.randn(T, 3 * D)
    ids = m.draft_ids[torch.randint(0, 200, (T,))]

    def greedy_block(p):
        st = m.new_state()
        m.extend_context(st, aux[:p])
        return m.propose([st], ids[p:p + 1], SamplingParams(temperature=0.0)).tokens[0]

    p, cut = start, first_cut
    while p + G < T:
        blk = greedy_block(p).clone()
        if cut < G:
            blk[cut] = m.draft_ids[(m.t2d[blk[cut]] + 1) % 200]
        ids[p + 1:p + 1 + G] = blk
        p, cut = next_anchor(p, cut), (cut + 3) % (G + 1)
    return m, aux, ids, greedy_block


@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_teacher_forced_tau_equals_greedy_drafting(head):
    """The learning curve's held-out tau (training path, true predecessors) equals what greedy drafting through the
    inference path gets accepted against the sequence.  The sequence is built from the drafter's own greedy blocks,
    each cut at a chosen slot, so acceptance lengths 0..γ all occur."""
    from pipeline.train.heldout import teacher_forced_tau

    T, start = 60, 6
    m, aux, ids, greedy_block = _planted_greedy_sequence(head, seed=3, T=T, start=start, first_cut=0,
                                                         next_anchor=lambda p, cut: p + G)
    mask = torch.ones(T, dtype=torch.uint8)
    mask[:start] = 0
    sample = dict(input_ids=ids.int(), loss_mask=mask, aux_hidden=aux)

    hist = torch.zeros(G + 1)
    for p in range(start, T - G):  # every anchor whose γ labels are all supervised
        accepted = int((greedy_block(p) == ids[p + 1:p + 1 + G]).long().cumprod(0).sum())
        hist[accepted] += 1
    ev = teacher_forced_tau(m, [sample], blocks_per_sample=1000)
    assert ev["blocks"] == int(hist.sum())
    assert (hist > 0).sum() >= 4  # several different acceptance lengths: the comparison is not trivial
    torch.testing.assert_close(torch.tensor(ev["accept_hist"]), hist / hist.sum())
    assert ev["tau"] == pytest.approx(1 + float((hist * torch.arange(G + 1)).sum() / hist.sum()))
    assert not m.training  # left as it was
    # fewer blocks: evenly spaced anchors, first and last included
    assert teacher_forced_tau(m, [sample], blocks_per_sample=5)["blocks"] == 5


def test_greedy_walk_tau_replays_greedy_rounds():
    """`python -m jobs.bench heldout_tau --walk-tokens`: rounds replayed along a sequence through the training path
    equal greedy drafting through the inference path round by round (draft from the last emitted token, keep the
    matching prefix + the bonus token), cut at max_tokens."""
    from pipeline.train.heldout import greedy_walk_tau

    T, start = 70, 5  # blocks planted where each greedy round starts, so rounds accept 0..γ
    m, aux, ids, greedy_block = _planted_greedy_sequence("vanilla", seed=5, T=T, start=start, first_cut=2,
                                                         next_anchor=lambda p, cut: p + cut + 1)
    mask = torch.ones(T, dtype=torch.uint8)
    mask[:start] = 0
    sample = dict(input_ids=ids.int(), loss_mask=mask, aux_hidden=aux)
    for max_tokens in (T, 31):
        end = min(T, start + max_tokens)
        q, steps = start, []
        while q < end - 1:
            blk = greedy_block(q)
            n = min(G, end - 1 - q)
            a = int((blk[:n] == ids[q + 1:q + 1 + n]).long().cumprod(0).sum())
            steps.append(min(a + 1, end - 1 - q))
            q += steps[-1]
        got = greedy_walk_tau(m, [sample], max_tokens)
        assert got["rounds"] == len(steps) and got["tokens"] == sum(steps) == end - 1 - start
        assert len(set(steps)) >= 3  # several acceptance lengths: not a trivial walk
        assert got["tau"] == pytest.approx(sum(steps) / len(steps))


def test_teacher_forced_tau_sees_fused_adamw_updates():
    """Evaluating in the middle of training (pipeline.train.config's learning curve): after fused AdamW steps the tau
    must be the tau of the CURRENT weights, as a freshly built copy computes it (packed weight caches are dropped)."""
    from pipeline.ops import packed_linear
    from pipeline.train.heldout import teacher_forced_tau

    torch.manual_seed(4)
    m = randomize(DSparkDrafter(tiny_cfg(), attn_chunk_queries=8), std=0.1)
    T = 40
    sample = dict(input_ids=torch.randint(4, V, (T,)).int(), loss_mask=torch.ones(T, dtype=torch.uint8),
                  aux_hidden=torch.randn(T, 3 * D))
    before = teacher_forced_tau(m, [sample])  # packs the weights
    opt = torch.optim.AdamW(m.trainable_parameters(), lr=0.05, fused=True)
    ids = sample["input_ids"].long()[None]
    blk = make_blocks(ids, sample["loss_mask"][None], 16, G, torch.Generator().manual_seed(0))
    for _ in range(3):  # train toward the labels: the predictions change
        opt.zero_grad()
        out = m.block_logits(m.forward_train(sample["aux_hidden"][None], ids, blk.anchors, blk.valid), blk.prev,
                             blk.label_mask)
        torch.nn.functional.cross_entropy(out.logits, m.t2d[blk.labels[blk.label_mask]]).backward()
        opt.step()
    fresh = DSparkDrafter(tiny_cfg(), attn_chunk_queries=8)
    fresh.load_state_dict(m.state_dict())
    after, expected = teacher_forced_tau(m, [sample]), teacher_forced_tau(fresh, [sample])
    assert after["accept_hist"] == expected["accept_hist"]
    if packed_linear.available():
        assert after["accept_hist"] != before["accept_hist"]  # the steps changed the predictions


def test_batched_propose_equals_single_requests():
    m = randomize(DSparkDrafter(tiny_cfg(markov_head_type="rnn"))).eval()
    lens = [0, 3, 9]
    auxs = [torch.randn(n, 3 * D) for n in lens]
    states = []
    for a in auxs:
        st = m.new_state(capacity=4)
        m.extend_context(st, a)
        states.append(st)
    anchors = torch.tensor([5, 6, 7])
    forced = torch.randint(0, V, (3, G))
    batched = m.propose(states, anchors, SamplingParams(temperature=0.7, top_k=50), forced_tokens=forced)
    for b in range(3):
        single = m.propose([states[b]], anchors[b:b + 1], SamplingParams(temperature=0.7, top_k=50),
                           forced_tokens=forced[b:b + 1])
        torch.testing.assert_close(batched.logits[b], single.logits[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(batched.q[b], single.q[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(batched.conf_logits[b], single.conf_logits[0], atol=1e-5, rtol=1e-5)


def test_propose_sampling_is_fp32_reproducible_and_in_draft_vocab():
    ids = reduced_vocab_ids()
    m = DSparkDrafter(tiny_cfg(draft_vocab_size=200))
    m.set_draft_vocab(ids)
    randomize(m).eval()
    st = m.new_state()
    m.extend_context(st, torch.randn(7, 3 * D))
    p = SamplingParams(temperature=1.0)
    a = m.propose([st, st], torch.tensor([1, 2]), p, torch.Generator().manual_seed(3))
    b = m.propose([st, st], torch.tensor([1, 2]), p, torch.Generator().manual_seed(3))
    assert torch.equal(a.tokens, b.tokens)
    assert a.q.dtype == torch.float32 and a.q.shape == (2, G, 200)
    assert a.conf_logits.dtype == torch.float32 and a.conf_logits.shape == (2, G)
    assert torch.isin(a.tokens, ids).all() and torch.equal(a.draft_ids, ids)
    assert torch.equal(ids[a.draft_index], a.tokens)
    assert (a.q.gather(-1, a.draft_index[..., None]) > 0).all()  # sampled from q
    torch.testing.assert_close(a.q.sum(-1), torch.ones(2, G))
    gen = torch.Generator().manual_seed(5)
    before = gen.get_state()
    g = m.propose([st], torch.tensor([1]), SamplingParams(temperature=0.0), gen)  # greedy: argmax of g
    assert torch.equal(g.draft_index[0], g.logits[0].argmax(-1))
    assert torch.equal(g.q[0], torch.nn.functional.one_hot(g.draft_index[0], 200).float())
    assert torch.equal(gen.get_state(), before)  # greedy drafting draws no random numbers
    rows = m.propose([st, st], torch.tensor([1, 1]), [SamplingParams(), SamplingParams(top_k=3)])  # all greedy
    assert torch.equal(rows.tokens, torch.cat([g.tokens, g.tokens]))
    # per-request params and generators
    c = m.propose([st, st], torch.tensor([1, 2]), [p, SamplingParams()],
                  [torch.Generator().manual_seed(3), None])
    assert torch.equal(c.draft_index[1], c.logits[1].argmax(-1))


def test_sts_temperatures_scale_conf_logits():
    m = randomize(DSparkDrafter(tiny_cfg())).eval()
    st = m.new_state()
    m.extend_context(st, torch.randn(4, 3 * D))
    raw = m.propose([st], torch.tensor([9]), SamplingParams())
    m.cfg.sts_temperatures = [1.0, 2.0, 4.0, 0.5]
    scaled = m.propose([st], torch.tensor([9]), SamplingParams())
    torch.testing.assert_close(scaled.conf_logits, raw.conf_logits / torch.tensor([1.0, 2.0, 4.0, 0.5]))


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_markov_w1_gradient_equals_dense_embedding_gradient(head):
    """W1's backward adds rows straight into W1.grad (a reused buffer); it must equal autograd's dense embedding
    gradient, accumulate over backwards, and start from zero again after zero_grad(set_to_none=True)."""
    from pipeline.dspark.markov_head import HEADS

    torch.manual_seed(0)
    m = HEADS[head](V, 40, 16, D)
    with torch.no_grad():
        m.markov_w2.weight.normal_()
    prev = torch.randint(0, V, (3, 5, G))  # repeated rows included
    h = torch.randn(3, 5, G, D)

    def loss_of(mod):
        return (mod.bias(prev, h) ** 2).sum()

    ref = HEADS[head](V, 40, 16, D)
    ref.load_state_dict(m.state_dict())
    ref.prev_embed = lambda p: torch.nn.functional.embedding(p, ref.markov_w1.weight)  # autograd's dense path
    for _ in range(2):  # accumulation over two backwards
        loss_of(m).backward()
        loss_of(ref).backward()
    assert m.markov_w1.weight.grad is not None
    torch.testing.assert_close(m.markov_w1.weight.grad, ref.markov_w1.weight.grad)
    torch.testing.assert_close(m.markov_w2.weight.grad, ref.markov_w2.weight.grad)
    buf = m.markov_w1.weight.grad
    for mod in (m, ref):
        for p in mod.parameters():
            p.grad = None
    loss_of(m).backward()
    loss_of(ref).backward()
    assert m.markov_w1.weight.grad is buf  # the buffer is reused, zeroed first
    torch.testing.assert_close(m.markov_w1.weight.grad, ref.markov_w1.weight.grad)
    with torch.no_grad():  # inference: plain lookup, no autograd function
        torch.testing.assert_close(m.prev_embed(prev), ref.markov_w1(prev))


def test_rnn_step_equals_parallel_and_carries_state():
    torch.manual_seed(0)
    head = RNNMarkovHead(V, V, 16, D)
    with torch.no_grad():
        head.markov_w2.weight.normal_()
    prev = torch.randint(0, V, (3, G))
    h = torch.randn(3, G, D)
    par = head.bias(prev, h)  # [3,γ,V]
    state = head.init_state(3)
    zero_state_bias = []
    for k in range(G):
        b, state = head.step(prev[:, k], h[:, k], state)
        torch.testing.assert_close(b, par[:, k], atol=1e-5, rtol=1e-5)
        zero_state_bias.append(head.step(prev[:, k], h[:, k], head.init_state(3))[0])
    assert not torch.allclose(zero_state_bias[2], par[:, 2])  # a stateless step (reference bug) would differ
    assert NoHead().bias(prev, h) is None and NoHead().step(prev[:, 0], h[:, 0], None) == (None, None)


@pytest.mark.parametrize("w1", ["table", "embedding"])
def test_vanilla_step_bias_cache_equals_the_uncached_step_and_follows_the_weights(w1):
    """The inference step's bias rows by previous token: the same values as computing W2 W1[prev] each step, with
    repeats and duplicates in a batch, more distinct tokens than rows (LRU eviction), under inference_mode and
    no_grad alike; an in-place weight update empties it; autograd (training) never reads it."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(V, D) if w1 == "embedding" else None
    head = VanillaMarkovHead(V, 40, 16, D, target_embed=emb)
    with torch.no_grad():
        head.markov_w2.weight.normal_()
        head.markov_w1.weight.normal_()
    cache = head.bias_cache = BiasCache(capacity_bytes=64 * 40 * 4)  # 64 rows (the minimum)
    h = torch.randn(5, D)

    def uncached(prev):
        return head.project(head.prev_embed(prev))

    gen = torch.Generator().manual_seed(1)
    for i in range(60):
        prev = torch.randint(0, 90 if i < 40 else V, (5,), generator=gen)
        prev[3] = prev[0]  # a duplicate within the batch
        ctx = torch.inference_mode() if i % 2 else torch.no_grad()
        with ctx:
            got, state = head.step(prev, h, None)
            torch.testing.assert_close(got, uncached(prev), rtol=1e-4, atol=1e-5)  # fp32 GEMMs of other shapes
        assert state is None
    assert cache.hits > 0 and cache.misses > 64  # reused rows, and evictions past the 64 rows
    assert cache.rows.shape == (64, 40)
    with torch.no_grad():
        head.markov_w2.weight.mul_(2.0)  # in place: the cached rows are stale
        prev = torch.arange(5)
        torch.testing.assert_close(head.step(prev, h, None)[0], uncached(prev))
    out, _ = head.step(prev, h, None)  # grad enabled: the plain path, differentiable
    assert out.requires_grad
    assert GatedMarkovHead(V, 40, 16, D).bias_cache is None and RNNMarkovHead(V, 40, 16, D).bias_cache is None


# ---------------------------------------------------------------------------------------------------------------
# context cache
# ---------------------------------------------------------------------------------------------------------------
def test_extend_context_rewrite_gap_and_window():
    m = randomize(DSparkDrafter(tiny_cfg(context_window=6))).eval()
    aux = torch.randn(30, 3 * D)
    ref = m.new_state(capacity=64)
    m.extend_context(ref, aux[:20])
    st = m.new_state(capacity=2)
    for i in range(0, 20, 3):
        m.extend_context(st, aux[i:min(i + 3, 20)])
    assert st.length == 20 and st.start > 0  # compacted: old positions dropped
    r1 = m.propose([ref], torch.tensor([4]), SamplingParams())
    r2 = m.propose([st], torch.tensor([4]), SamplingParams())
    torch.testing.assert_close(r1.logits, r2.logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="gap"):
        m.extend_context(st, aux[:2], start_pos=25)
    with pytest.raises(ValueError, match="window"):
        m.extend_context(st, aux[:2], start_pos=0)
    # re-write the last 4 positions with different features, then restore them
    m.extend_context(ref, torch.randn(4, 3 * D), start_pos=16)
    assert ref.length == 20
    m.extend_context(ref, aux[16:20], start_pos=16)
    torch.testing.assert_close(m.propose([ref], torch.tensor([4]), SamplingParams()).logits, r1.logits)


def test_dummy_blocks_no_nan_and_no_gradient_leak():
    m = randomize(DSparkDrafter(tiny_cfg()))
    T = 10
    ids = torch.randint(0, V, (1, T))
    aux = torch.randn(1, T, 3 * D, requires_grad=True)
    anchors, valid = sample_anchors(torch.zeros(1, T), 4)  # no candidates: all dummies
    assert not valid.any()
    h = m.forward_train(aux, ids, anchors, valid)
    assert torch.isfinite(h).all()
    h.sum().backward()
    assert aux.grad.abs().max() == 0  # dummies see no context


# ---------------------------------------------------------------------------------------------------------------
# anchors / labels
# ---------------------------------------------------------------------------------------------------------------
def test_anchor_sampling_edge_cases():
    lm = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1, 1]])
    cand = {2, 3, 6, 7, 8}
    gen = torch.Generator().manual_seed(0)
    a, v = sample_anchors(lm, 3, gen)
    assert a.shape == (1, 3) and v.all()
    assert set(a[0].tolist()) <= cand and a[0].tolist() == sorted(a[0].tolist())
    draws = {tuple(sample_anchors(lm, 3, gen)[0][0].tolist()) for _ in range(20)}
    assert len(draws) > 1  # redrawn per visit
    a, v = sample_anchors(lm, 8, gen)  # fewer candidates than anchors: dummies at the end
    assert v.sum() == 5 and set(a[0, :5].tolist()) == cand and not v[0, 5:].any() and (a[0, 5:] == 0).all()
    a, v = sample_anchors(lm, 20)  # more anchors than positions
    assert a.shape == (1, 20) and v.sum() == 5
    a, v = sample_anchors(torch.ones(2, 1), 2)  # a single token: no candidate
    assert not v.any()


def test_block_labels_prefix_supervision():
    ids = torch.arange(100, 112)[None]  # T = 12
    lm = torch.tensor([[0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1]])
    anchors = torch.tensor([[1, 3, 8, 10, 0]])
    valid = torch.tensor([[True, True, True, True, False]])
    b = block_labels(ids, lm, anchors, valid, 4)
    assert b.labels[0, 0].tolist() == [102, 103, 104, 105]
    assert b.prev[0, 0].tolist() == [101, 102, 103, 104]
    assert b.label_mask[0, 0].tolist() == [True, True, True, False]  # position 5 has loss_mask 0
    assert b.label_mask[0, 1].tolist() == [True, False, False, False]  # stops at 5, never resumes at 6
    assert b.label_mask[0, 2].tolist() == [True, True, True, False]  # end of sequence
    assert b.label_mask[0, 3].tolist() == [True, False, False, False]
    assert b.labels[0, 3].tolist() == [111, 0, 0, 0]
    assert not b.label_mask[0, 4].any()  # dummy


# ---------------------------------------------------------------------------------------------------------------
# draft vocabulary
# ---------------------------------------------------------------------------------------------------------------
def test_draft_vocab_coverage_size_and_d2t():
    ids = torch.tensor([5] * 50 + [7] * 30 + [9] * 15 + [11] * 4 + [13])
    counts = count_tokens([(ids, torch.ones_like(ids)), (torch.tensor([2, 5]), torch.tensor([1, 0]))], 20)
    assert counts[5] == 50 and counts[2] == 1
    dv = build_draft_vocab(counts, coverage=0.94, always_include=[1, 3])  # 95 of 101 occurrences
    assert dv.draft_ids.tolist() == [1, 3, 5, 7, 9]
    assert dv.coverage == pytest.approx(95 / 101)
    dv = build_draft_vocab(counts, coverage=0.99, always_include=[1])
    assert dv.draft_ids.tolist() == [1, 2, 5, 7, 9, 11]  # count ties (2 vs 13): lower id first
    dv = build_draft_vocab(counts, size=8, always_include=[19])
    assert dv.size == 8 and 19 in dv.draft_ids.tolist() and {5, 7, 9, 11, 13, 2} <= set(dv.draft_ids.tolist())
    assert torch.equal(draft_ids_from_d2t(d2t_from_draft_ids(dv.draft_ids)), dv.draft_ids)
    assert (dv.d2t >= 0).all()
    assert build_draft_vocab(counts, size=3, multiple_of=4).size == 4
    with pytest.raises(ValueError):
        build_draft_vocab(counts, size=1, always_include=[1, 2])
    assert "covering" in dv.report()


def test_packed_linear_follows_weight_updates_and_matches_nn_linear():
    """pipeline.ops.packed_linear.Linear: nn.Linear with autograd on; a oneDNN-packed copy under no_grad on CPU that is
    re-packed whenever the weight changes (optimizer steps, load_state_dict)."""
    from pipeline.ops import packed_linear

    if not packed_linear.available():
        pytest.skip("no oneDNN packed linear in this PyTorch build")
    torch.manual_seed(0)
    lin = packed_linear.Linear(24, 40)
    ref = torch.nn.Linear(24, 40)
    ref.load_state_dict(lin.state_dict())  # same parameter names and shapes as nn.Linear
    x = torch.randn(3, 12, 24)  # more rows than the small-M kernel takes (tests/test_small_m_linear.py): packed
    torch.testing.assert_close(lin(x), ref(x), rtol=0, atol=0)  # autograd on: exactly F.linear
    with torch.no_grad():
        y = lin(x)
        assert lin._packed is not None
        torch.testing.assert_close(y, ref(x), rtol=1e-5, atol=1e-5)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    lin(x).square().sum().backward()
    opt.step()  # the weight changes in place: the packed copy must follow
    ref.load_state_dict(lin.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(lin(x), ref(x), rtol=1e-5, atol=1e-5)
        lin.load_state_dict(torch.nn.Linear(24, 40).state_dict())
        ref.load_state_dict(lin.state_dict())
        torch.testing.assert_close(lin(x), ref(x), rtol=1e-5, atol=1e-5)
    # a fused optimizer updates in place without bumping the version counter: forget_packed drops the stale copy
    opt = torch.optim.AdamW(lin.parameters(), lr=0.5, fused=True)
    lin(x).square().sum().backward()
    opt.step()
    ref.load_state_dict(lin.state_dict())
    assert packed_linear.forget_packed(lin) == 1
    with torch.no_grad():
        torch.testing.assert_close(lin(x), ref(x), rtol=1e-5, atol=1e-5)



def test_packed_linear_bf16_only_with_native_bf16():
    """In bf16 the drafter's Linear packs its weight where the CPU has native bf16 (avx512_bf16 / AMX) and keeps
    F.linear where bf16 is emulated; both give F.linear's product to bf16 rounding."""
    from pipeline.ops import packed_linear
    from pipeline.core.runtime import cpu_has_native_bf16

    torch.manual_seed(0)
    lin = packed_linear.Linear(64, 96).to(torch.bfloat16)
    x = torch.randn(7, 64).to(torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
    with torch.no_grad():
        y = lin(x)
    assert y.dtype == torch.bfloat16
    assert (lin._packed is not None) == (cpu_has_native_bf16() and packed_linear._AVAILABLE)
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)

def test_init_layers_from_target_copies_the_last_layers(tmp_path):
    """--init-layers target: drafter layer j starts as target layer L-n+j (projections, MLP, both norms) and the final
    norm as the target's; q/k norms (absent in Llama) stay at 1; the same tensors from the module and from its saved
    HF folder; a drafter deeper than the target or of other widths is refused with the reason."""
    from pipeline.dspark.target_weights import TargetWeightsError, load_target_layers

    t = tiny_target()  # 4 layers
    with torch.no_grad():
        t.model.norm.weight.uniform_(0.5, 1.5)  # not all-ones, so the copy is visible
        for layer in t.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
    cfg = DrafterConfig.from_target_config(t.config, num_hidden_layers=2)
    t.save_pretrained(tmp_path / "target")
    for source in (t, tmp_path / "target"):
        m = DSparkDrafter.from_target(cfg, t)
        names = m.init_layers_from(load_target_layers(source, 2))
        assert "layers.0.self_attn.q_proj.weight" in names and "norm.weight" in names
        for j, i in ((0, 2), (1, 3)):
            src, dst = t.model.layers[i], m.layers[j]
            for a, b in ((src.self_attn.q_proj, dst.self_attn.q_proj), (src.self_attn.k_proj, dst.self_attn.k_proj),
                         (src.self_attn.v_proj, dst.self_attn.v_proj), (src.self_attn.o_proj, dst.self_attn.o_proj),
                         (src.mlp.gate_proj, dst.mlp.gate_proj), (src.mlp.up_proj, dst.mlp.up_proj),
                         (src.mlp.down_proj, dst.mlp.down_proj), (src.input_layernorm, dst.input_layernorm),
                         (src.post_attention_layernorm, dst.post_attention_layernorm)):
                assert torch.equal(a.weight, b.weight)
            assert torch.equal(dst.self_attn.q_norm.weight, torch.ones(16))
            assert torch.equal(dst.self_attn.k_norm.weight, torch.ones(16))
        assert torch.equal(m.norm.weight, t.model.norm.weight)
        assert torch.equal(m.embed_tokens.weight, t.model.embed_tokens.weight)  # the frozen part as before
    with pytest.raises(TargetWeightsError, match="5 drafter layer"):
        load_target_layers(t, 5)
    wide = DSparkDrafter(tiny_cfg(intermediate_size=96, num_hidden_layers=2))
    with pytest.raises(ValueError, match="mlp.gate_proj.weight"):
        wide.init_layers_from(load_target_layers(t, 2))
    with pytest.raises(ValueError, match="without a drafter counterpart"):
        wide.init_layers_from({"layers.7.self_attn.q_proj.weight": torch.zeros(64, 64)})
