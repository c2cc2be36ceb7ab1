// Causal attention of a ragged batch of query rows over a paged (block) KV cache, fp32 arithmetic, AVX-512; the
// cache holds fp32 or bf16 keys and values (bf16: half the bytes streamed, each value widened exactly on load).
// Built and loaded by pipeline/ops/paged_attention.py; see there for the cache layout and why it exists.
//
// Batch invariance: a query row's output depends only on its query, its position and the keys it may see, reduced in
// one fixed order -- the cache blocks in order, BS keys at a time, with an online softmax (running max, running sum,
// rescaled accumulator) -- whatever else is in the call.  So the rows of a verification block, of a prefill chunk and
// of a 1-token decode step, alone or beside other requests, attend bit-identically to the same keys.
//
// Work: one task per (query row, KV head); the G = H / KVH query heads that share a KV head are processed together,
// so every key and value vector is loaded once for all of them.  Scores of BS = 16 keys come out of one pass over the
// head dimension (K blocks are stored transposed, keys contiguous: 16 scores in one register); values are
// accumulated with the 16 probabilities broadcast.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>

namespace {

constexpr int BS = 16;     // keys per cache block
constexpr int MAX_G = 8;   // query heads per KV head handled by one task

// exp(x) for x <= 0, 16 lanes: 2^(x log2 e) = 2^n * 2^f with f in [-0.5, 0.5] and a degree-6 polynomial for 2^f
// (relative error ~2e-7); x below -87 gives 0.  Deterministic: the same input always gives the same output.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16 cache values from p, as fp32 (bf16 widened exactly: its bits are the high half of the fp32 bits)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// G query heads q[g * HD ...] of one row against the keys [first, last] of one KV head.
// Kc: this KV head's first K block, blocks `kstride` values apart, each [HD][BS]; Vc likewise, each [BS][HD].
template <int HD, typename T>
void attend(const float* q, int G, const T* Kc, const T* Vc, const int32_t* table, int64_t kstride,
            int64_t first, int64_t last, float scale, float* out) {
  constexpr int D = HD / 16;
  __m512 acc[MAX_G][D];
  float m[MAX_G], l[MAX_G];
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
    for (int d = 0; d < D; ++d) acc[g][d] = _mm512_setzero_ps();
  }
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t b = first / BS; b <= last / BS; ++b) {
    const T* K = Kc + static_cast<int64_t>(table[b]) * kstride;
    const T* V = Vc + static_cast<int64_t>(table[b]) * kstride;
    const int lo = static_cast<int>(std::max<int64_t>(first - b * BS, 0));
    const int hi = static_cast<int>(std::min<int64_t>(last - b * BS, BS - 1));
    const __mmask16 valid = static_cast<__mmask16>(((1u << (hi + 1)) - 1u) & ~((1u << lo) - 1u));
    __m512 s[MAX_G];
    for (int g = 0; g < G; ++g) s[g] = _mm512_setzero_ps();
    for (int d = 0; d < HD; ++d) {
      const __m512 kd = load16(K + d * BS);
      for (int g = 0; g < G; ++g) s[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * HD + d]), kd, s[g]);
    }
    alignas(64) float p[MAX_G][BS];
    for (int g = 0; g < G; ++g) {
      const __m512 sg = _mm512_mask_blend_ps(valid, neg_inf, _mm512_mul_ps(s[g], _mm512_set1_ps(scale)));
      const float mn = std::max(m[g], _mm512_reduce_max_ps(sg));
      const float corr = std::exp(m[g] - mn);  // the first block: exp(-inf) = 0
      const __m512 pg = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(sg, _mm512_set1_ps(mn))));
      l[g] = l[g] * corr + _mm512_reduce_add_ps(pg);
      m[g] = mn;
      _mm512_store_ps(p[g], pg);
      const __m512 c = _mm512_set1_ps(corr);
      for (int d = 0; d < D; ++d) acc[g][d] = _mm512_mul_ps(acc[g][d], c);
    }
    for (int j = lo; j <= hi; ++j) {
      __m512 v[D];
      for (int d = 0; d < D; ++d) v[d] = load16(V + j * HD + d * 16);
      for (int g = 0; g < G; ++g) {
        const __m512 pj = _mm512_set1_ps(p[g][j]);
        for (int d = 0; d < D; ++d) acc[g][d] = _mm512_fmadd_ps(pj, v[d], acc[g][d]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / l[g]);
    for (int d = 0; d < D; ++d) _mm512_storeu_ps(out + g * HD + d * 16, _mm512_mul_ps(acc[g][d], inv));
  }
}

