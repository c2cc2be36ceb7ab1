// y[M, N] = x[M, K] · w[N, K]ᵀ (+ b[N]): fp32 activations, bf16 weights, fp32 accumulation, AVX-512.
// Built and loaded by pipeline/ops/bf16_linear.py; see there for why it exists.
//
// Batch invariance: every output y[i, n] is one thread's dot product of row i with weight row n, accumulated over k
// in 16-lane vectors in increasing k (lane j holds the k ≡ j mod 16 terms) and then summed across the lanes in one
// fixed order.  Nothing about that order depends on M, on the tile a row falls in, on the thread split or on the
// other rows of the call, so row i of an M-row product is bit-identical to the 1-row product of the same input.
//
// Speed: decoding and verification multiply few rows, so the time is the weight bytes streamed from memory; bf16
// weights halve them against fp32.  A tile of MT input rows × NT weight rows keeps MT·NT accumulators: every weight
// vector is widened to fp32 once and multiplied into MT rows while it sits in a register.  The weight rows are split
// between torch's intra-op threads (at::parallel_for) in blocks of NB rows that stay in L2 while every input-row
// tile passes over them.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

// 16 bf16 values -> 16 fp32 (a bf16 is the top half of an fp32)
inline __m512 widen(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// the fixed cross-lane sum: halves, then quarters, ... (the same for every output element)
inline float lane_sum(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

// input rows [0, MT) of X (row stride K) against weight rows [n0, n0 + NT) of W -> Y[i * N + n]
template <int MT, int NT>
inline void tile(const float* X, const uint16_t* W, float* Y, int64_t K, int64_t N, int64_t n0) {
  __m512 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* w0 = W + n0 * K;
  for (int64_t k = 0; k < K; k += 16) {
    __m512 w[NT];
    for (int j = 0; j < NT; ++j) w[j] = widen(w0 + j * K + k);
    if ((k & 31) == 0)  // fetch the next tile's weight rows meanwhile (one line per 32 values)
      for (int j = 0; j < NT; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w0 + (NT + j) * K + k), _MM_HINT_T0);
    for (int i = 0; i < MT; ++i) {
      const __m512 x = _mm512_loadu_ps(X + i * K + k);
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_fmadd_ps(x, w[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) Y[i * N + n0 + j] = lane_sum(acc[i][j]);
}

// weight rows [a, b) for MT input rows: tiles of NT weight rows, the remainder one row at a time
template <int MT, int NT>
void rows(const float* X, const uint16_t* W, float* Y, int64_t K, int64_t N, int64_t a, int64_t b) {
  int64_t n = a;
  for (; n + NT <= b; n += NT) tile<MT, NT>(X, W, Y, K, N, n);
  for (; n < b; ++n) tile<MT, 1>(X, W, Y, K, N, n);
}

// MT <= 8 input rows in ONE pass over weight rows [a, b), so the weights are streamed once per call for up to 8 rows:
// tiles of MT x NT accumulators (at most 21 of the 32 vector registers; the NT per MT measured fastest on Zen 4)
void pass(const float* X, const uint16_t* W, float* Y, int64_t MT, int64_t K, int64_t N, int64_t a, int64_t b) {
  switch (MT) {
    case 8: rows<8, 2>(X, W, Y, K, N, a, b); break;
    case 7: rows<7, 3>(X, W, Y, K, N, a, b); break;
    case 6: rows<6, 3>(X, W, Y, K, N, a, b); break;
    case 5: rows<5, 4>(X, W, Y, K, N, a, b); break;
    case 4: rows<4, 3>(X, W, Y, K, N, a, b); break;
    case 3: rows<3, 4>(X, W, Y, K, N, a, b); break;
    case 2: rows<2, 4>(X, W, Y, K, N, a, b); break;
    case 1: rows<1, 4>(X, W, Y, K, N, a, b); break;
    default: break;
  }
}

void block(const float* X, const uint16_t* W, float* Y, int64_t M, int64_t K, int64_t N, int64_t a, int64_t b) {
  for (int64_t m = 0; m < M; m += 8) pass(X + m * K, W, Y + m * N, std::min<int64_t>(8, M - m), K, N, a, b);
}

}  // namespace

torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& b) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "bf16_linear: x [M, K] and w [N, K], got ", x.sizes(), " and ",
              w.sizes());
  TORCH_CHECK(x.size(1) == w.size(1), "bf16_linear: x has ", x.size(1), " columns, w ", w.size(1));
  TORCH_CHECK(x.scalar_type() == at::kFloat, "bf16_linear: x must be fp32");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "bf16_linear: w must be bf16");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "bf16_linear: CPU tensors only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "bf16_linear: contiguous x and w");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 16 == 0, "bf16_linear: K = ", K, " is not a multiple of 16");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* X = x.data_ptr<float>();
  const uint16_t* W = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* Y = y.data_ptr<float>();
  const int64_t NB = 64;
  at::parallel_for(0, N, 256, [&](int64_t a, int64_t e) {
    for (int64_t n0 = a; n0 < e; n0 += NB) block(X, W, Y, M, K, N, n0, std::min(e, n0 + NB));
  });
  if (b.has_value() && b->defined()) {
    TORCH_CHECK(b->dim() == 1 && b->size(0) == N && b->scalar_type() == at::kFloat, "bf16_linear: bias [N] fp32");
    y.add_(*b);
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_linear", &bf16_linear, "y = x wᵀ (+ b): fp32 x, bf16 w, fp32 accumulation, batch-invariant, AVX-512",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("b") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
