// Attention straight from the paged KV cache, for every query of a step: prompt chunks, decodes and draft rows to
// verify alike. Each query row's output is one fixed sequence of floating-point operations that depends only on
// the row, its position and its context: never on how many queries share the call, which rows are beside it, how
// its prompt was chunked, or how many threads run. So a token gets the same floats prefilled in a chunk of 1,000 as
// decoded alone, and a request the same tokens whatever else is in the batch.
//
// The order, per query row: its context in blocks of 32 keys aligned to absolute positions (keys 0..31, 32..63,
// ...), in increasing order; per block, the scores (a fixed sum over the head's dimensions), then flash
// attention's online softmax (a running maximum and sum, the output rescaled when the maximum grows), then the
// probabilities times the values (a fixed sum over the block's keys); at the end, the output divided by the sum.
// A block that the row may not see at all (past its position, or before its sliding window) changes nothing:
// its probabilities are exact zeros and its rescale factor exactly 1. Work items (entry, KV head, block of query
// positions) may therefore start at any block and cover any rows.
//
// The products: on a bfloat16 cache (CPUs with AVX512-BF16), AVX512-BF16's vdpbf16ps on queries and probabilities
// rounded to bfloat16 and the cache's keys and values (32 multiply-adds an instruction), sums in float32; on a
// float16 or float32 cache, float32 FMAs (the exact float32 path). Either reads keys and values where they are in
// the cache, whose blocks are laid out for these products (kv_cache.h): nothing is copied or converted per step
// but the queries.
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

namespace {

constexpr int64_t kKeys = 32;       // keys per block, aligned to absolute positions
constexpr int64_t kGroup = 16;      // consecutive keys per group: a block's keys are two groups
constexpr int64_t kQueryRows = 64;  // query rows (positions x query heads of a KV head) per work item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// fn(std::integral_constant<int, v>) for v = min(n, 4) vectors (n >= 1).
template <typename Fn>
inline void with_vectors(int64_t n, Fn&& fn) {
  if (n >= 4) fn(std::integral_constant<int, 4>{});
  else if (n == 3) fn(std::integral_constant<int, 3>{});
  else if (n == 2) fn(std::integral_constant<int, 2>{});
  else fn(std::integral_constant<int, 1>{});
}

// One block of 32 keys in the cache: its two groups of 16 consecutive positions, each within one cache block
// (block_size is a multiple of 16), at their first key's place in the block's keys and in its values.
template <typename T>
struct KeyBlock {
  const T* keys[2];
  const T* values[2];
};

// Float32 products on 8-lane vectors (AVX2; the same floats on an AVX-512 CPU) from a float16 or float32 cache:
// per dimension, one broadcast query value times 4 vectors of 8 keys; per key, one broadcast probability times
// its value's dimensions.
template <typename T>
struct F32Products {
  using Cached = T;
  using Packed = float;                  // queries and probabilities as the products take them
  static constexpr int kScoreRows = 2;   // query rows per tile of scores: 2 x 4 accumulators
  static constexpr int kOutputRows = 2;  // query rows per tile of outputs: 2 x 4 accumulators of 8 dimensions
  static int64_t query_elems(int64_t d) { return d; }
  static constexpr int64_t kProbElems = kKeys;

  static void pack_query(const float* x, int64_t d, Packed* out) { std::copy(x, x + d, out); }

  // scores [kRows][32] = scale * q . k, each score summed over the dimensions in order.
  template <int kRows>
  static void score_tile(const Packed* q, const KeyBlock<T>& b, int64_t block_size, int64_t d, float scale, float* scores) {
    __m256 acc[kRows][4];
    for (auto& row : acc)
      for (auto& a : row) a = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; ++i) {
      __m256 k[4];
      for (int c = 0; c < 4; ++c) k[c] = load8(b.keys[c / 2] + i * block_size + 8 * (c % 2));
      for (int r = 0; r < kRows; ++r) {
        const __m256 qv = _mm256_set1_ps(q[r * d + i]);
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_fmadd_ps(qv, k[c], acc[r][c]);
      }
    }
    const __m256 s = _mm256_set1_ps(scale);
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(scores + r * kKeys + 8 * c, _mm256_mul_ps(acc[r][c], s));
  }

  static void pack_probs(const float* x, Packed* p) { std::copy(x, x + kKeys, p); }

