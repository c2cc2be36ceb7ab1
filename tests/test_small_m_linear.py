"""The small-M AVX2 linear kernel (pipeline/ops/small_m_linear.py): same products as F.linear for every row / column
count and tile remainder, with and without bias, on 1 and 2 threads; refuses what it cannot compute; routed by
PackedWeight (few rows -> kernel, more -> packed) and by the drafter's Linear at inference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.ops import packed_linear, small_m_linear

pytestmark = pytest.mark.skipif(not small_m_linear.available(),
                                reason=f"no small-M kernel here: {small_m_linear.unavailable_reason()}")


@pytest.mark.parametrize("K", [8, 64, 72, 576])
def test_matches_flinear(K):
    g = torch.Generator().manual_seed(K)
    for M in (1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 33):
        for N in (1, 3, 4, 5, 64, 65, 257, 600):
            x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
            b = torch.randn(N, generator=g)
            ref = F.linear(x, w)
            assert torch.allclose(small_m_linear.linear(x, w), ref, atol=1e-4, rtol=1e-5), (M, N)
            assert torch.allclose(small_m_linear.linear(x, w, b), ref + b, atol=1e-4, rtol=1e-5), (M, N)


def test_shapes_threads_and_inputs():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(1000, 64, generator=g), torch.randn(2, 3, 64, generator=g)
    y = small_m_linear.linear(x, w)  # leading dims kept
    assert y.shape == (2, 3, 1000) and torch.allclose(y, F.linear(x, w), atol=1e-4)
    xt = torch.randn(64, 5, generator=g).t()  # a non-contiguous input is copied first
    assert torch.allclose(small_m_linear.linear(xt, w), F.linear(xt, w), atol=1e-4)
    n = torch.get_num_threads()
    try:  # the weight rows are split over torch's intra-op threads: same values on one thread
        torch.set_num_threads(1)
        one = small_m_linear.linear(x, w)
        torch.set_num_threads(2)
        two = small_m_linear.linear(x, w)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two)  # each output is one thread's dot product: the split changes no summation
    assert small_m_linear.linear(torch.randn(0, 64), w).shape == (0, 1000)


def test_refuses_what_it_cannot_compute():
    w = torch.randn(16, 12)
    assert not small_m_linear.usable(w)  # K not a multiple of 8: the back ends keep their other path
    assert not small_m_linear.usable(torch.randn(16, 16, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="not a multiple of 8"):
        small_m_linear.linear(torch.randn(2, 12), w)
    with pytest.raises(RuntimeError, match="fp32 only"):
        small_m_linear.linear(torch.randn(2, 16, dtype=torch.bfloat16), torch.randn(4, 16, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="columns"):
        small_m_linear.linear(torch.randn(2, 16), torch.randn(4, 24))


@pytest.mark.skipif(not packed_linear.available(), reason="this PyTorch build has no oneDNN packed linear")
def test_packed_weight_routes_by_rows(monkeypatch):
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    pw = packed_linear.PackedWeight(w, b, True, 0, kernel_max_rows=8)
    assert pw.kernel_max_rows == 8 and pw.weight is not None and pw.packed is not None
    calls = []
    real = small_m_linear.linear
    monkeypatch.setattr(small_m_linear, "linear", lambda *a: calls.append(a[0].shape) or real(*a))
    for rows in (1, 8, 9, 40):
        x = torch.randn(rows, 64, generator=g)
        assert torch.allclose(pw(x), F.linear(x, w, b), atol=1e-4)
    assert calls == [(1, 64), (8, 64)]  # 9 and 40 rows: packed
    assert packed_linear.PackedWeight(torch.randn(8, 12), None, True, 0, 8).kernel_max_rows == 0  # K % 8 != 0
    assert packed_linear.PackedWeight(w, None, False, 0, 8).kernel_max_rows == 0  # only with use_packed
    assert packed_linear.PackedWeight(w, None, True, 0, 0).weight is None  # packed only: one copy


@pytest.mark.skipif(not packed_linear.available(), reason="this PyTorch build has no oneDNN packed linear")
def test_drafter_linear_uses_kernel_at_inference(monkeypatch):
    monkeypatch.setitem(packed_linear._KERNEL_WINS, 576, True)
    lin = packed_linear.Linear(64, 40)
    calls = []
    real = small_m_linear.linear
    monkeypatch.setattr(small_m_linear, "linear", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(7, 64)
    with torch.inference_mode():
        y = lin(x)
        lin(torch.randn(small_m_linear.MAX_ROWS + 1, 64))  # more rows: packed
    assert calls == [1] and torch.allclose(y, F.linear(x, lin.weight, lin.bias), atol=1e-5)
    y2 = lin(x)  # autograd on: nn.Linear
    assert calls == [1] and y2.requires_grad
    monkeypatch.setitem(packed_linear._KERNEL_WINS, 576, False)  # the kernel lost on this CPU: packed
    with torch.no_grad():
        lin(x)
    assert calls == [1]
