"""TargetRunner: parity with transformers, ragged batched verification == per-request, rollback, layer ids."""
from __future__ import annotations

import pytest
import torch

from pipeline.ops import packed_linear, small_m_linear
from pipeline.ops.hugepages import HUGE_PAGE, arena_copy, huge_page_fraction, thp_mode
from pipeline.engine.target_runner import TargetRunner
from toy_drafter import one_thread


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_thread()

CFG = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=256)


def _model(kind, dtype=torch.float32):
    import transformers as tf

    torch.manual_seed({"llama": 0, "qwen2": 1, "qwen3": 2, "mistral": 3}[kind])
    if kind == "llama":
        m = tf.LlamaForCausalLM(tf.LlamaConfig(**CFG))
    elif kind == "qwen2":
        m = tf.Qwen2ForCausalLM(tf.Qwen2Config(**CFG))
    elif kind == "qwen3":
        m = tf.Qwen3ForCausalLM(tf.Qwen3Config(**CFG, head_dim=24))
    else:
        m = tf.MistralForCausalLM(tf.MistralConfig(**CFG, sliding_window=6))
    return m.to(dtype).eval()


@pytest.mark.parametrize("backend", ["mkl", "packed", "hybrid", "tuned", "smallm"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_parity_with_transformers_fp32(kind, backend):
    """Every linear back end (MKL F.linear, oneDNN pre-packed weights, F.linear for <= 2 rows and packed above,
    per-shape thresholds timed at build, the small-M kernel) matches transformers; qwen2 covers biases."""
    packed = backend != "mkl"
    if packed and not packed_linear.available():
        pytest.skip("this PyTorch build has no oneDNN packed linear")
    if backend == "smallm" and not small_m_linear.available():
        pytest.skip(f"no small-M kernel here: {small_m_linear.unavailable_reason()}")
    m = _model(kind)
    L = CFG["num_hidden_layers"]
    ids = torch.randint(0, CFG["vocab_size"], (1, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(ids, output_hidden_states=True)
    # the raw output of the last decoder layer (before the final norm) for id L
    last = {}
    h = m.model.layers[-1].register_forward_hook(lambda mod, i, o: last.setdefault("x", o[0] if isinstance(o, tuple)
                                                                                       else o))
    with torch.no_grad():
        m(ids)
    h.remove()
    r = TargetRunner(m, f"float32:{backend}", device="cpu", init_slots=1, init_len=4)  # forces cache growth
    assert r.linear_backend == backend and r.packed_linear == packed and (r.lm_head.packed is not None) == packed
    if backend == "tuned":  # every weight of a group got the group's timed threshold; plain copy kept iff used
        assert set(r.flinear_rows) == {"qkv", "o", "gate_up", "down", "lm_head"}
        for name, ws in r.linear_groups().items():
            assert r.flinear_rows[name] in (0, 1, 2, 4, 8, 16)
            for w in ws:
                assert w.flinear_max_rows == r.flinear_rows[name] and (w.weight is not None) == (w.flinear_max_rows > 0)
    elif backend == "smallm":  # every weight whose input width is a multiple of 8 runs <= MAX_ROWS rows in the kernel
        for w in r.linear_weights():
            assert w.kernel_max_rows == (small_m_linear.MAX_ROWS if w.weight.shape[1] % 8 == 0 else 0)
        assert any(w.kernel_max_rows for w in r.linear_weights())
    else:
        assert (r.lm_head.weight is not None) == (backend != "packed")  # hybrid keeps both copies
    s = r.alloc()
    a = r.forward([s], [ids[0, :11]], aux_layer_ids=list(range(L + 1)))  # prefill
    b = r.forward([s], [ids[0, 11:17]], aux_layer_ids=list(range(L + 1)))  # then 6 more tokens on the cache
    c = r.forward([s], [ids[0, 17:18]], aux_layer_ids=list(range(L + 1)))  # 1 token (hybrid: F.linear)
    d = r.forward([s], [ids[0, 18:]], aux_layer_ids=list(range(L + 1)))
    logits = torch.cat([a.logits, b.logits, c.logits, d.logits])
    assert torch.allclose(logits, ref.logits[0], atol=2e-5, rtol=1e-4)
    aux = torch.cat([a.aux_hidden, b.aux_hidden, c.aux_hidden, d.aux_hidden]).view(19, L + 1, CFG["hidden_size"])
    for k in range(L):  # ids 0..L-1 == transformers hidden_states[k]
        assert torch.allclose(aux[:, k], ref.hidden_states[k][0], atol=2e-5), k
    assert torch.allclose(aux[:, L], last["x"].reshape(19, -1), atol=2e-5)  # id L: before the final norm
    assert not torch.allclose(aux[:, L], ref.hidden_states[L][0], atol=1e-3)  # (transformers' last is normed)
    assert r.length(s) == 19


def test_parity_bf16():
    m = _model("qwen3", torch.bfloat16)
    ids = torch.randint(0, CFG["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m(ids).logits[0].float()
    r = TargetRunner(m, "bfloat16", device="cpu")
    s = r.alloc()
    out = r.forward([s], [ids[0, :5]])
    out2 = r.forward([s], [ids[0, 5:]])
    got = torch.cat([out.logits, out2.logits])
    assert got.dtype == torch.float32  # fp32 logits even with a bf16 body
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("layout", ["padded", "per_request"])
def test_bf16_runner_attention_dtype(layout):
    """A bf16 runner attends over an fp32 KV cache (the bf16-rounded keys and values, wider arithmetic) or a bf16 one:
    both agree with transformers' bf16 forward, in a ragged batch of three requests too; an fp32 runner's cache is
    fp32 and the automatic choice for bf16 is one of the two."""
    from pipeline.engine.target_runner import fp32_attention_wins

    m = _model("llama", torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, CFG["vocab_size"], (n,), generator=g) for n in (9, 13, 6)]
    with torch.no_grad():
        refs = [m(s[None]).logits[0].float() for s in seqs]
    auto = TargetRunner(m, "bfloat16", device="cpu")
    assert auto.cache_dtype == (torch.float32 if fp32_attention_wins(CFG["num_attention_heads"],
                                                                     CFG["num_key_value_heads"], auto.config.head_dim)
                                else torch.bfloat16)
    assert TargetRunner(_model("llama"), "float32", device="cpu").cache_dtype == torch.float32
    for adt in (torch.float32, torch.bfloat16):
        r = TargetRunner(m, "bfloat16", device="cpu", attention_dtype=adt)
        if layout == "per_request":
            r.max_padded_scores = 0
        assert r.k_cache.dtype == adt
        slots = [r.alloc() for _ in seqs]
        first = r.forward(slots, [s[:4] for s in seqs], logits_last=[4, 4, 4])  # prefill 4 tokens each
        rest = r.forward(slots, [s[4:] for s in seqs], logits_last=[len(s) - 4 for s in seqs])  # ragged: 5 / 9 / 2
        for i, ref in enumerate(refs):
            got = torch.cat([first.logits_of(i), rest.logits_of(i)])
            assert (got - ref).abs().max() < 0.05 * ref.abs().max(), (adt, i)
            assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8, (adt, i)  # bf16 near-ties


def test_bf16_packed_weights():
    """"bfloat16:packed" packs the bf16 layer weights for oneDNN on a CPU with native bf16 (same products as F.linear
    up to the summation order: the logits agree with the F.linear runner's) and is refused by name without it."""
    from pipeline.core.runtime import cpu_has_native_bf16

    if not packed_linear.available():
        pytest.skip("this PyTorch build has no oneDNN packed linear")
    m = _model("llama", torch.bfloat16)
    if not cpu_has_native_bf16():
        with pytest.raises(ValueError, match="bfloat16:packed needs a CPU with native bf16"):
            TargetRunner(m, "bfloat16:packed", device="cpu")
        return
    ids = torch.randint(0, CFG["vocab_size"], (14,), generator=torch.Generator().manual_seed(3))
    logits = {}
    for spec in ("bfloat16", "bfloat16:packed"):
        r = TargetRunner(m, spec, device="cpu")
        assert all((w.packed is not None) == (spec == "bfloat16:packed") for ly in r.layers for w in (ly.qkv, ly.down))
        assert r.lm_head.packed is not None  # the fp32 LM head is packed either way
        s = r.alloc()
        logits[spec] = torch.cat([r.forward([s], [ids[:6]]).logits, r.forward([s], [ids[6:]]).logits])
    assert TargetRunner(m, "bfloat16:packed", device="cpu", fp32_lm_head=False).lm_head.packed is not None  # bf16 head
    a, b = logits["bfloat16"], logits["bfloat16:packed"]
    assert (a - b).abs().max() < 0.02 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("layout", ["padded", "per_request", "mixed"])
def test_ragged_batch_equals_per_request(kind, layout):
    """Three requests with different cache lengths and different numbers of new tokens in ONE forward (slots not
    contiguous, batch order permuted) == each request alone.  All three attention layouts (padded with an exact
    mask / one attention call per request / the long rows per request and the short ones padded together, as when a
    prompt is prefilled beside decode rounds) are exercised; mistral adds a sliding window shorter than the
    contexts."""
    m = _model(kind)
    g = torch.Generator().manual_seed(2)
    V = CFG["vocab_size"]
    ctx = [torch.randint(0, V, (n,), generator=g) for n in (7, 15, 3)]
    new = [torch.randint(0, V, (n,), generator=g) for n in (4, 1, 8)]
    ids = [0, 1, 2]

    solo = TargetRunner(m, "float32", device="cpu")
    ref = []
    for c, n in zip(ctx, new):
        s = solo.alloc()
        solo.forward([s], [c], logits_last=0)
        ref.append(solo.forward([s], [n], aux_layer_ids=[0, 2, 3]))

    bat = TargetRunner(m, "float32", device="cpu", init_slots=2, init_len=8)
    bat.max_padded_scores = 0 if layout == "per_request" else 1 << 20
    # mixed: rows of more than 4 new tokens attend alone (prefill 7 / 15 of 7, 15, 3; then 8 of 4, 1, 8)
    bat.short_block = 4 if layout == "mixed" else 1 << 30
    junk = bat.alloc()  # make slots non-contiguous
    slots = [bat.alloc() for _ in ids]
    bat.free(junk)
    out0 = bat.forward(slots, ctx, logits_last=[1, 2, 0])  # ragged prefill of all three
    assert out0.logit_offsets == [0, 1, 3, 3]
    order = [2, 0, 1]
    out = bat.forward([slots[i] for i in order], [new[i] for i in order], aux_layer_ids=[0, 2, 3])
    for j, i in enumerate(order):
        assert torch.allclose(out.logits_of(j), ref[i].logits, atol=1e-5, rtol=1e-5)
        assert torch.allclose(out.aux_of(j), ref[i].aux_hidden, atol=1e-5, rtol=1e-5)
        assert bat.length(slots[i]) == len(ctx[i]) + len(new[i])
    # logits_last selects trailing rows only
    s = bat.alloc()
    o = bat.forward([s], [torch.cat([ctx[0], new[0]])], logits_last=2)
    assert torch.allclose(o.logits, ref[0].logits[-2:], atol=1e-5)


def test_rollback_then_continue_equals_fresh():
    m = _model("qwen3")
    g = torch.Generator().manual_seed(3)
    V = CFG["vocab_size"]
    ctx, bad, good = (torch.randint(0, V, (n,), generator=g) for n in (9, 6, 5))
    r = TargetRunner(m, "float32", device="cpu")
    s = r.alloc()
    r.forward([s], [ctx], logits_last=0)
    r.forward([s], [bad])  # a rejected block
    r.truncate(s, 9 + 2)  # keep the first two tokens of it
    out = r.forward([s], [good])
    fresh = TargetRunner(m, "float32", device="cpu")
    f = fresh.alloc()
    ref = fresh.forward([f], [torch.cat([ctx, bad[:2], good])], logits_last=5)
    assert torch.allclose(out.logits, ref.logits, atol=1e-5)
    with pytest.raises(ValueError):
        r.truncate(s, 100)


def test_slots_reuse_and_limits():
    m = _model("llama")
    r = TargetRunner(m, "float32", device="cpu", max_seq_len=16, init_slots=1, init_len=4)
    a, b = r.alloc(), r.alloc()
    assert a != b
    r.forward([a, b], [[1, 2, 3], [4]])
    r.free(a)
    c = r.alloc()
    assert r.length(c) == 0
    # the lowest free slot comes first, so the slots in use stay packed (one K/V view for a batch in slot order)
    d, e = r.alloc(), r.alloc()
    r.free(min(c, b, d))
    r.free(e)
    assert r.alloc() == min(c, b, d) and r.alloc() == min(e, *(set(range(4)) - {b, c, d}))
    with pytest.raises(ValueError):
        r.forward([b], [list(range(16))])  # 1 + 16 > max_seq_len
    with pytest.raises(ValueError):
        r.forward([b, b], [[1], [2]])


def test_from_pretrained_folder(tmp_path):
    m = _model("llama")
    m.save_pretrained(tmp_path)
    r = TargetRunner.from_pretrained(tmp_path, "float32", device="cpu")
    s = r.alloc()
    ids = torch.arange(10)
    with torch.no_grad():
        ref = m(ids[None]).logits[0]
    assert torch.allclose(r.forward([s], [ids]).logits, ref, atol=2e-5)


def test_several_from_pretrained_reads_each_storage_dtype_once(tmp_path, monkeypatch):
    import transformers as tf

    m = _model("llama")
    m.save_pretrained(tmp_path)
    loads = []
    real = tf.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(tf.AutoModelForCausalLM, "from_pretrained",
                        lambda path, **kw: loads.append(kw["dtype"]) or real(path, **kw))
    rs = TargetRunner.several_from_pretrained(tmp_path, ["float32", "float32:mkl", "bfloat16"], device="cpu")
    assert sorted(map(str, loads)) == ["torch.bfloat16", "torch.float32"]  # float32 and float32:mkl: one load
    assert list(rs) == ["float32", "float32:mkl", "bfloat16"] and rs["float32:mkl"].linear_backend == "mkl"
    ids = torch.arange(10)
    with torch.no_grad():
        ref = m(ids[None]).logits[0]
    for dt, r in rs.items():
        s = r.alloc()
        out = r.forward([s], [ids]).logits
        assert r.source == str(tmp_path)
        assert torch.allclose(out.float(), ref, atol=2e-5 if dt.startswith("float32") else 0.3), dt


def test_huge_page_arena():
    """arena_copy: same values and shapes, 2 MiB-aligned, one block; a runner built with it computes the same."""
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(1024, 1027, generator=g), torch.randn(3, 5, generator=g), torch.randn(2048, 1024, generator=g)]
    cs = arena_copy(ts)
    assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(ts, cs))
    assert cs[0].data_ptr() % HUGE_PAGE == 0 and all(c.data_ptr() % 64 == 0 for c in cs)
    assert cs[0].untyped_storage().data_ptr() == cs[2].untyped_storage().data_ptr()  # one block
    with pytest.raises(ValueError, match="one dtype"):
        arena_copy([ts[0], ts[1].double()])
    # whether the kernel backs the advised block with huge pages depends on its free memory at the time (a CI run
    # next to a training job got none), so only the reading is checked: a share, or None without /proc
    frac = huge_page_fraction(cs)
    assert frac is None or 0.0 <= frac <= 1.0
    assert huge_page_fraction([]) is None and thp_mode() in (None, "always", "madvise", "never")
    m = _model("llama")
    ids = torch.randint(0, CFG["vocab_size"], (1, 9), generator=g)
    outs = []
    for arena in (False, True):
        r = TargetRunner(m, "float32:hybrid", device="cpu", huge_page_arena=arena)
        s = r.alloc()
        outs.append(torch.cat([r.forward([s], [ids[0, :8]]).logits, r.forward([s], [ids[0, 8:]]).logits]))
    assert torch.equal(outs[0], outs[1])