  // out [kRows][D] = out * rescale + p . v, each sum over the block's keys in order; dimensions in pieces of 32.
  template <int kRows>
  static void output_tile(const Packed* p, const float* rescale, const KeyBlock<T>& b, int64_t d, float* out) {
    for (int64_t dim0 = 0; dim0 < d; dim0 += 32)
      with_vectors((d - dim0) / 8, [&](auto vectors) { output_piece<kRows, decltype(vectors)::value>(p, rescale, b, d, dim0, out); });
  }

  // kVectors vectors of 8 dimensions from dim0 (a compile-time count: with a runtime one, gcc keeps the
  // accumulators on the stack).
  template <int kRows, int kVectors>
  static void output_piece(const Packed* p, const float* rescale, const KeyBlock<T>& b, int64_t d, int64_t dim0, float* out) {
    __m256 acc[kRows][kVectors];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kVectors; ++c) acc[r][c] = _mm256_mul_ps(_mm256_loadu_ps(out + r * d + dim0 + 8 * c), _mm256_set1_ps(rescale[r]));
    for (int64_t j = 0; j < kKeys; ++j) {
      const T* value = b.values[j / kGroup] + (j % kGroup) * d + dim0;
      __m256 v[kVectors];
      for (int c = 0; c < kVectors; ++c) v[c] = load8(value + 8 * c);
      for (int r = 0; r < kRows; ++r) {
        const __m256 pj = _mm256_set1_ps(p[r * kKeys + j]);
        for (int c = 0; c < kVectors; ++c) acc[r][c] = _mm256_fmadd_ps(pj, v[c], acc[r][c]);
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kVectors; ++c) _mm256_storeu_ps(out + r * d + dim0 + 8 * c, acc[r][c]);
  }
};

#ifdef __AVX512BF16__
// 16 floats → 16 bfloat16 (round to nearest even).
inline __m256i bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
inline __m512 dot(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
inline __m512i load_pairs(const at::BFloat16* p, int64_t pairs) { return _mm512_loadu_si512(reinterpret_cast<const uint32_t*>(p) + pairs); }

// bfloat16 products on 16-lane vectors (AVX512-BF16) from a bfloat16 cache. Queries as D / 2 pairs of dimensions,
// times the cache's keys (per pair of dimensions, that pair of 16 consecutive keys); probabilities as 16 pairs of
// keys, times the cache's values (per pair of keys, each dimension's two values).
struct Bf16Products {
  using Cached = at::BFloat16;
  using Packed = uint32_t;
  static constexpr int kScoreRows = 8;   // 8 x 2 accumulators
  static constexpr int kOutputRows = 4;  // 4 x 4 accumulators of 16 dimensions
  static int64_t query_elems(int64_t d) { return d / 2; }
  static constexpr int64_t kProbElems = kKeys / 2;

  static void pack_query(const float* x, int64_t d, Packed* out) {
    for (int64_t i = 0; i < d; i += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(out) + i), bf16(_mm512_loadu_ps(x + i)));
  }

  template <int kRows>
  static void score_tile(const Packed* q, const KeyBlock<Cached>& b, int64_t block_size, int64_t d, float scale, float* scores) {
    __m512 acc[kRows][2];
    for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < d / 2; ++p) {
      const __m512i k0 = load_pairs(b.keys[0], p * block_size), k1 = load_pairs(b.keys[1], p * block_size);
      for (int r = 0; r < kRows; ++r) {
        const __m512i qp = _mm512_set1_epi32(static_cast<int>(q[r * (d / 2) + p]));
        acc[r][0] = dot(acc[r][0], qp, k0);
        acc[r][1] = dot(acc[r][1], qp, k1);
      }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int r = 0; r < kRows; ++r) {
      _mm512_storeu_ps(scores + r * kKeys, _mm512_mul_ps(acc[r][0], s));
      _mm512_storeu_ps(scores + r * kKeys + 16, _mm512_mul_ps(acc[r][1], s));
    }
  }

  static void pack_probs(const float* x, Packed* p) {
    for (int64_t j = 0; j < kKeys; j += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(p) + j), bf16(_mm512_loadu_ps(x + j)));
  }

  template <int kRows>
  static void output_tile(const Packed* p, const float* rescale, const KeyBlock<Cached>& b, int64_t d, float* out) {
    for (int64_t dim0 = 0; dim0 < d; dim0 += 64)
      with_vectors((d - dim0) / 16, [&](auto vectors) { output_piece<kRows, decltype(vectors)::value>(p, rescale, b, d, dim0, out); });
  }

  // kVectors vectors of 16 dimensions from dim0 (a compile-time count, so that the accumulators stay in registers).
  template <int kRows, int kVectors>
  static void output_piece(const Packed* p, const float* rescale, const KeyBlock<Cached>& b, int64_t d, int64_t dim0, float* out) {
    __m512 acc[kRows][kVectors];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kVectors; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(out + r * d + dim0 + 16 * c), _mm512_set1_ps(rescale[r]));
    for (int64_t pair = 0; pair < kKeys / 2; ++pair) {
      const int64_t first = pair % (kGroup / 2) * d + dim0;  // the pair's values, within its group
      __m512i v[kVectors];
      for (int c = 0; c < kVectors; ++c) v[c] = load_pairs(b.values[pair / (kGroup / 2)], first + 16 * c);
      for (int r = 0; r < kRows; ++r) {
        const __m512i pp = _mm512_set1_epi32(static_cast<int>(p[r * (kKeys / 2) + pair]));
        for (int c = 0; c < kVectors; ++c) acc[r][c] = dot(acc[r][c], pp, v[c]);
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kVectors; ++c) _mm512_storeu_ps(out + r * d + dim0 + 16 * c, acc[r][c]);
  }
};
#endif

