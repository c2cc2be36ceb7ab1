// y[M, N] = x[M, K] · w[N, K]ᵀ (+ b[N]), fp32, for the few input rows of decoding and speculative verification
// (M ≤ ~16), AVX2 + FMA.  Built and loaded by pipeline/ops/small_m_linear.py; see there for why it exists.
//
// Each weight row w[n, :] is read from memory once and multiplied into every input row while it sits in registers:
// a tile of MT input rows × NT weight rows keeps MT·NT 8-wide accumulators, and every step over k loads NT weight
// vectors and MT input vectors (the inputs stay in L1: M·K·4 bytes).  The weight rows are split between the
// intra-op threads (at::parallel_for, so torch.set_num_threads applies), in blocks of NB rows that stay in L2
// while every input-row tile passes over them.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 h = _mm_movehdup_ps(s);
  s = _mm_add_ps(s, h);
  h = _mm_movehl_ps(h, s);
  return _mm_cvtss_f32(_mm_add_ss(s, h));
}

// input rows [0, MT) of X (row stride K) against weight rows [n0, n0 + NT) of W -> Y[i * N + n]
template <int MT, int NT>
inline void tile(const float* X, const float* W, float* Y, int64_t K, int64_t N, int64_t n0) {
  __m256 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm256_setzero_ps();
  const float* w0 = W + n0 * K;
  for (int64_t k = 0; k < K; k += 8) {
    __m256 w[NT];
    for (int j = 0; j < NT; ++j) w[j] = _mm256_loadu_ps(w0 + j * K + k);
    if constexpr (MT >= 4) {  // many input rows: the FMAs take long enough to fetch the next tile's weight rows
      if ((k & 15) == 0)        // meanwhile (one prefetch per 64-byte line; it pays at 8 rows, while
        for (int j = 0; j < NT; ++j)  // 1-3 rows, memory-bound, ran slower with it)
          _mm_prefetch(reinterpret_cast<const char*>(w0 + (NT + j) * K + k), _MM_HINT_T0);
    }
    for (int i = 0; i < MT; ++i) {
      const __m256 x = _mm256_loadu_ps(X + i * K + k);
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm256_fmadd_ps(x, w[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) Y[i * N + n0 + j] = hsum(acc[i][j]);
}

// weight rows [a, b) for MT input rows: tiles of NT weight rows, the remainder one row at a time
template <int MT, int NT>
void rows(const float* X, const float* W, float* Y, int64_t K, int64_t N, int64_t a, int64_t b) {
  int64_t n = a;
  for (; n + NT <= b; n += NT) tile<MT, NT>(X, W, Y, K, N, n);
  for (; n < b; ++n) tile<MT, 1>(X, W, Y, K, N, n);
}

// tile shapes picked by timing SmolLM2's shapes with weights streamed from memory: 8x1 tiles for 8 rows of the
// 576-wide gate/up and LM head, 4x3 for the 1536-wide down projection; few rows use wider weight tiles (more
// independent accumulators per loaded input vector)
void block(const float* X, const float* W, float* Y, int64_t M, int64_t K, int64_t N, int64_t a, int64_t b) {
  int64_t m = 0;
  for (; M - m >= 8; m += 8) rows<8, 1>(X + m * K, W, Y + m * N, K, N, a, b);
  if (M - m >= 4) {
    rows<4, 3>(X + m * K, W, Y + m * N, K, N, a, b);
    m += 4;
  }
  switch (M - m) {
    case 3: rows<3, 3>(X + m * K, W, Y + m * N, K, N, a, b); break;
    case 2: rows<2, 4>(X + m * K, W, Y + m * N, K, N, a, b); break;
    case 1: rows<1, 4>(X + m * K, W, Y + m * N, K, N, a, b); break;
    default: break;
  }
}

}  // namespace

torch::Tensor small_m_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& b) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "small_m_linear: x [M, K] and w [N, K], got ", x.sizes(), " and ",
              w.sizes());
  TORCH_CHECK(x.size(1) == w.size(1), "small_m_linear: x has ", x.size(1), " columns, w ", w.size(1));
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "small_m_linear: fp32 only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "small_m_linear: CPU tensors only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "small_m_linear: contiguous x and w");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 8 == 0, "small_m_linear: K = ", K, " is not a multiple of 8");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* X = x.data_ptr<float>();
  const float* W = w.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  const int64_t NB = 64;
  at::parallel_for(0, N, 256, [&](int64_t a, int64_t e) {
    for (int64_t n0 = a; n0 < e; n0 += NB) block(X, W, Y, M, K, N, n0, std::min(e, n0 + NB));
  });
  if (b.has_value() && b->defined()) {
    TORCH_CHECK(b->dim() == 1 && b->size(0) == N && b->scalar_type() == at::kFloat, "small_m_linear: bias [N] fp32");
    y.add_(*b);
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_m_linear", &small_m_linear, "y = x wᵀ (+ b), fp32, few rows, AVX2 + FMA",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("b") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
