// Decode attention read straight from the paged KV cache: one new query per sequence attends to the cache
// slots of its context. Gathering those slots into a dense float32 [B, heads, K, D] tensor for SDPA first
// (what the model does for prefill) costs more than the attention itself at decode's one query: it writes
// every key and value once more, in float32, on every step. Here each key and value is read once, in the
// cache's own dtype (float16 on the fast path), and the scores stay in a per-thread buffer.
//
// Work is split over (sequence, KV head) pairs; the query heads that share a KV head (grouped-query
// attention) are computed together, so each key and value row is read once for all of them.
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// p[j] = exp(p[j] - max) for j < n; returns their sum. Masked scores are -inf and become 0.
float exp_and_sum(float* p, int64_t n, float max) {
  using Vec = at::vec::Vectorized<float>;
  Vec sum(0.f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const Vec e = (Vec::loadu(p + j) - Vec(max)).exp_u20();
    e.store(p + j);
    sum = sum + e;
  }
  float total = hsum(sum);
  for (; j < n; ++j) total += (p[j] = std::exp(p[j] - max));
  return total;
}

// Four dot products of one query head with four keys, summed across lanes together.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// One (sequence, KV head): q [group, D] (the query heads sharing the KV head), keys and values the rows of
// the n allowed context positions; writes out [group, D]. scores: a [group, n] buffer.
template <typename T>
void attend(const float* q, const T* const* keys, const T* const* values, int64_t n, int64_t group, int64_t head_dim, float scale,
            float* scores, float* out) {
  const int64_t vectors = head_dim / 8;
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * head_dim;
    float* sg = scores + g * n;
    for (int64_t j = 0; j < n; j += 4) {  // four keys at a time: four independent chains of multiply-adds
      const T* k[4];
      for (int i = 0; i < 4; ++i) k[i] = keys[std::min(j + i, n - 1)];  // past the end: repeat the last key
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t v = 0; v < vectors; ++v) {
        const __m256 qv = _mm256_loadu_ps(qg + 8 * v);
        for (int i = 0; i < 4; ++i) acc[i] = _mm256_fmadd_ps(qv, load8(k[i] + 8 * v), acc[i]);
      }
      alignas(16) float dots[4];
      _mm_store_ps(dots, _mm_mul_ps(hsum4(acc[0], acc[1], acc[2], acc[3]), _mm_set1_ps(scale)));
      for (int i = 0; i < 4 && j + i < n; ++i) sg[j + i] = dots[i];
    }
    const float max = *std::max_element(sg, sg + n);
    const float inv_sum = 1.f / exp_and_sum(sg, n, max);
    for (int64_t d0 = 0; d0 < vectors; d0 += 8) {  // output vectors in registers, eight at a time
      __m256 acc[8];
      for (int v = 0; v < 8; ++v) acc[v] = _mm256_setzero_ps();
      for (int64_t j = 0; j < n; ++j) {
        const __m256 p = _mm256_set1_ps(sg[j]);
        const T* row = values[j] + 8 * d0;
        for (int v = 0; v < 8; ++v)
          if (d0 + v < vectors) acc[v] = _mm256_fmadd_ps(p, load8(row + 8 * v), acc[v]);
      }
      for (int v = 0; v < 8; ++v)
        if (d0 + v < vectors) _mm256_storeu_ps(out + g * head_dim + 8 * (d0 + v), _mm256_mul_ps(acc[v], _mm256_set1_ps(inv_sum)));
    }
  }
}

template <typename T>
void decode_attention(const float* q, const T* k_cache, const T* v_cache, const int64_t* key_slots, const bool* mask, float* out,
                      int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t context, float scale) {
  const int64_t group = q_heads / kv_heads;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;
    thread_local std::vector<const T*> keys, values;
    scores.resize(group * context);
    keys.resize(context);
    values.resize(context);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      int64_t n = 0;  // the allowed positions' rows, so that the loops above never look at the mask
      for (int64_t j = 0; j < context; ++j) {
        if (!mask[b * context + j]) continue;
        const int64_t row = (key_slots[b * context + j] * kv_heads + h) * head_dim;
        keys[n] = k_cache + row;
        values[n++] = v_cache + row;
      }
      const int64_t first = (b * q_heads + h * group) * head_dim;
      if (n == 0)  // no key allowed (never in a real batch): zeros rather than NaN
        std::fill(out + first, out + first + group * head_dim, 0.f);
      else
        attend(q + first, keys.data(), values.data(), n, group, head_dim, scale, scores.data(), out + first);
    }
  });
}

// q [B, q_heads, D] float32; caches [slots, kv_heads, D] float16 or float32; key_slots [B, K] int64 (the cache
// slot of each context position); mask [B, K] bool (which of them the query may attend). Returns [B, q_heads, D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& key_slots,
                                  const at::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be a contiguous [B, heads, head_dim] float32 tensor");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache must be alike [slots, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == at::kHalf || k_cache.scalar_type() == at::kFloat, "the caches must be float16 or float32");
  const int64_t batch = q.size(0), q_heads = q.size(1), head_dim = q.size(2), kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == head_dim && head_dim % 8 == 0, "head_dim must match the cache's and be a multiple of 8");
  TORCH_CHECK(q_heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(key_slots.dim() == 2 && key_slots.size(0) == batch && key_slots.scalar_type() == at::kLong && key_slots.is_contiguous(),
              "key_slots must be a contiguous [B, K] int64 tensor");
  TORCH_CHECK(mask.sizes() == key_slots.sizes() && mask.scalar_type() == at::kBool && mask.is_contiguous(), "mask must be a contiguous [B, K] bool tensor");
  at::Tensor out = at::empty(q.sizes(), q.options());
  const int64_t context = key_slots.size(1);
  if (k_cache.scalar_type() == at::kHalf)
    decode_attention(q.data_ptr<float>(), k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(), key_slots.data_ptr<int64_t>(), mask.data_ptr<bool>(),
                     out.data_ptr<float>(), batch, q_heads, kv_heads, head_dim, context, static_cast<float>(scale));
  else
    decode_attention(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), key_slots.data_ptr<int64_t>(), mask.data_ptr<bool>(),
                     out.data_ptr<float>(), batch, q_heads, kv_heads, head_dim, context, static_cast<float>(scale));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloop, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor key_slots, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloop, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
