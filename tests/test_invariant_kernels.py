"""The batch-invariant CPU kernels (AVX-512): the bf16-weight linear (pipeline/ops/bf16_linear.py), the paged
attention (pipeline/ops/paged_attention.py) and the fused layer operations (pipeline/ops/layer_ops.py).

Invariance is bitwise: an M-row product equals M 1-row products, for every M across the kernel's tile remainders,
on 1 and on 2 threads; a query row attends identically whatever other rows share the call.  Accuracy: both agree
with a float64 / SDPA reference to float rounding.  Where the CPU lacks AVX-512 the kernels are refused by name and
these tests skip with the reason."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.ops import bf16_linear, layer_ops, paged_attention as pa
from pipeline.ops.layers import apply_rope, rms_norm

needs_linear = pytest.mark.skipif(not bf16_linear.available(),
                                  reason=f"no bf16-weight kernel here: {bf16_linear.unavailable_reason()}")
needs_layer_ops = pytest.mark.skipif(not layer_ops.available(),
                                     reason=f"no fused layer operations here: {layer_ops.unavailable_reason()}")
needs_attention = pytest.mark.skipif(not pa.available(),
                                     reason=f"no paged attention kernel here: {pa.unavailable_reason()}")


def _kernels():
    """(name, function, needs K % this, reference input rounding) of each bf16-weight kernel this CPU runs."""
    out = []
    if bf16_linear.available():
        out.append(("fp32", bf16_linear.EXT.module.bf16_linear, 16, lambda x: x))
    if bf16_linear.DOT.available():
        out.append(("bf16", bf16_linear.DOT.module.bf16_dot_linear, 32, lambda x: x.bfloat16().float()))
    return out


@needs_linear
@pytest.mark.parametrize("K,N", [(32, 1), (64, 5), (576, 960), (576, 257), (1536, 576)])
def test_bf16_linear_rows_are_batch_invariant(K, N):
    g = torch.Generator().manual_seed(K + N)
    w = torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g)
    x = torch.randn(40, K, generator=g)
    threads = torch.get_num_threads()
    try:
        for name, fn, multiple, rounded in _kernels():
            results = {}
            for t in (1, 2):
                torch.set_num_threads(t)
                y = fn(x, w, b)
                ref = F.linear(rounded(x).double(), w.double(), b.double()).float()
                assert torch.allclose(y, ref, atol=1e-3, rtol=1e-4), (name, (y - ref).abs().max())
                for M in range(1, 41):  # every tile remainder (tiles of 8, 7, ..., 1 rows)
                    assert torch.equal(fn(x[:M].contiguous(), w, b), y[:M]), (name, M)
                singles = torch.stack([fn(x[i:i + 1].contiguous(), w, b)[0] for i in range(40)])
                assert torch.equal(singles, y), name
                results[t] = y
            assert torch.equal(results[1], results[2]), name  # each output is one thread's: the split changes nothing
        # the layer picks one kernel per weight, for every row count
        lin = bf16_linear.InvariantLinear(w, b)
        assert torch.equal(lin(x[:3]), torch.cat([lin(x[i:i + 1]) for i in range(3)]))
        assert torch.equal(lin(x), bf16_linear.kernel(K)(x, w, b))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not bf16_linear.DOT.available(), reason=f"no native bf16 dot-product kernel here: "
                                                            f"{bf16_linear.DOT.unavailable_reason()}")
def test_native_bf16_kernel_takes_widths_of_32():
    """Widths that are multiples of 32 go through the native dot products, the others through the fp32 kernel."""
    assert bf16_linear.arithmetic(576) == "bf16" and bf16_linear.arithmetic(48) == "fp32"
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(8, 48, generator=g).bfloat16(), torch.randn(3, 48, generator=g)
    ref = F.linear(x.double(), w.double()).float()
    assert torch.allclose(bf16_linear.linear(x, w), ref, atol=1e-4, rtol=1e-5)  # fp32 inputs, not rounded
    with pytest.raises(RuntimeError, match="multiple of 32"):
        bf16_linear.DOT.module.bf16_dot_linear(torch.randn(2, 48), w, None)


@needs_linear
def test_bf16_linear_refuses_what_it_cannot_compute():
    assert not bf16_linear.usable(torch.randn(8, 24).bfloat16())  # K not a multiple of 16
    assert not bf16_linear.usable(torch.randn(8, 32))  # fp32 weights
    with pytest.raises(ValueError, match="multiple of 16"):
        bf16_linear.InvariantLinear(torch.randn(8, 24), None)
    with pytest.raises(RuntimeError, match="bf16"):
        bf16_linear.EXT.module.bf16_linear(torch.randn(2, 16), torch.randn(4, 16), None)


@needs_linear
def test_a_trained_linear_can_infer_on_the_bf16_kernel():
    """use_bf16_kernel (the drafter beside a bfloat16:invariant target): no-grad fp32 inference through the kernel on
    a bf16 copy of the weight, refreshed when the weight changes; autograd (training) keeps F.linear on fp32."""
    from pipeline.ops.packed_linear import Linear, use_bf16_kernel

    torch.manual_seed(0)
    net = torch.nn.Sequential(Linear(64, 96), Linear(96, 24, bias=False), Linear(24, 8))
    assert use_bf16_kernel(net) == 2  # 24 input features: not a multiple of 16, stays as it was
    assert [m.bf16_kernel for m in net] == [True, True, False]
    x = torch.randn(5, 64)
    with torch.no_grad():
        w16 = net[0].weight.bfloat16()
        assert torch.equal(net[0](x), bf16_linear.linear(x, w16, net[0].bias))
        net[0].weight.mul_(2)  # an optimizer step bumps the version: the bf16 copy follows
        assert torch.equal(net[0](x), bf16_linear.linear(x, net[0].weight.bfloat16(), net[0].bias))
    y = net[0](x)  # autograd on: the fp32 weights, F.linear
    assert y.requires_grad and torch.equal(y, F.linear(x, net[0].weight, net[0].bias))
    assert use_bf16_kernel(net) == 0  # already switched


def _paged_case(H, KVH, hd, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-n // pa.BLOCK) for n in lens) + 3
    kb = torch.randn(nb, KVH, hd, pa.BLOCK, generator=g)
    vb = torch.randn(nb, KVH, pa.BLOCK, hd, generator=g)
    perm = torch.randperm(nb, generator=g).tolist()  # blocks scattered over the pool
    tables = torch.zeros(len(lens), max(-(-n // pa.BLOCK) for n in lens), dtype=torch.int32)
    o = 0
    for r, n in enumerate(lens):
        for j in range(-(-n // pa.BLOCK)):
            tables[r, j] = perm[o]
            o += 1
    rows = [(r, p) for r, n in enumerate(lens) for p in range(max(0, n - 9), n)]
    q = torch.randn(len(rows), H, hd, generator=g)
    return q, kb, vb, tables, torch.tensor([r for r, _ in rows]), torch.tensor([p for _, p in rows])


@needs_attention
@pytest.mark.parametrize("H,KVH,hd", [(9, 3, 64), (8, 8, 64), (16, 2, 128)])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_sdpa_and_is_batch_invariant(H, KVH, hd, window, cache_dtype):
    q, kb, vb, tables, rr, rp = _paged_case(H, KVH, hd, [37, 100, 5, 300, 16])
    kb, vb = kb.to(cache_dtype), vb.to(cache_dtype)  # bf16: the reference widens the same bf16 values
    out = pa.paged_attention(q, kb, vb, tables, rr, rp, hd ** -0.5, window)
    ref = pa.reference(q, kb, vb, tables, rr, rp, hd ** -0.5, window)
    assert torch.allclose(out, ref, atol=3e-5), (out - ref).abs().max()
    for i in range(q.shape[0]):  # each row alone, and in a reversed batch: the same bits
        one = pa.paged_attention(q[i:i + 1], kb, vb, tables, rr[i:i + 1], rp[i:i + 1], hd ** -0.5, window)
        assert torch.equal(one[0], out[i])
    rev = pa.paged_attention(q.flip(0), kb, vb, tables, rr.flip(0), rp.flip(0), hd ** -0.5, window)
    assert torch.equal(rev.flip(0), out)


@needs_attention
def test_paged_attention_refuses_bad_layouts():
    q, kb, vb, tables, rr, rp = _paged_case(9, 3, 64, [20])
    with pytest.raises(RuntimeError, match="beyond its block table"):
        pa.paged_attention(q, kb, vb, tables, rr, rp + 100, 0.125)
    with pytest.raises(RuntimeError, match="head dim"):
        pa.paged_attention(q[..., :32].contiguous(), kb[:, :, :32].contiguous(), vb[..., :32].contiguous(), tables,
                           rr, rp, 0.125)
    with pytest.raises(RuntimeError, match="fp32 or bf16 cache"):  # K and V of different dtypes
        pa.paged_attention(q, kb.bfloat16(), vb, tables, rr, rp, 0.125)


@needs_layer_ops
def test_fused_norms_are_batch_invariant_and_match_torch():
    g = torch.Generator().manual_seed(3)
    x, y, w = torch.randn(40, 576, generator=g), torch.randn(40, 576, generator=g), torch.randn(576, generator=g)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            full = layer_ops.rms_norm(x, w, 1e-5)
            s, n = layer_ops.add_rms_norm(x, y, w, 1e-5)
            for m in (1, 7, 16, 17, 40):  # a call's row count (and its split over threads) changes no row
                assert torch.equal(layer_ops.rms_norm(x[:m].contiguous(), w, 1e-5), full[:m])
                sm, nm = layer_ops.add_rms_norm(x[:m].contiguous(), y[:m].contiguous(), w, 1e-5)
                assert torch.equal(sm, s[:m]) and torch.equal(nm, n[:m])
    finally:
        torch.set_num_threads(threads)
    assert torch.allclose(full, rms_norm(x, w, 1e-5), atol=1e-5, rtol=1e-5)
    assert torch.equal(s, x + y) and torch.allclose(n, rms_norm(x + y, w, 1e-5), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        layer_ops.rms_norm(torch.randn(2, 24), torch.randn(24), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        layer_ops.rms_norm(x, torch.randn(64), 1e-5)


@needs_layer_ops
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_writes_the_paged_cache(cache_dtype):
    """q with RoPE (bitwise torch's rotate-half formula), k with RoPE and v in each row's (block, offset), rounded
    as torch casts them to a bf16 cache."""
    g = torch.Generator().manual_seed(4)
    H, KVH, hd, N = 9, 3, 64, 21
    qkv = torch.randn(N, (H + 2 * KVH) * hd, generator=g)
    f = (torch.arange(N) * 7).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, hd, 2) / hd))
    cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
    kb = torch.zeros(8, KVH, hd, pa.BLOCK, dtype=cache_dtype)
    vb = torch.zeros(8, KVH, pa.BLOCK, hd, dtype=cache_dtype)
    blocks = torch.tensor([5] * 16 + [2] * 5)
    offsets = torch.arange(N) % pa.BLOCK
    q = layer_ops.rope_write_kv(qkv, cos, sin, kb, vb, blocks, offsets, H)
    assert torch.equal(q, apply_rope(qkv[:, :H * hd].view(N, H, hd), cos[:, None], sin[:, None]))
    k_ref = apply_rope(qkv[:, H * hd:(H + KVH) * hd].view(N, KVH, hd), cos[:, None], sin[:, None])
    assert torch.equal(kb[blocks, :, :, offsets], k_ref.to(cache_dtype))
    assert torch.equal(vb[blocks, :, offsets, :], qkv[:, (H + KVH) * hd:].view(N, KVH, hd).to(cache_dtype))
    assert kb[[0, 1, 3, 4, 6, 7]].abs().sum() == 0  # nothing else written
    with pytest.raises(RuntimeError, match="outside the cache"):
        layer_ops.rope_write_kv(qkv, cos, sin, kb, vb, blocks + 10, offsets, H)
    with pytest.raises(RuntimeError, match="qkv width"):
        layer_ops.rope_write_kv(qkv, cos, sin, kb, vb, blocks, offsets, H + 1)
