// y[M, N] = x[M, K] · w[N, K]ᵀ (+ b[N]) with the CPU's native bf16 dot products (AVX512_BF16's vdpbf16ps): the
// input rows rounded to bf16 once per call (round to nearest even), bf16 weights, fp32 accumulation.
// Built and loaded by pipeline/ops/bf16_linear.py; see there for why it exists.
//
// Batch invariance: every output y[i, n] is one thread's dot product of row i with weight row n: vdpbf16ps adds the
// products of k-pairs (2j, 2j+1) into lane j of a 16-lane fp32 accumulator, 32 k at a time in increasing k, then the
// 16 lanes are summed in one fixed order.  Nothing about that order depends on M, on the tile a row falls in, on the
// thread split or on the other rows of the call, so row i of an M-row product is bit-identical to the 1-row product
// of the same input.
//
// Speed: against widening the weights to fp32 and multiplying in fp32 (kernels/bf16_linear.cpp), one instruction
// does 32 multiply-adds instead of 16 and the weights need no widening, which matters once enough rows share each
// weight vector for the product to be bound by arithmetic rather than by streaming the weights (prefill, many
// requests).  Tiling and threading as in kernels/bf16_linear.cpp.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

inline float lane_sum(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

inline __m512bh load_bh(const uint16_t* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(reinterpret_cast<const void*>(p)));
}

// input rows [0, MT) of X (bf16, row stride K) against weight rows [n0, n0 + NT) of W -> Y[i * N + n]
template <int MT, int NT>
inline void tile(const uint16_t* X, const uint16_t* W, float* Y, int64_t K, int64_t N, int64_t n0) {
  __m512 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* w0 = W + n0 * K;
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh w[NT];
    for (int j = 0; j < NT; ++j) w[j] = load_bh(w0 + j * K + k);
    for (int j = 0; j < NT; ++j)  // the next tile's weight rows meanwhile (one line per 32 values)
      _mm_prefetch(reinterpret_cast<const char*>(w0 + (NT + j) * K + k), _MM_HINT_T0);
    for (int i = 0; i < MT; ++i) {
      const __m512bh x = load_bh(X + i * K + k);
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x, w[j]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) Y[i * N + n0 + j] = lane_sum(acc[i][j]);
}

template <int MT, int NT>
void rows(const uint16_t* X, const uint16_t* W, float* Y, int64_t K, int64_t N, int64_t a, int64_t b) {
  int64_t n = a;
  for (; n + NT <= b; n += NT) tile<MT, NT>(X, W, Y, K, N, n);
  for (; n < b; ++n) tile<MT, 1>(X, W, Y, K, N, n);
}

void pass(const uint16_t* X, const uint16_t* W, float* Y, int64_t MT, int64_t K, int64_t N, int64_t a, int64_t b) {
  switch (MT) {
    case 8: rows<8, 2>(X, W, Y, K, N, a, b); break;
    case 7: rows<7, 3>(X, W, Y, K, N, a, b); break;
    case 6: rows<6, 3>(X, W, Y, K, N, a, b); break;
    case 5: rows<5, 4>(X, W, Y, K, N, a, b); break;
    case 4: rows<4, 4>(X, W, Y, K, N, a, b); break;
    case 3: rows<3, 4>(X, W, Y, K, N, a, b); break;
    case 2: rows<2, 4>(X, W, Y, K, N, a, b); break;
    case 1: rows<1, 4>(X, W, Y, K, N, a, b); break;
    default: break;
  }
}

void block(const uint16_t* X, const uint16_t* W, float* Y, int64_t M, int64_t K, int64_t N, int64_t a, int64_t b) {
  for (int64_t m = 0; m < M; m += 8) pass(X + m * K, W, Y + m * N, std::min<int64_t>(8, M - m), K, N, a, b);
}

}  // namespace

torch::Tensor bf16_dot_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& b) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "bf16_dot_linear: x [M, K] and w [N, K], got ", x.sizes(), " and ",
              w.sizes());
  TORCH_CHECK(x.size(1) == w.size(1), "bf16_dot_linear: x has ", x.size(1), " columns, w ", w.size(1));
  TORCH_CHECK(x.scalar_type() == at::kFloat, "bf16_dot_linear: x must be fp32");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "bf16_dot_linear: w must be bf16");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "bf16_dot_linear: CPU tensors only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "bf16_dot_linear: contiguous x and w");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0, "bf16_dot_linear: K = ", K, " is not a multiple of 32");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  // the input rows in bf16, each element rounded to nearest even on its own (independent of M)
  auto xb = torch::empty({M, K}, x.options().dtype(at::kBFloat16));
  {
    const float* src = x.data_ptr<float>();
    uint16_t* dst = reinterpret_cast<uint16_t*>(xb.data_ptr<at::BFloat16>());
    const int64_t n = M * K;  // a multiple of 32
    for (int64_t i = 0; i < n; i += 32) {
      const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
      _mm512_storeu_si512(reinterpret_cast<void*>(dst + i), reinterpret_cast<__m512i>(h));
    }
  }
  const uint16_t* X = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const uint16_t* W = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* Y = y.data_ptr<float>();
  const int64_t NB = 64;
  at::parallel_for(0, N, 256, [&](int64_t a, int64_t e) {
    for (int64_t n0 = a; n0 < e; n0 += NB) block(X, W, Y, M, K, N, n0, std::min(e, n0 + NB));
  });
  if (b.has_value() && b->defined()) {
    TORCH_CHECK(b->dim() == 1 && b->size(0) == N && b->scalar_type() == at::kFloat,
                "bf16_dot_linear: bias [N] fp32");
    y.add_(*b);
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_dot_linear", &bf16_dot_linear,
        "y = x wᵀ (+ b): x rounded to bf16, bf16 w, fp32 accumulation (vdpbf16ps), batch-invariant, AVX512_BF16",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("b") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
