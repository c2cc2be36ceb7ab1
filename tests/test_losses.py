"""Losses: chunked target distribution, exact L1 with a reduced vocabulary, fused softmax/L1/CE, weights, training."""
import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.dspark.anchors import make_blocks
from pipeline.dspark.drafter import DSparkDrafter
from pipeline.dspark.config import DrafterConfig
from pipeline.dspark.losses import (LossConfig, SoftmaxL1CE, TargetHead, drafter_loss, loss_from_logits, position_weights,
                             weight_sum)

torch.set_num_threads(1)

V, D, G = 256, 64, 4

from tiny_target import tiny_target  # noqa: E402


def draft_ids(n=200, seed=5):
    return torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:n].sort().values


def test_position_weights():
    w = position_weights(7, 4.0)
    torch.testing.assert_close(w, torch.tensor([1, .7788, .6065, .4724, .3679, .2865, .2231]), atol=1e-4, rtol=0)
    torch.testing.assert_close(position_weights(7, "gamma")[-1], torch.tensor(math.exp(-6 / 7)))
    mask = torch.tensor([[True, True, False, False, False, False, False]])
    assert float(weight_sum(mask, 4.0)) == pytest.approx(1 + math.exp(-0.25))


@pytest.mark.parametrize("nd", [200, V])
def test_chunked_target_probs_equal_unchunked(nd):
    torch.manual_seed(0)
    W = torch.randn(V, D) * 0.5
    ids = draft_ids(nd)
    h = torch.randn(13, D)
    full = torch.softmax(h @ W.T, -1)  # [N, V] reference, target-id order
    for chunk in (7, 64, 10_000):
        th = TargetHead(W, ids, vocab_chunk=chunk)
        pt, mo = th.draft_probs(h)
        torch.testing.assert_close(pt, full[:, ids], atol=1e-6, rtol=1e-5)
        outside = torch.ones(V, dtype=torch.bool)
        outside[ids] = False
        torch.testing.assert_close(mo, full[:, outside].sum(-1), atol=1e-6, rtol=1e-4)
        lse, mo2 = th.stats(h)
        pt2, mo3 = th.draft_probs(h, (lse, mo2))
        torch.testing.assert_close(pt2, pt, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(mo3, mo, atol=1e-7, rtol=1e-5)
        torch.testing.assert_close(th.full_probs(h).sum(-1), torch.ones(13))


def test_cached_lse_alone_reproduces_the_target_distribution():
    """A store keeps only the full-vocabulary lse per token; p_t on V_d and the mass outside follow from it."""
    from pipeline.ops.layers import full_vocab_lse

    torch.manual_seed(0)
    W = torch.randn(V, 16)
    h = (torch.randn(30, 16) * 2).to(torch.bfloat16)
    th = TargetHead(W, draft_ids(), vocab_chunk=64)
    lse = full_vocab_lse(h, W, chunk=100, rows=7)
    assert torch.allclose(lse, torch.logsumexp(h.float() @ W.T, -1), atol=1e-5)
    pt, mo = th.draft_probs(h.float())
    pt2, mo2 = th.draft_probs(h.float(), (lse, None))
    assert torch.allclose(pt, pt2, atol=1e-6) and torch.allclose(mo, mo2, atol=1e-5)


def test_fused_softmax_l1_ce_matches_autograd_and_counts_outside_mass():
    torch.manual_seed(0)
    N, Vd = 9, 200
    ids = draft_ids(Vd)
    pt_full = torch.softmax(torch.randn(N, V, dtype=torch.float64) * 2, -1)
    pt, mo = pt_full[:, ids], pt_full.sum(-1) - pt_full[:, ids].sum(-1)
    g = torch.randn(N, Vd, dtype=torch.float64, requires_grad=True)
    label = torch.randint(0, Vd, (N,))
    label[2] = -1  # outside the draft vocab: skipped by CE
    l1, ce = SoftmaxL1CE.apply(g, pt, mo, label)
    # reference: p_d padded with zeros to the full vocabulary
    g2 = g.detach().clone().requires_grad_(True)
    pd_full = torch.zeros(N, V, dtype=torch.float64)
    pd_full = pd_full.index_copy(1, ids, torch.softmax(g2, -1))
    l1_ref = (pd_full - pt_full).abs().sum(-1)
    ce_ref = F.cross_entropy(g2, label.clamp_min(0), reduction="none") * (label >= 0)
    torch.testing.assert_close(l1, l1_ref)
    torch.testing.assert_close(ce, ce_ref)
    a, b = torch.randn(N, dtype=torch.float64), torch.randn(N, dtype=torch.float64)
    (a * l1 + b * ce).sum().backward()
    (a * l1_ref + b * ce_ref).sum().backward()
    torch.testing.assert_close(g.grad, g2.grad)
    assert ce[2] == 0


def test_loss_terms_weights_and_global_denominator():
    torch.manual_seed(0)
    N, Vd = 6, 50
    logits = torch.randn(N, Vd, requires_grad=True)
    conf = torch.randn(N, requires_grad=True)
    pt = torch.softmax(torch.randn(N, Vd), -1) * 0.9
    mo = torch.full((N,), 0.1)
    label = torch.randint(0, Vd, (N,))
    slot = torch.tensor([0, 1, 2, 0, 1, 0])
    w = position_weights(G, 4.0)[slot]
    out = loss_from_logits(logits, conf, label, slot, G, LossConfig(), pt, mo)
    pd = torch.softmax(logits, -1)
    l1 = (pd - pt).abs().sum(-1) + mo
    ce = F.cross_entropy(logits, label, reduction="none")
    c_star = (1 - l1 / 2).clamp(0, 1).detach()
    bce = F.binary_cross_entropy_with_logits(conf, c_star, reduction="none")
    ref = ((0.1 * ce + 0.9 * l1 + bce) * w).sum() / w.sum()
    torch.testing.assert_close(out.loss, ref)
    assert out.weight_sum == pytest.approx(float(w.sum()))
    out2 = loss_from_logits(logits, conf, label, slot, G, LossConfig(), pt, mo, denom=2 * w.sum())
    torch.testing.assert_close(out2.loss, ref / 2)
    tv = loss_from_logits(logits, conf, label, slot, G, LossConfig(distance="tv"), pt, mo)
    torch.testing.assert_close(tv.parts["dist"], out.parts["dist"] / 2)
    dfl = loss_from_logits(logits, None, label, slot, G, LossConfig(kind="dflash"))
    torch.testing.assert_close(dfl.loss, (ce * w).sum() / w.sum())
    assert set(dfl.parts) == {"ce"}


def _dataset(target, n=4, T=40, seed=0):
    """Target-generated sequences with the target's own features (aux ids 1,2,3; last = after the final norm)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, V, (n, 8), generator=g)
    with torch.no_grad():
        seq = target.generate(prompts, max_new_tokens=T - 8, do_sample=False, pad_token_id=0)
        out = target(seq, output_hidden_states=True)
    hs = out.hidden_states
    aux = torch.cat([hs[1], hs[2], hs[3]], -1)
    lm = torch.zeros_like(seq)
    lm[:, 8:] = 1
    return seq, lm, aux, hs[-1]


@pytest.mark.parametrize("kind,nd", [("dspark", 200), ("dflash", V)])
def test_training_reduces_loss(kind, nd):
    target = tiny_target()
    seq, lm, aux, last = _dataset(target)
    ids = draft_ids(nd) if nd < V else None
    if ids is not None:  # make sure the generated tokens are (mostly) in the draft vocab
        counts = torch.bincount(seq[lm.bool()], minlength=V)
        ids = torch.sort(torch.argsort(-counts, stable=True)[:nd]).values
    extra = dict(markov_rank=16) if kind == "dspark" else {}
    cfg = DrafterConfig.from_target_config(target.config, num_hidden_layers=1, block_size=G, draft_vocab_size=nd,
                                           kind=kind, aux_layer_ids=[1, 2, 3], **extra)
    m = DSparkDrafter.from_target(cfg, target, draft_ids=ids)
    th = TargetHead(target.lm_head.weight, m.draft_ids, vocab_chunk=100)
    lcfg = LossConfig(kind=kind)
    opt = torch.optim.AdamW(m.trainable_parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    losses, ces = [], []
    for step in range(40):
        blocks = make_blocks(seq, lm, 16, G, gen)
        out = drafter_loss(m, th if kind == "dspark" else None, aux, seq, last if kind == "dspark" else None,
                           blocks, lcfg)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
        ces.append(float(out.parts["ce"]))
        assert math.isfinite(losses[-1]) and out.num_supervised > 0
    assert sum(losses[-5:]) / 5 < 0.85 * losses[0], losses
    assert sum(ces[-5:]) / 5 < 0.85 * ces[0], ces
    if kind == "dspark":
        assert set(out.parts) == {"ce", "dist", "conf"}


def test_drafter_loss_uses_each_position_once_and_matches_direct_computation():
    target = tiny_target()
    seq, lm, aux, last = _dataset(target, n=2, T=24)
    cfg = DrafterConfig.from_target_config(target.config, num_hidden_layers=1, block_size=G, markov_rank=16,
                                           draft_vocab_size=200, aux_layer_ids=[1, 2, 3])
    m = DSparkDrafter.from_target(cfg, target, draft_ids=draft_ids())
    th = TargetHead(target.lm_head.weight, m.draft_ids, vocab_chunk=50)
    blocks = make_blocks(seq, lm, 8, G, torch.Generator().manual_seed(1))
    out = drafter_loss(m, th, aux, seq, last, blocks, LossConfig())
    # direct: full-vocab p_t at p+k-1 for every supervised slot, p_d padded with zeros
    rows = blocks.label_mask
    h = m.forward_train(aux, seq, blocks.anchors, blocks.valid)
    bo = m.block_logits(h, blocks.prev, rows)
    pos = (blocks.anchors[:, :, None] + torch.arange(G))[rows]
    b = torch.arange(2)[:, None, None].expand_as(rows)[rows]
    pt_full = torch.softmax(last[b, pos] @ target.lm_head.weight.T, -1)
    pd_full = torch.zeros_like(pt_full).index_copy(1, m.draft_ids, torch.softmax(bo.logits, -1))
    l1 = (pd_full - pt_full).abs().sum(-1)
    slot = torch.arange(G).expand_as(rows)[rows]
    w = position_weights(G)[slot]
    torch.testing.assert_close(out.parts["dist"], (w * l1).sum() / w.sum(), atol=1e-5, rtol=1e-5)
    # the store's cached full-vocabulary lse (no full-vocabulary pass in training) gives the same loss
    from pipeline.ops.layers import full_vocab_lse

    lse = torch.stack([full_vocab_lse(last[i], target.lm_head.weight) for i in range(2)])
    cached = drafter_loss(m, th, aux, seq, last, blocks, LossConfig(), target_stats=(lse, None))
    torch.testing.assert_close(cached.loss, out.loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_micro_batched_step_equals_per_sequence_loop(kind):
    """pipeline.train.step.accumulate_gradients: right-padded micro-batches of sequences of DIFFERENT lengths give the
    same loss parts and gradients as one sequence at a time (padding is never read)."""
    from pipeline.ops.layers import full_vocab_lse
    from pipeline.train.step import accumulate_gradients

    target = tiny_target()
    samples = []
    for i, T in enumerate([40, 23, 31, 12]):
        seq, lm, aux, last = _dataset(target, n=1, T=T, seed=i)
        s = dict(input_ids=seq[0].int(), loss_mask=lm[0].to(torch.uint8), aux_hidden=aux[0], last_hidden=last[0])
        if i != 1:  # one sample without the cached lse: the micro-batch holding it falls back to the LM head
            s["target_lse"] = full_vocab_lse(last[0], target.lm_head.weight)
        samples.append(s)
    extra = dict(markov_rank=16) if kind == "dspark" else {}
    cfg = DrafterConfig.from_target_config(target.config, num_hidden_layers=1, block_size=G, draft_vocab_size=200,
                                           kind=kind, aux_layer_ids=[1, 2, 3], **extra)
    m = DSparkDrafter.from_target(cfg, target, draft_ids=draft_ids())
    th = TargetHead(target.lm_head.weight, m.draft_ids, vocab_chunk=50) if kind == "dspark" else None
    lcfg = LossConfig(kind=kind)
    gen = torch.Generator().manual_seed(3)
    blocks = [make_blocks(s["input_ids"].long(), s["loss_mask"], 6, G, gen) for s in samples]
    denom = sum(float(weight_sum(b.label_mask, lcfg.decay)) for b in blocks)
    by_noise = {}
    for noise in (0.0, 0.3):  # --feature-noise: per-sequence noise, so micro-batching still does not matter
        results = []
        for mb in (1, 3, 4):
            m.zero_grad(set_to_none=True)
            parts, n_sup, _ = accumulate_gradients(m, th, samples, blocks, lcfg, denom, micro_batch=mb,
                                                   feature_noise=noise, noise_seed=11)
            grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
            results.append((parts, n_sup, grads))
        (p1, n1, g1) = results[0]
        assert n1 == sum(b.num_supervised for b in blocks) > 0
        for parts, n, g in results[1:]:
            assert n == n1 and set(parts) == set(p1)
            for k in p1:
                assert parts[k] == pytest.approx(p1[k], rel=1e-5, abs=1e-6)
            assert set(g) == set(g1)
            for name in g1:
                torch.testing.assert_close(g[name], g1[name], atol=2e-6, rtol=1e-4)
        by_noise[noise] = g1
    fc0, fc1 = by_noise[0.0]["fc.weight"], by_noise[0.3]["fc.weight"]  # the noise reached the gradient
    assert (fc1 - fc0).norm() > 0.05 * fc0.norm()


def test_feature_noise_scales_with_each_layer_rms():
    """noisy_features: noise std = rel_std x the per-token RMS of each injected layer's slice (layers differ in
    scale), reproducible from the generator, input left untouched."""
    from pipeline.train.step import noisy_features

    d, T = 64, 4000
    scales = torch.tensor([0.5, 3.0, 20.0])  # three injected layers of very different magnitude
    aux = (torch.randn(T, 3, d) * scales[:, None]).view(T, 3 * d)
    before = aux.clone()
    out = noisy_features(aux, d, 0.1, torch.Generator().manual_seed(0))
    assert torch.equal(aux, before) and out.shape == aux.shape
    noise = (out - aux).view(T, 3, d)
    rms = aux.view(T, 3, d).pow(2).mean(-1, keepdim=True).sqrt()
    ratio = (noise / rms).std(dim=(0, 2))  # per layer
    torch.testing.assert_close(ratio, torch.full((3,), 0.1), atol=3e-3, rtol=0)
    again = noisy_features(aux, d, 0.1, torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