template <typename T>
void run(const float* Q, const T* K, const T* V, const int32_t* T_, const int64_t* RR, const int64_t* RP, float* O,
         int64_t N, int64_t H, int64_t HD, int64_t KVH, int64_t width, double scale, int64_t window) {
  const int64_t G = H / KVH, kstride = KVH * HD * BS;
  at::parallel_for(0, N * KVH, 1, [&](int64_t a, int64_t e) {
    for (int64_t t = a; t < e; ++t) {
      const int64_t row = t / KVH, kv = t % KVH;
      const int64_t last = RP[row], first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
      const float* qh = Q + (row * H + kv * G) * HD;
      float* oh = O + (row * H + kv * G) * HD;
      const int32_t* tab = T_ + RR[row] * width;
      if (HD == 64)
        attend<64, T>(qh, static_cast<int>(G), K + kv * HD * BS, V + kv * BS * HD, tab, kstride, first, last,
                      static_cast<float>(scale), oh);
      else
        attend<128, T>(qh, static_cast<int>(G), K + kv * HD * BS, V + kv * BS * HD, tab, kstride, first, last,
                       static_cast<float>(scale), oh);
    }
  });
}

}  // namespace

// q [N, H, HD] fp32; k_blocks [NB, KVH, HD, BS], v_blocks [NB, KVH, BS, HD] fp32 or bf16, one dtype (one layer); tables [R, T] int32
// (the cache blocks of each request, in order); row_request [N] int64 (the request of each query row, an index into
// tables); row_position [N] int64 (its absolute position: it sees keys 0..position, or the last `window` of them).
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_blocks, const torch::Tensor& v_blocks,
                              const torch::Tensor& tables, const torch::Tensor& row_request,
                              const torch::Tensor& row_position, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_blocks.dim() == 4 && v_blocks.dim() == 4, "paged_attention: bad ranks");
  const int64_t N = q.size(0), H = q.size(1), HD = q.size(2), KVH = k_blocks.size(1);
  const bool bf16 = k_blocks.scalar_type() == at::kBFloat16;
  TORCH_CHECK(q.scalar_type() == at::kFloat && (bf16 || k_blocks.scalar_type() == at::kFloat) &&
              v_blocks.scalar_type() == k_blocks.scalar_type(), "paged_attention: fp32 q, an fp32 or bf16 cache");
  TORCH_CHECK(HD == 64 || HD == 128, "paged_attention: head dim 64 or 128, got ", HD);
  TORCH_CHECK(k_blocks.size(2) == HD && k_blocks.size(3) == BS && v_blocks.size(2) == BS && v_blocks.size(3) == HD,
              "paged_attention: K blocks [NB, KVH, HD, 16] and V blocks [NB, KVH, 16, HD]");
  TORCH_CHECK(H % KVH == 0 && H / KVH <= MAX_G, "paged_attention: ", H, " heads over ", KVH, " KV heads");
  TORCH_CHECK(q.is_contiguous() && k_blocks.is_contiguous() && v_blocks.is_contiguous() && tables.is_contiguous(),
              "paged_attention: contiguous tensors");
  TORCH_CHECK(tables.scalar_type() == at::kInt && row_request.scalar_type() == at::kLong &&
              row_position.scalar_type() == at::kLong, "paged_attention: int32 tables, int64 rows");
  auto out = torch::empty_like(q);
  if (N == 0) return out;
  const float* Q = q.data_ptr<float>();
  const int32_t* T = tables.data_ptr<int32_t>();
  const int64_t* RR = row_request.data_ptr<int64_t>();
  const int64_t* RP = row_position.data_ptr<int64_t>();
  float* O = out.data_ptr<float>();
  const int64_t width = tables.size(1);
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(RP[i] >= 0 && RP[i] / BS < width, "paged_attention: row ", i, " position ", RP[i],
                " beyond its block table");
  if (bf16)
    run<uint16_t>(Q, reinterpret_cast<const uint16_t*>(k_blocks.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(v_blocks.data_ptr<at::BFloat16>()), T, RR, RP, O, N, H, HD, KVH,
                  width, scale, window);
  else
    run<float>(Q, k_blocks.data_ptr<float>(), v_blocks.data_ptr<float>(), T, RR, RP, O, N, H, HD, KVH, width, scale,
               window);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "causal attention over a paged KV cache, batch-invariant, AVX-512",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
