// Prefill attention: one sequence's new queries (a prompt, or a chunk of one) against its context in the paged KV
// cache, causal and, in a sliding-window layer, within the window, with bfloat16 products summed in float32.
//
// SDPA in float32 was a third of a 1,024-token Gemma 3 prefill, after a gather of the context into a dense float32
// copy, and over pieces of the window that it computes whole, masked or not. Here:
// - the products are AVX512-BF16's vdpbf16ps, 32 multiply-adds an instruction where a float32 FMA does 16, on
//   queries, keys, probabilities and values rounded to bfloat16 (8 bits of mantissa, as llama.cpp's CPU flash
//   attention rounds them to float16's 11); the scores, the softmax and the sums are float32;
// - the keys and values are read from the cache once per call, into bfloat16 blocks of 32 keys laid out for those
//   products, and each query block reads only the key blocks its causal window reaches;
// - the softmax is the online one of flash attention: a running maximum and sum per query row, the output rescaled
//   when the maximum grows, so the scores never leave a 32-key block.
// Work items are (KV head, block of query positions), each with all the query heads that share its KV head
// (grouped-query attention), largest first; items are taken as threads come free (parallel.h).
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
#include <limits>
#include <vector>

#include "kv_cache.h"
#include "parallel.h"

#ifdef __AVX512BF16__
namespace {

constexpr int64_t kKeys = 32;        // keys per block: two 16-lane vectors of scores
constexpr int64_t kScoreRows = 8;    // query rows per tile of scores: 8 x 2 accumulators
constexpr int64_t kOutputRows = 4;   // query rows per tile of outputs: 4 x 4 accumulators of 16 dimensions
constexpr int64_t kQueryRows = 64;   // query rows (positions x heads of a KV head) per work item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
// 16 floats → 16 bfloat16 (round to nearest even), zero-extended into 16 int32 lanes.
inline __m256i bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
inline __m512i to_bf16_lanes(__m512 v) { return _mm512_cvtepu16_epi32(bf16(v)); }
// n floats (n % 16 == 0) → n bfloat16, as n / 2 int32 pairs (element 2i in the low half: vdpbf16ps's order).
template <typename T>
inline void to_bf16(const T* x, int64_t n, uint32_t* out) {
  for (int64_t d = 0; d < n; d += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(out) + d), bf16(load16(x + d)));
}
inline __m512 dot(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }

// One KV head's context in bfloat16 blocks of 32 keys, from key block `first_block` on (the keys no query reaches
// are left out). Keys [blocks][D / 2][32]: per pair of dimensions, that pair of each key, so that one vector
// holds 16 keys' pairs for one query pair broadcast. Values [blocks][16][D]: per pair of keys, each dimension's
// two values, for one pair of probabilities broadcast. Keys past the context are zeros.
struct PackedContext {
  std::vector<uint32_t> keys, values;
  int64_t first_block = 0, head_dim = 0;

  const uint32_t* key_block(int64_t block) const { return keys.data() + (block - first_block) * (head_dim / 2) * kKeys; }
  const uint32_t* value_block(int64_t block) const { return values.data() + (block - first_block) * (kKeys / 2) * head_dim; }
};

template <typename T>
void pack_context(const T* k_head, const T* v_head, const int64_t* key_slots, int64_t num_keys, int64_t first_block, int64_t d, PackedContext& out) {
  const int64_t blocks = (num_keys + kKeys - 1) / kKeys - first_block;
  out.first_block = first_block, out.head_dim = d;
  out.keys.assign(blocks * kKeys * d / 2, 0);
  out.values.assign(blocks * kKeys * d / 2, 0);
  parallel_chunks(blocks, 4, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> row(d / 2);
    for (int64_t b = begin; b < end; ++b) {
      uint32_t* kb = out.keys.data() + b * (d / 2) * kKeys;
      uint32_t* vb = out.values.data() + b * (kKeys / 2) * d;
      const int64_t key0 = (first_block + b) * kKeys;
      for (int64_t j = 0; j < kKeys && key0 + j < num_keys; ++j) {
        to_bf16(k_head + key_slots[key0 + j] * d, d, row.data());
        for (int64_t p = 0; p < d / 2; ++p) kb[p * kKeys + j] = row[p];
      }
      for (int64_t pair = 0; pair < kKeys / 2; ++pair) {
        const int64_t a = key0 + 2 * pair, c = a + 1;
        if (a >= num_keys) break;
        for (int64_t i = 0; i < d; i += 16) {
          const __m512 va = load16(v_head + key_slots[a] * d + i);
          const __m512 vc = c < num_keys ? load16(v_head + key_slots[c] * d + i) : _mm512_setzero_ps();
          const __m512i pairs = _mm512_or_si512(to_bf16_lanes(va), _mm512_slli_epi32(to_bf16_lanes(vc), 16));
          _mm512_storeu_si512(vb + pair * d + i, pairs);
        }
      }
    }
  });
}

