// Decode attention read straight from the paged KV cache: one new query per sequence attends to the cache
// slots of its context. Gathering those slots into a dense float32 [B, heads, K, D] tensor for SDPA first
// (what the model does for prefill) costs more than the attention itself at decode's one query: it writes
// every key and value once more, in float32, on every step. Here each key and value is read once, in the
// cache's own dtype (float16 on the fast path), and the scores stay in a per-thread buffer.
//
// The caches are [kv_heads, slots, D]: one KV head's rows of a block are contiguous, so a (sequence, KV head)
// reads runs of block_size rows rather than one row in every kv_heads. Work is split over (sequence, KV head)
// pairs; the query heads that share a KV head (grouped-query attention) are computed together, so each key
// and value vector is loaded and converted once for all of them.
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

#include "kv_cache.h"
#include "parallel.h"

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

// How many keys ahead the loops ask for rows. With many sequences the keys and values come from memory, and
// the blocks of a sequence are scattered, so the hardware prefetcher cannot guess the next one (at 32
// sequences, 8 keys ahead took about 0.6 of the time without; 16 or 32 did no better).
constexpr int64_t kPrefetchKeys = 8;

template <typename T>
inline void prefetch_row(const T* row, int64_t head_dim) {
  for (int64_t b = 0; b < head_dim * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T0);
}

// scores[g][j] = scale * q[g] . keys[j] for kHeads query heads, three keys at a time (independent chains of
// multiply-adds to overlap); each key vector is loaded once for all heads.
template <int kHeads, typename T>
void score_keys(const float* q, const T* const* keys, int64_t n, int64_t head_dim, float scale, float* scores) {
  constexpr int kKeys = 3;
  for (int64_t j = 0; j < n; j += kKeys) {
    const T* k[kKeys];
    for (int i = 0; i < kKeys; ++i) {
      k[i] = keys[std::min<int64_t>(j + i, n - 1)];  // past the end: repeat the last key
      prefetch_row(keys[std::min<int64_t>(j + i + kPrefetchKeys, n - 1)], head_dim);
    }
    __m256 acc[kHeads][kKeys];
    for (int g = 0; g < kHeads; ++g)
      for (int i = 0; i < kKeys; ++i) acc[g][i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
      __m256 kv[kKeys];
      for (int i = 0; i < kKeys; ++i) kv[i] = load8(k[i] + d);
      for (int g = 0; g < kHeads; ++g) {
        const __m256 qv = _mm256_loadu_ps(q + g * head_dim + d);
        for (int i = 0; i < kKeys; ++i) acc[g][i] = _mm256_fmadd_ps(qv, kv[i], acc[g][i]);
      }
    }
    for (int g = 0; g < kHeads; ++g)
      for (int i = 0; i < kKeys && j + i < n; ++i) scores[g * n + j + i] = hsum(acc[g][i]) * scale;
  }
}

// out[g][d0 .. d0 + 8 kVectors) = sum_j p[g][j] * values[j][same lanes] for kHeads heads, the sums in registers
// (all sizes known at compile time: a runtime bound made gcc keep them on the stack); each value vector is
// loaded once for all heads. `prefetch`: ask for rows ahead (the first lanes' pass reads them from memory).
template <int kHeads, int kVectors, typename T>
void weigh_value_lanes(const float* p, const T* const* values, int64_t n, int64_t head_dim, int64_t d0, bool prefetch, float* out) {
  __m256 acc[kHeads][kVectors];
  for (int g = 0; g < kHeads; ++g)
    for (int v = 0; v < kVectors; ++v) acc[g][v] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    if (prefetch) prefetch_row(values[std::min<int64_t>(j + kPrefetchKeys, n - 1)], head_dim);
    __m256 pj[kHeads];
    for (int g = 0; g < kHeads; ++g) pj[g] = _mm256_set1_ps(p[g * n + j]);
    for (int v = 0; v < kVectors; ++v) {
      const __m256 x = load8(values[j] + d0 + 8 * v);
      for (int g = 0; g < kHeads; ++g) acc[g][v] = _mm256_fmadd_ps(pj[g], x, acc[g][v]);
    }
  }
  for (int g = 0; g < kHeads; ++g)
    for (int v = 0; v < kVectors; ++v) _mm256_storeu_ps(out + g * head_dim + d0 + 8 * v, acc[g][v]);
}

