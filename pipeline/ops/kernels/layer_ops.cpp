// The small per-layer operations of the target's forward, fused, fp32, AVX-512: RMSNorm, residual add + RMSNorm,
// and RoPE of q / k with the K/V written into their paged cache blocks.  Built and loaded by
// pipeline/ops/layer_ops.py; see there for why.
//
// Batch invariance: every row is computed by the same code, alone, in one fixed order (a row's sum of squares over
// 16-lane chunks in order, then one horizontal reduction), whatever the number of rows in the call and however the
// rows are split between threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>

namespace {

constexpr int64_t GRAIN = 16;  // rows per task: a decode step's few rows stay on the calling thread

// out[0..d) = w * (x * 1/sqrt(mean(x^2) + eps)), d a multiple of 16
inline void norm_row(const float* x, const float* w, float* out, int64_t d, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < d; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(d) + eps);
  const __m512 rv = _mm512_set1_ps(r);
  for (int64_t j = 0; j < d; j += 16)
    _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_loadu_ps(w + j), _mm512_mul_ps(_mm512_loadu_ps(x + j), rv)));
}

void check_rows(const torch::Tensor& x, const torch::Tensor& w, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), what, ": x must be fp32 [N, d], "
              "contiguous");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(0) == x.size(1), what,
              ": weight must be fp32 [d]");
  TORCH_CHECK(x.size(1) % 16 == 0, what, ": d must be a multiple of 16, got ", x.size(1));
}

// x [hd] (one head) rotated in place into out: out[i] = x[i] cos[i] + rot(x)[i] sin[i], rot(x) = (-x2, x1)
inline void rope_head(const float* x, const float* c, const float* s, float* out, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t j = 0; j < half; j += 16) {
    const __m512 x1 = _mm512_loadu_ps(x + j), x2 = _mm512_loadu_ps(x + half + j);
    const __m512 lo = _mm512_sub_ps(_mm512_mul_ps(x1, _mm512_loadu_ps(c + j)),
                                    _mm512_mul_ps(x2, _mm512_loadu_ps(s + j)));
    const __m512 hi = _mm512_add_ps(_mm512_mul_ps(x2, _mm512_loadu_ps(c + half + j)),
                                    _mm512_mul_ps(x1, _mm512_loadu_ps(s + half + j)));
    _mm512_storeu_ps(out + j, lo);
    _mm512_storeu_ps(out + half + j, hi);
  }
}

// a cache value: fp32 as is, bf16 rounded to nearest even (as torch converts)
inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  *p = (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>(0x7fc0) :
       static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// the rows [a, e) of rope_write_kv, the cache in T
template <typename T>
void rope_rows(const float* X, const float* C, const float* S, float* Q, T* K, T* V, const int64_t* B,
               const int64_t* F, int64_t a, int64_t e, int64_t H, int64_t KVH, int64_t HD, int64_t BS, int64_t width) {
  alignas(64) float k_rot[512];
  for (int64_t i = a; i < e; ++i) {
    const float* row = X + i * width;
    const float *c = C + i * HD, *s = S + i * HD;
    for (int64_t h = 0; h < H; ++h) rope_head(row + h * HD, c, s, Q + (i * H + h) * HD, HD);
    for (int64_t h = 0; h < KVH; ++h) {
      rope_head(row + (H + h) * HD, c, s, k_rot, HD);
      T* kb = K + ((B[i] * KVH + h) * HD) * BS + F[i];  // [hd] strided by BS
      for (int64_t j = 0; j < HD; ++j) store(kb + j * BS, k_rot[j]);
      T* vb = V + ((B[i] * KVH + h) * BS + F[i]) * HD;
      const float* v = row + (H + KVH + h) * HD;
      for (int64_t j = 0; j < HD; ++j) store(vb + j, v[j]);
    }
  }
}

}  // namespace

// x [N, d], w [d] -> RMSNorm(x) [N, d]
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, w, "rms_norm");
  auto out = torch::empty_like(x);
  const int64_t d = x.size(1);
  const float* X = x.data_ptr<float>();
  const float* W = w.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), GRAIN, [&](int64_t a, int64_t e) {
    for (int64_t i = a; i < e; ++i) norm_row(X + i * d, W, O + i * d, d, static_cast<float>(eps));
  });
  return out;
}