// scores [rows][32] = scale * q . k for kScoreRows query rows (bf16 pairs, [rows][D / 2]) against one key block.
void score_tile(const uint32_t* q, const uint32_t* keys, int64_t d, float scale, float* scores) {
  __m512 acc[kScoreRows][2];
  for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < d / 2; ++p) {
    const __m512i k0 = _mm512_loadu_si512(keys + p * kKeys), k1 = _mm512_loadu_si512(keys + p * kKeys + 16);
    for (int64_t r = 0; r < kScoreRows; ++r) {
      const __m512i qp = _mm512_set1_epi32(static_cast<int>(q[r * (d / 2) + p]));
      acc[r][0] = dot(acc[r][0], qp, k0);
      acc[r][1] = dot(acc[r][1], qp, k1);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < kScoreRows; ++r) {
    _mm512_storeu_ps(scores + r * kKeys, _mm512_mul_ps(acc[r][0], s));
    _mm512_storeu_ps(scores + r * kKeys + 16, _mm512_mul_ps(acc[r][1], s));
  }
}

// out [rows][D] = out * rescale + p . v for kOutputRows rows (probabilities as bf16 pairs, [rows][16]), 64 dimensions.
void output_tile(const uint32_t* p, const float* rescale, const uint32_t* values, int64_t d, int64_t dim0, float* out) {
  __m512 acc[kOutputRows][4];
  for (int64_t r = 0; r < kOutputRows; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(out + r * d + dim0 + 16 * c), _mm512_set1_ps(rescale[r]));
  for (int64_t pair = 0; pair < kKeys / 2; ++pair) {
    __m512i v[4];
    for (int c = 0; c < 4; ++c) v[c] = _mm512_loadu_si512(values + pair * d + dim0 + 16 * c);
    for (int64_t r = 0; r < kOutputRows; ++r) {
      const __m512i pp = _mm512_set1_epi32(static_cast<int>(p[r * (kKeys / 2) + pair]));
      for (int c = 0; c < 4; ++c) acc[r][c] = dot(acc[r][c], pp, v[c]);
    }
  }
  for (int64_t r = 0; r < kOutputRows; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + r * d + dim0 + 16 * c, acc[r][c]);
}

// exp(x - max) of 32 scores in place (-inf → 0); returns their sum.
float exp_block(float* x, float max) {
  using Vec = at::vec::Vectorized<float>;
  Vec sum(0.f);
  for (int64_t j = 0; j < kKeys; j += Vec::size()) {
    const Vec e = (Vec::loadu(x + j) - Vec(max)).exp_u20();
    e.store(x + j);
    sum = sum + e;
  }
  float parts[Vec::size()];
  sum.store(parts);
  float total = 0.f;
  for (const float part : parts) total += part;
  return total;
}

struct Scratch {
  std::vector<uint32_t> q, p;
  std::vector<float> out, scores, max, sum, rescale;
};