// out[g] = sum_j p[g][j] * values[j] for kHeads heads: 32 lanes at a time, then 8.
template <int kHeads, typename T>
void weigh_values(const float* p, const T* const* values, int64_t n, int64_t head_dim, float* out) {
  int64_t d0 = 0;
  for (; d0 + 32 <= head_dim; d0 += 32) weigh_value_lanes<kHeads, 4>(p, values, n, head_dim, d0, d0 == 0, out);
  for (; d0 < head_dim; d0 += 8) weigh_value_lanes<kHeads, 1>(p, values, n, head_dim, d0, d0 == 0, out);
}

// fn(std::integral_constant<int, h>), h = min(3, heads) for heads >= 1: query heads go through the templates
// above in slices of up to three (more would leave too few registers for the keys).
template <typename Fn>
inline void with_head_slice(int64_t heads, Fn&& fn) {
  if (heads >= 3) fn(std::integral_constant<int, 3>{});
  else if (heads == 2) fn(std::integral_constant<int, 2>{});
  else fn(std::integral_constant<int, 1>{});
}

// One (sequence, KV head): q [group, D] (the query heads sharing the KV head), keys and values the rows of
// the n allowed context positions; writes out [group, D]. scores: a [group, n] buffer.
template <typename T>
void attend(const float* q, const T* const* keys, const T* const* values, int64_t n, int64_t group, int64_t head_dim, float scale,
            float* scores, float* out) {
  for (int64_t g = 0; g < group; g += 3)
    with_head_slice(group - g, [&](auto heads) { score_keys<decltype(heads)::value>(q + g * head_dim, keys, n, head_dim, scale, scores + g * n); });
  for (int64_t g = 0; g < group; ++g) {  // softmax, normalized here so that the value sums need no scaling after
    float* sg = scores + g * n;
    const float inv_sum = 1.f / exp_and_sum(sg, n, *std::max_element(sg, sg + n));
    for (int64_t j = 0; j < n; ++j) sg[j] *= inv_sum;
  }
  for (int64_t g = 0; g < group; g += 3)
    with_head_slice(group - g, [&](auto heads) { weigh_values<decltype(heads)::value>(scores + g * n, values, n, head_dim, out + g * head_dim); });
}

template <typename T>
void decode_attention(const float* q, const T* k_cache, const T* v_cache, const int64_t* key_slots, const bool* mask, float* out,
                      int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t slots, int64_t head_dim, int64_t context, float scale) {
  const int64_t group = q_heads / kv_heads;
  parallel_chunks(batch * kv_heads, chunk_size(batch * kv_heads, 1, 4), [&](int64_t begin, int64_t end) {
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
        const int64_t row = (h * slots + key_slots[b * context + j]) * head_dim;
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

// q [B, q_heads, D] float32; caches [kv_heads, slots, D] float16 or float32; key_slots [B, K] int64 (the cache
// slot of each context position); mask [B, K] bool (which of them the query may attend). Returns [B, q_heads, D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& key_slots,
                                  const at::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be a contiguous [B, heads, head_dim] float32 tensor");
  check_kv_caches(k_cache, v_cache);
  const int64_t batch = q.size(0), q_heads = q.size(1), head_dim = q.size(2), kv_heads = k_cache.size(0), slots = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == head_dim && head_dim % 8 == 0, "head_dim must match the cache's and be a multiple of 8");
  TORCH_CHECK(q_heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(key_slots.dim() == 2 && key_slots.size(0) == batch && key_slots.scalar_type() == at::kLong && key_slots.is_contiguous(),
              "key_slots must be a contiguous [B, K] int64 tensor");
  TORCH_CHECK(mask.sizes() == key_slots.sizes() && mask.scalar_type() == at::kBool && mask.is_contiguous(), "mask must be a contiguous [B, K] bool tensor");
  at::Tensor out = at::empty(q.sizes(), q.options());
  const int64_t context = key_slots.size(1);
  with_cache_data(k_cache, v_cache, [&](const auto* k, const auto* v) {
    decode_attention(q.data_ptr<float>(), k, v, key_slots.data_ptr<int64_t>(), mask.data_ptr<bool>(), out.data_ptr<float>(), batch, q_heads, kv_heads,
                     slots, head_dim, context, static_cast<float>(scale));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloop, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor key_slots, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloop, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