// exp(x - max) of 32 scores in place (-inf → 0); returns their sum, in a fixed order.
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

// x[j] = -inf for j outside [lo, hi); returns the largest x[j] inside (-inf if none), 8 lanes at a time.
inline float mask_block(float* x, int64_t lo, int64_t hi) {
  const __m256i low = _mm256_set1_epi32(static_cast<int>(lo)), high = _mm256_set1_epi32(static_cast<int>(hi));
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  __m256 max = neg_inf;
  for (int j = 0; j < kKeys; j += 8) {
    const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i inside = _mm256_andnot_si256(_mm256_cmpgt_epi32(low, index), _mm256_cmpgt_epi32(high, index));  // lo <= j < hi
    const __m256 v = _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(x + j), _mm256_castsi256_ps(inside));
    _mm256_storeu_ps(x + j, v);
    max = _mm256_max_ps(max, v);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(max), _mm256_extractf128_ps(max, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

// One entry of the call: `count` query rows from flat row `row`, at positions first .. first + count - 1, whose
// context (positions 0 .. first + count - 1) lives in the cache blocks of `table`.
struct Entry {
  int64_t row, count, first;
  const int64_t* table;
};

struct Cache {
  int64_t kv_heads, slots, d, block_size, window;
};

// Keys a query at `pos` may see: lowest_key(pos) .. pos.
inline int64_t lowest_key(int64_t pos, int64_t window) { return window > 0 ? std::max<int64_t>(pos - window + 1, 0) : 0; }

// Block `block` of 32 keys of entry e's context in KV head h's cache. A group wholly past the context stands in
// for itself with the block's first group: its scores are masked and its probabilities zero.
template <typename T>
KeyBlock<T> key_block(const T* k_cache, const T* v_cache, const Entry& e, const Cache& c, int64_t h, int64_t block) {
  KeyBlock<T> b;
  for (int g = 0; g < 2; ++g) {
    const int64_t pos = block * kKeys + (block * kKeys + g * kGroup < e.first + e.count ? g * kGroup : 0);
    const int64_t start = (h * c.slots + e.table[pos / c.block_size] * c.block_size) * c.d, offset = pos % c.block_size;
    b.keys[g] = k_cache + start + key_offset<T>(offset, 0, c.block_size);  // the group's first key, dimension 0
    b.values[g] = v_cache + start + value_offset<T>(offset, 0, c.d);
  }
  return b;
}

template <typename P>
struct Scratch {
  std::vector<typename P::Packed> q, p;
  std::vector<float> out, scores, max, sum, rescale;
};

// fn(std::integral_constant<int, rows>) for a tile of up to `rows` query rows: the smaller tile where it covers them.
template <int kMax, typename Fn>
inline void with_tile(int64_t rows, Fn&& fn) {
  if (kMax > 4 && rows <= 4) fn(std::integral_constant<int, 4>{});
  else fn(std::integral_constant<int, kMax>{});
}

// Query rows [i0, i1) of entry e (positions e.first + i), the `group` query heads of KV head h.
template <typename P>
void attend_item(const float* q, int64_t q_row_stride, float* out, int64_t out_row_stride, const typename P::Cached* k_cache,
                 const typename P::Cached* v_cache, const Entry& e, const Cache& c, int64_t h, int64_t group, int64_t i0, int64_t i1, float scale,
                 Scratch<P>& s) {
  const int64_t d = c.d, rows = (i1 - i0) * group, qe = P::query_elems(d);
  constexpr int64_t kTile = std::max(P::kScoreRows, P::kOutputRows);
  const int64_t padded = (rows + kTile - 1) / kTile * kTile;  // whole tiles of either size
  s.q.assign(padded * qe, 0);
  s.p.assign(padded * P::kProbElems, 0);
  s.out.assign(padded * d, 0.f);
  s.scores.resize(padded * kKeys);
  s.max.assign(padded, kNegInf);
  s.sum.assign(padded, 0.f);
  s.rescale.assign(padded, 1.f);
  // Row r: position i0 + r / group, query head h * group + r % group.
  for (int64_t r = 0; r < rows; ++r) P::pack_query(q + (e.row + i0 + r / group) * q_row_stride + (h * group + r % group) * d, d, s.q.data() + r * qe);
  const int64_t end = e.first + i1;
  for (int64_t block = lowest_key(e.first + i0, c.window) / kKeys; block * kKeys < end; ++block) {
    const int64_t key0 = block * kKeys;
    const KeyBlock<typename P::Cached> b = key_block(k_cache, v_cache, e, c, h, block);
    with_tile<P::kScoreRows>(rows, [&](auto tile) {
      constexpr int kRows = decltype(tile)::value;
      for (int64_t r = 0; r < rows; r += kRows) P::template score_tile<kRows>(s.q.data() + r * qe, b, c.block_size, d, scale, s.scores.data() + r * kKeys);
    });
    for (int64_t r = 0; r < rows; ++r) {
      float* x = s.scores.data() + r * kKeys;
      const int64_t pos = e.first + i0 + r / group;
      // Keys key0 + j visible from pos: j in [lo, hi).
      const int64_t lo = std::clamp<int64_t>(lowest_key(pos, c.window) - key0, 0, kKeys), hi = std::clamp<int64_t>(pos + 1 - key0, 0, kKeys);
      const float block_max = mask_block(x, lo, hi);
      const float new_max = std::max(s.max[r], block_max);
      if (new_max == kNegInf) {  // nothing visible yet: no probabilities, nothing to rescale
        std::fill_n(x, kKeys, 0.f);
        s.rescale[r] = 1.f;
      } else {
        s.rescale[r] = std::exp(s.max[r] - new_max);  // 0 on the first visible block (max was -inf), 1 if unchanged
        s.sum[r] = s.sum[r] * s.rescale[r] + exp_block(x, new_max);
        s.max[r] = new_max;
      }
      P::pack_probs(x, s.p.data() + r * P::kProbElems);
    }
    with_tile<P::kOutputRows>(rows, [&](auto tile) {
      constexpr int kRows = decltype(tile)::value;
      for (int64_t r = 0; r < rows; r += kRows)
        P::template output_tile<kRows>(s.p.data() + r * P::kProbElems, s.rescale.data() + r, b, d, s.out.data() + r * d);
    });
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* y = out + (e.row + i0 + r / group) * out_row_stride + (h * group + r % group) * d;
    const float inverse = 1.f / s.sum[r];
    for (int64_t i = 0; i < d; ++i) y[i] = s.out[r * d + i] * inverse;
  }
}

template <typename P>
void attention(const float* q, int64_t q_row_stride, int64_t heads, const typename P::Cached* k_cache, const typename P::Cached* v_cache,
               const std::vector<Entry>& entries, const Cache& c, float scale, float* y) {
  const int64_t group = heads / c.kv_heads, positions = std::max<int64_t>(kQueryRows / group, 1);
  struct Item {
    int64_t entry, h, i0, i1;
  };
  std::vector<Item> items;
  for (int64_t b = 0; b < static_cast<int64_t>(entries.size()); ++b) {
    const Entry& e = entries[b];
    for (int64_t i = (e.count + positions - 1) / positions - 1; i >= 0; --i)  // the latest positions (most keys) first
      for (int64_t h = 0; h < c.kv_heads; ++h) items.push_back({b, h, i * positions, std::min(e.count, (i + 1) * positions)});
  }
  parallel_chunks(static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch<P> scratch;
    for (int64_t n = begin; n < end; ++n) {
      const Item& it = items[n];
      attend_item<P>(q, q_row_stride, y, heads * c.d, k_cache, v_cache, entries[it.entry], c, it.h, group, it.i0, it.i1, scale, scratch);
    }
  });
}

// q [T, heads, D] float32 (rows of any stride; heads and dimensions contiguous); caches [kv_heads, slots, D] (kv_cache.h);
// block_tables [B, max_blocks] int64; entry b's query rows are query_start[b] .. + query_count[b] - 1 of q, at
// positions first_position[b] onwards, and its context is positions 0 .. first_position[b] + query_count[b] - 1,
// position p in slot block_tables[b][p / block_size] * block_size + p % block_size. window: a query at p attends
// to keys p - window < j <= p (0: every j <= p). Every row of q belongs to one entry. Returns [T, heads * D].
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                           int64_t block_size, const at::Tensor& query_start, const at::Tensor& query_count, const at::Tensor& first_position,
                           int64_t window, double scale) {
  check_kv_caches(k_cache, v_cache, block_size);
  const int64_t kv_heads = k_cache.size(0), slots = k_cache.size(1), d = k_cache.size(2);
  TORCH_CHECK(d % 8 == 0, "head_dim must be a multiple of 8, got ", d);
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.size(2) == d && q.stride(2) == 1 && q.stride(1) == d && q.size(1) % kv_heads == 0,
              "q must be a float32 [T, heads, head_dim] tensor, heads a multiple of the cache's KV heads, each row's heads contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(), "block_tables must be a contiguous [B, blocks] int64 tensor");
  const int64_t batch = block_tables.size(0), num_q = q.size(0), heads = q.size(1);
  for (const at::Tensor* t : {&query_start, &query_count, &first_position})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == batch && t->scalar_type() == at::kLong && t->is_contiguous(),
                "query_start, query_count and first_position must be contiguous int64 [B] tensors, B = block_tables' rows");
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");
  const int64_t *start = query_start.data_ptr<int64_t>(), *count = query_count.data_ptr<int64_t>(), *first = first_position.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  std::vector<Entry> entries(batch);
  int64_t covered = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(count[b] >= 1 && start[b] >= 0 && start[b] + count[b] <= num_q && first[b] >= 0, "entry ", b, "'s query rows ", start[b], " + ",
                count[b], " must lie within q's ", num_q, " rows");
    TORCH_CHECK(first[b] + count[b] <= block_tables.size(1) * block_size, "entry ", b, "'s context of ", first[b] + count[b],
                " positions is longer than its block table");
    const int64_t* table = tables + b * block_tables.size(1);
    for (int64_t i = 0; i < (first[b] + count[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(table[i] >= 0 && (table[i] + 1) * block_size <= slots, "block ", table[i], " is outside the cache's ", slots, " slots");
    entries[b] = {start[b], count[b], first[b], table};
    covered += count[b];
  }
  TORCH_CHECK(covered == num_q, "the entries' query rows must cover q's ", num_q, " rows once each, they cover ", covered);
  at::Tensor out = at::empty({num_q, heads * d}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (num_q == 0) return out;
  const Cache c{kv_heads, slots, d, block_size, window};
  const float* qp = q.data_ptr<float>();
  float* y = out.data_ptr<float>();
  if (k_cache.scalar_type() == at::kBFloat16) {
#ifdef __AVX512BF16__
    TORCH_CHECK(d % 16 == 0, "a bfloat16 cache needs head_dim a multiple of 16, got ", d);
    attention<Bf16Products>(qp, q.stride(0), heads, k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), entries, c, static_cast<float>(scale), y);
#else
    TORCH_CHECK(false, "a bfloat16 cache needs a CPU with AVX512-BF16 (tokenloop.kernels.bfloat16_cache_supported)");
#endif
  } else if (k_cache.scalar_type() == at::kHalf) {
    attention<F32Products<at::Half>>(qp, q.stride(0), heads, k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(), entries, c, static_cast<float>(scale), y);
  } else {
    attention<F32Products<float>>(qp, q.stride(0), heads, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), entries, c, static_cast<float>(scale), y);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloop, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, int block_size, Tensor query_start, Tensor query_count, "
        "Tensor first_position, int window, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloop, CPU, m) { m.impl("paged_attention", &paged_attention); }