// One work item: query positions [i0, i1) of the chunk (position first + i), the `group` query heads of KV head h.
void attend_item(const float* q, int64_t q_row_stride, float* out, int64_t out_row_stride, const PackedContext& ctx, int64_t h, int64_t group,
                 int64_t i0, int64_t i1, int64_t first, int64_t window, float scale, Scratch& s) {
  const int64_t d = ctx.head_dim, rows = (i1 - i0) * group;
  const int64_t padded = (rows + kScoreRows - 1) / kScoreRows * kScoreRows;  // a multiple of kOutputRows too
  s.q.assign(padded * d / 2, 0);
  s.p.assign(padded * kKeys / 2, 0);
  s.out.assign(padded * d, 0.f);
  s.scores.resize(padded * kKeys);
  s.max.assign(padded, kNegInf);
  s.sum.assign(padded, 0.f);
  s.rescale.assign(padded, 1.f);
  // Row r: position i0 + r / group, query head h * group + r % group.
  for (int64_t r = 0; r < rows; ++r) to_bf16(q + (i0 + r / group) * q_row_stride + (h * group + r % group) * d, d, s.q.data() + r * d / 2);
  const int64_t lowest = window > 0 ? std::max<int64_t>(first + i0 - window + 1, 0) : 0, end = first + i1;
  for (int64_t block = lowest / kKeys; block * kKeys < end; ++block) {
    const int64_t key0 = block * kKeys;
    for (int64_t r = 0; r < padded; r += kScoreRows)
      score_tile(s.q.data() + r * d / 2, ctx.key_block(block), d, scale, s.scores.data() + r * kKeys);
    for (int64_t r = 0; r < rows; ++r) {
      float* x = s.scores.data() + r * kKeys;
      const int64_t pos = first + i0 + r / group;
      // Keys key0 + j visible from pos: j in [lo, hi).
      const int64_t lo = window > 0 ? std::clamp<int64_t>(pos - window + 1 - key0, 0, kKeys) : 0, hi = std::clamp<int64_t>(pos + 1 - key0, 0, kKeys);
      for (int64_t j = 0; j < lo; ++j) x[j] = kNegInf;
      for (int64_t j = std::max(hi, lo); j < kKeys; ++j) x[j] = kNegInf;
      float block_max = kNegInf;
      for (int64_t j = lo; j < hi; ++j) block_max = std::max(block_max, x[j]);
      const float new_max = std::max(s.max[r], block_max);
      if (new_max == kNegInf) {  // nothing visible yet: no probabilities, nothing to rescale
        std::fill_n(x, kKeys, 0.f);
        s.rescale[r] = 1.f;
      } else {
        s.rescale[r] = std::exp(s.max[r] - new_max);  // 0 on the first visible block (max was -inf)
        s.sum[r] = s.sum[r] * s.rescale[r] + exp_block(x, new_max);
        s.max[r] = new_max;
      }
      for (int64_t j = 0; j < kKeys; j += 16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(s.p.data() + r * kKeys / 2) + j), bf16(_mm512_loadu_ps(x + j)));
      }
    }
    for (int64_t r = 0; r < padded; r += kOutputRows)
      for (int64_t dim0 = 0; dim0 < d; dim0 += 64)
        output_tile(s.p.data() + r * kKeys / 2, s.rescale.data() + r, ctx.value_block(block), d, dim0, s.out.data() + r * d);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* y = out + (i0 + r / group) * out_row_stride + (h * group + r % group) * d;
    const float inverse = 1.f / s.sum[r];
    for (int64_t i = 0; i < d; ++i) y[i] = s.out[r * d + i] * inverse;
  }
}

// q [Q, heads, D] float32 (rows of any stride; heads and dimensions contiguous): the chunk's queries at positions
// first .. first + Q - 1; key_slots [first + Q]: the cache slots of positions 0 .. first + Q - 1; window: a
// query at p attends to keys p - window < j <= p (0: every j <= p). Returns [Q, heads * D] float32.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& key_slots, int64_t first,
                             int64_t window, double scale) {
  check_kv_caches(k_cache, v_cache);
  const int64_t kv_heads = k_cache.size(0), slots = k_cache.size(1), d = k_cache.size(2);
  TORCH_CHECK(d % 64 == 0, "head_dim must be a multiple of 64, got ", d);
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.size(2) == d && q.stride(2) == 1 && q.stride(1) == d && q.size(1) % kv_heads == 0,
              "q must be a float32 [Q, heads, head_dim] tensor, heads a multiple of the cache's KV heads, each row's heads contiguous");
  const int64_t num_q = q.size(0), heads = q.size(1), group = heads / kv_heads;
  TORCH_CHECK(key_slots.scalar_type() == at::kLong && key_slots.is_contiguous() && key_slots.dim() == 1 && first >= 0 && key_slots.size(0) == first + num_q,
              "key_slots must be a contiguous int64 [first + Q] tensor, got ", key_slots.sizes(), " for first = ", first, " and Q = ", num_q);
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");
  const int64_t* slot = key_slots.data_ptr<int64_t>();
  for (int64_t j = 0; j < key_slots.size(0); ++j) TORCH_CHECK(slot[j] >= 0 && slot[j] < slots, "slot ", slot[j], " is outside the cache's ", slots, " slots");
  at::Tensor out = at::empty({num_q, heads * d}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (num_q == 0) return out;
  const int64_t positions = std::max<int64_t>(kQueryRows / group, 1), query_blocks = (num_q + positions - 1) / positions;
  const int64_t first_block = window > 0 ? std::max<int64_t>(first - window + 1, 0) / kKeys : 0;
  std::vector<PackedContext> contexts(kv_heads);
  with_cache_data(k_cache, v_cache, [&](auto* k, auto* v) {
    for (int64_t h = 0; h < kv_heads; ++h) pack_context(k + h * slots * d, v + h * slots * d, slot, first + num_q, first_block, d, contexts[h]);
  });
  const float* qp = q.data_ptr<float>();
  float* y = out.data_ptr<float>();
  parallel_chunks(kv_heads * query_blocks, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % kv_heads, block = query_blocks - 1 - item / kv_heads;  // the latest positions (most keys) first
      attend_item(qp, q.stride(0), y, heads * d, contexts[h], h, group, block * positions, std::min(num_q, (block + 1) * positions), first, window,
                  static_cast<float>(scale), scratch);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloop, m) {
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor key_slots, int first, int window, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloop, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
#endif