// x, y [N, d], w [d] -> (x + y, RMSNorm(x + y)): the residual stream after a sublayer and the next sublayer's input
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& w,
                                        double eps) {
  check_rows(x, w, "add_rms_norm");
  TORCH_CHECK(y.sizes() == x.sizes() && y.scalar_type() == at::kFloat && y.is_contiguous(),
              "add_rms_norm: y must be fp32 like x, contiguous");
  auto sum = torch::empty_like(x);
  auto out = torch::empty_like(x);
  const int64_t d = x.size(1);
  const float *X = x.data_ptr<float>(), *Y = y.data_ptr<float>(), *W = w.data_ptr<float>();
  float *S = sum.data_ptr<float>(), *O = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), GRAIN, [&](int64_t a, int64_t e) {
    for (int64_t i = a; i < e; ++i) {
      for (int64_t j = 0; j < d; j += 16)
        _mm512_storeu_ps(S + i * d + j, _mm512_add_ps(_mm512_loadu_ps(X + i * d + j), _mm512_loadu_ps(Y + i * d + j)));
      norm_row(S + i * d, W, O + i * d, d, static_cast<float>(eps));
    }
  });
  return {sum, out};
}

// qkv [N, (H + 2 KVH) hd] (a fused q/k/v projection), cos / sin [N, hd] at the rows' positions, one layer's paged
// cache k_blocks [NB, KVH, hd, BS] / v_blocks [NB, KVH, BS, hd] (fp32 or bf16), blocks / offsets [N] int64 (each row's cache
// block and offset in it) -> q [N, H, hd] with RoPE; k (with RoPE) and v written into the cache.
torch::Tensor rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                            torch::Tensor& k_blocks, torch::Tensor& v_blocks, const torch::Tensor& blocks,
                            const torch::Tensor& offsets, int64_t num_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous(),
              "rope_write_kv: qkv must be fp32 [N, (H + 2 KVH) hd], contiguous");
  const bool bf16 = k_blocks.scalar_type() == at::kBFloat16;
  TORCH_CHECK(k_blocks.dim() == 4 && v_blocks.dim() == 4 && (bf16 || k_blocks.scalar_type() == at::kFloat) &&
              v_blocks.scalar_type() == k_blocks.scalar_type() && k_blocks.is_contiguous() &&
              v_blocks.is_contiguous(), "rope_write_kv: fp32 or bf16 contiguous cache blocks, one dtype");
  const int64_t N = qkv.size(0), KVH = k_blocks.size(1), HD = k_blocks.size(2), BS = k_blocks.size(3);
  const int64_t H = num_heads;
  TORCH_CHECK(HD % 32 == 0 && HD <= 512, "rope_write_kv: head dim must be a multiple of 32 up to 512, got ", HD);
  TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * HD, "rope_write_kv: qkv width ", qkv.size(1), " != (", H, " + 2 x ",
              KVH, ") x ", HD);
  TORCH_CHECK(v_blocks.size(1) == KVH && v_blocks.size(2) == BS && v_blocks.size(3) == HD,
              "rope_write_kv: V blocks [NB, KVH, BS, hd]");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == N && cos.size(1) == HD &&
              cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous(), "rope_write_kv: cos / sin must be fp32 [N, hd], contiguous");
  TORCH_CHECK(blocks.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && blocks.numel() == N &&
              offsets.numel() == N && blocks.is_contiguous() && offsets.is_contiguous(),
              "rope_write_kv: int64 blocks / offsets [N]");
  const int64_t NB = k_blocks.size(0);
  const int64_t *B = blocks.data_ptr<int64_t>(), *F = offsets.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(B[i] >= 0 && B[i] < NB && F[i] >= 0 && F[i] < BS, "rope_write_kv: row ", i, " block ", B[i],
                " offset ", F[i], " outside the cache");
  auto q = torch::empty({N, H, HD}, qkv.options());
  const float *X = qkv.data_ptr<float>(), *C = cos.data_ptr<float>(), *S = sin.data_ptr<float>();
  float* Q = q.data_ptr<float>();
  const int64_t width = qkv.size(1);
  at::parallel_for(0, N, GRAIN, [&](int64_t a, int64_t e) {
    if (bf16)
      rope_rows(X, C, S, Q, reinterpret_cast<uint16_t*>(k_blocks.data_ptr<at::BFloat16>()),
                reinterpret_cast<uint16_t*>(v_blocks.data_ptr<at::BFloat16>()), B, F, a, e, H, KVH, HD, BS, width);
    else
      rope_rows(X, C, S, Q, k_blocks.data_ptr<float>(), v_blocks.data_ptr<float>(), B, F, a, e, H, KVH, HD, BS,
                width);
  });
  return q;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of fp32 rows, batch-invariant, AVX-512",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm of fp32 rows, batch-invariant, AVX-512",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rope_write_kv", &rope_write_kv, "RoPE of q / k from a fused qkv projection, K/V into the paged cache",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
