// Attention straight from the paged KV cache, for every query of a step: prompt chunks, decodes and draft rows to
// verify alike. Each query row's output is one fixed sequence of floating-point operations that depends only on
// the row, its position and its context: never on how many queries share the call, which rows are beside it, how
// its prompt was chunked, or how many threads run. So a token gets the same floats prefilled in a chunk of 1,000 as
// decoded alone, and a request the same tokens whatever else is in the batch.
//
// The order, per query row: its context in partitions of 512 keys aligned to absolute positions (keys 0..511,
// 512..1023, ...), each in blocks of 32 keys (0..31, 32..63, ...), in increasing order; per block, the scores (a
// fixed sum over the head's dimensions), then flash attention's online softmax (a running maximum and sum, the
// output rescaled when the maximum grows), then the probabilities times the values (a fixed sum over the block's
// keys); then the partitions' outputs, maxima and sums folded in increasing order (flash decoding's reduction), and
// the output divided by the sum. A block that the row may not see at all (past its position, or before its sliding
// window) changes nothing: its probabilities are exact zeros and its rescale factor exactly 1; a partition it
// cannot see is not folded. Work items (entry, KV head, block of query positions, and one or all partitions) may
// therefore start at any block and cover any rows, and a few long rows (decodes) split among the threads.
//
// The products: on a bfloat16 cache (CPUs with AVX512-BF16), AVX512-BF16's vdpbf16ps on queries and probabilities
// rounded to bfloat16 and the cache's keys and values (32 multiply-adds an instruction), sums in float32; on a
// float16 or float32 cache, float32 FMAs (the exact float32 path); on an int8 cache, exact integer sums of int8
// queries and int16 probabilities times the int8 keys and values (Int8Products). Each reads keys and values where they
// are in the cache, whose blocks are laid out for these products (kv_cache.h): nothing is copied or converted per
// step but the queries.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "aoti_shims.h"
#include "kv_cache.h"
#include "parallel.h"

namespace {

constexpr int64_t kKeys = 32;       // keys per block, aligned to absolute positions
constexpr int64_t kGroup = 16;      // consecutive keys per group: a block's keys are two groups
constexpr int64_t kQueryRows = 64;  // query rows (positions x query heads of a KV head) per work item
// Keys per partition of a row's context, aligned to absolute positions: each partition's attention is computed on its
// own and the partitions folded in order (flash decoding), so that a few long rows split among the threads.
constexpr int64_t kPartitionKeys = 512;
constexpr int64_t kAhead = 2;  // blocks a row's products prefetch ahead
constexpr int64_t kItemsPerThread = 4;  // fewer items of whole rows than this a thread: an item per partition
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The largest of v's 8 lanes.
inline float max_of(__m256 v) {
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

// exp's constants (ATen's exp_u20): ln(FLT_MIN), ln(FLT_MAX), log2(e), ln(2) by their bits; 1/k! for the polynomial.
constexpr float kLnFltMin = std::bit_cast<float>(0xc2aeac50u), kLnFltMax = std::bit_cast<float>(0x42b17218u);
constexpr float kLog2e = std::bit_cast<float>(0x3fb8aa3bu), kLn2 = std::bit_cast<float>(0x3f317218u);
constexpr float kExpC1 = 0.999999701f, kExpC2 = 0.499991506f, kExpC3 = 0.166676521f, kExpC4 = 0.0418978221f, kExpC5 = 0.00828929059f;

// Float32 vectors of 8 lanes (AVX2) and of 16 (AVX-512), loading float32, float16 or int32 elements. Every lane
// computes on its own (one key's score, one dimension's output), so both widths give the same floats.
struct Lanes8 {
  using V = __m256;
  static constexpr int kLanes = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const int32_t* p) { return _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  // exp(x) as ATen's exp_u20 (a degree-5 polynomial of the remainder after ln 2's; 0 below ln(FLT_MIN)).
  static V exp(V x) {
    const V below = _mm256_cmp_ps(x, _mm256_set1_ps(kLnFltMin), _CMP_LT_OS);
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(kLnFltMax)), _mm256_set1_ps(kLnFltMin));
    const V n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
    const V r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2), x);
    V y = _mm256_fmadd_ps(r, _mm256_set1_ps(kExpC5), _mm256_set1_ps(kExpC4));
    for (const float c : {kExpC3, kExpC2, kExpC1, 1.f}) y = _mm256_fmadd_ps(r, y, _mm256_set1_ps(c));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(_mm256_sub_ps(n, _mm256_set1_ps(1.f))), _mm256_set1_epi32(127)), 23);
    const V two_n = _mm256_blendv_ps(_mm256_castsi256_ps(bits), _mm256_setzero_ps(), below);  // 2^(n - 1)
    return _mm256_mul_ps(_mm256_mul_ps(y, two_n), _mm256_set1_ps(2.f));
  }
};

#ifdef __AVX512F__
struct Lanes16 {
  using V = __m512;
  static constexpr int kLanes = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const int32_t* p) { return _mm512_cvtepi32_ps(_mm512_loadu_si512(p)); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V exp(V x) {  // Lanes8::exp's operations, lane by lane
    const __mmask16 below = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kLnFltMin), _CMP_LT_OS);
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(kLnFltMax)), _mm512_set1_ps(kLnFltMin));
    const V n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const V r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2), x);
    V y = _mm512_fmadd_ps(r, _mm512_set1_ps(kExpC5), _mm512_set1_ps(kExpC4));
    for (const float c : {kExpC3, kExpC2, kExpC1, 1.f}) y = _mm512_fmadd_ps(r, y, _mm512_set1_ps(c));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(_mm512_sub_ps(n, _mm512_set1_ps(1.f))), _mm512_set1_epi32(127)), 23);
    const V two_n = _mm512_mask_blend_ps(below, _mm512_castsi512_ps(bits), _mm512_setzero_ps());  // 2^(n - 1)
    return _mm512_mul_ps(_mm512_mul_ps(y, two_n), _mm512_set1_ps(2.f));
  }
};
using WideLanes = Lanes16;  // 32 registers: 4 query rows a tile
#else
using WideLanes = Lanes8;  // 16 registers: 2 query rows a tile
#endif

// fn(std::integral_constant<int, v>) for v = min(n, 4) vectors (n >= 1).
template <typename Fn>
inline void with_vectors(int64_t n, Fn&& fn) {
  if (n >= 4) fn(std::integral_constant<int, 4>{});
  else if (n == 3) fn(std::integral_constant<int, 3>{});
  else if (n == 2) fn(std::integral_constant<int, 2>{});
  else fn(std::integral_constant<int, 1>{});
}

// One block of 32 keys in the cache: its two groups of 16 consecutive positions, each within one cache block
// (block_size is a multiple of 16), at their first key's place in the block's keys and in its values (and, in an
// int8 cache, in their scales).
template <typename T>
struct KeyBlock {
  const T* keys[2];
  const T* values[2];
  const at::Half* key_scales[2];
  const at::Half* value_scales[2];
};

// Key k (0..31) of a block, from one of its groups' pointers.
template <typename T>
inline const T* key_at(const T* const (&groups)[2], int64_t k) { return groups[k / kGroup] + k % kGroup; }

// Float32 products from a float16 or float32 cache, on the widest float vectors the CPU has (the same floats on
// any): per dimension, one broadcast query value times the block's 32 keys; per key, one broadcast probability
// times its value's dimensions.
template <typename T>
struct F32Products {
  using L = WideLanes;
  using V = typename L::V;
  static constexpr int kKeyVectors = kKeys / L::kLanes;
  using Cached = T;
  using PackedQuery = float;  // queries and probabilities as the products take them
  using PackedProbs = float;
  static constexpr int kScoreRows = 64 / L::kLanes;   // query rows per tile of scores: 4 x 2 (or 2 x 4) accumulators
  static constexpr int kOutputRows = 64 / L::kLanes;  // query rows per tile of outputs: up to 4 vectors of dimensions each
  static int64_t query_elems(int64_t d) { return d; }
  static constexpr int64_t kProbElems = kKeys;

  static void pack_query(const float* x, int64_t d, PackedQuery* out) { std::copy(x, x + d, out); }

  // scores [kRows][32] = scale * q . k, each score summed over the dimensions in order.
  template <int kRows>
  static void score_tile(const PackedQuery* q, const KeyBlock<T>& b, int64_t block_size, int64_t d, float scale, float* scores) {
    V acc[kRows][kKeyVectors];
    for (auto& row : acc)
      for (auto& a : row) a = L::zero();
    for (int64_t i = 0; i < d; ++i) {
      V k[kKeyVectors];
      for (int c = 0; c < kKeyVectors; ++c) k[c] = L::load(key_at(b.keys, c * L::kLanes) + i * block_size);
      for (int r = 0; r < kRows; ++r) {
        const V qv = L::set1(q[r * d + i]);
        for (int c = 0; c < kKeyVectors; ++c) acc[r][c] = L::fmadd(qv, k[c], acc[r][c]);
      }
    }
    const V s = L::set1(scale);
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kKeyVectors; ++c) L::store(scores + r * kKeys + c * L::kLanes, L::mul(acc[r][c], s));
  }

  static void pack_probs(const float* x, const KeyBlock<T>&, PackedProbs* p) { std::copy(x, x + kKeys, p); }

  // out [kRows][D] = out * rescale + p . v, each sum over the block's keys in order; dimensions in pieces of up to
  // 4 wide vectors, and a last piece of 8 where D is not a multiple of the wide vector (D is one of 8).
  template <int kRows>
  static void output_tile(const PackedProbs* p, const float* rescale, const KeyBlock<T>& b, int64_t d, float* out) {
    const int64_t wide = d / L::kLanes * L::kLanes;
    for (int64_t dim0 = 0; dim0 < wide; dim0 += 4 * L::kLanes)
      with_vectors((wide - dim0) / L::kLanes, [&](auto vectors) { output_piece<L, kRows, decltype(vectors)::value>(p, rescale, b, d, dim0, out); });
    if (wide < d) output_piece<Lanes8, kRows, 1>(p, rescale, b, d, wide, out);
  }

  // kVectors vectors of W dimensions from dim0 (a compile-time count: with a runtime one, gcc keeps the
  // accumulators on the stack).
  template <typename W, int kRows, int kVectors>
  static void output_piece(const PackedProbs* p, const float* rescale, const KeyBlock<T>& b, int64_t d, int64_t dim0, float* out) {
    typename W::V acc[kRows][kVectors];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kVectors; ++c) acc[r][c] = W::mul(W::load(out + r * d + dim0 + W::kLanes * c), W::set1(rescale[r]));
    for (int64_t j = 0; j < kKeys; ++j) {
      const T* value = b.values[j / kGroup] + (j % kGroup) * d + dim0;
      typename W::V v[kVectors];
      for (int c = 0; c < kVectors; ++c) v[c] = W::load(value + W::kLanes * c);
      for (int r = 0; r < kRows; ++r) {
        const typename W::V pj = W::set1(p[r * kKeys + j]);
        for (int c = 0; c < kVectors; ++c) acc[r][c] = W::fmadd(pj, v[c], acc[r][c]);
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kVectors; ++c) W::store(out + r * d + dim0 + W::kLanes * c, acc[r][c]);
  }
};

// Products for an int8 cache, in integers: each query row rounded to int8 (its own scale, max |q| / 127) and times
// the cache's int8 keys as exact integer sums over quadruples of dimensions (AVX512-VNNI's vpdpbusd: 16 lanes of
// four byte products an instruction; it multiplies unsigned bytes by signed ones, so the keys, read with their top
// bit flipped, are k + 128, and 128 * sum q comes off); each block's probabilities times their values' scales
// rounded to int16 (a scale per row and block) and times the int8 values as exact integer sums over pairs of keys
// (vpdpwssd: 16 lanes of two int16 products); the sums then scaled back in float32. An integer sum is the same
// whatever computes it: without AVX512-VNNI, a plain loop does. Query rows: d / 4 quadruples, the scale's bits,
// 128 * sum q; probabilities: 16 pairs, the scale's bits. Needs head_dim a multiple of 16, at most 256 (the sums
// stay within int32).
struct Int8Products {
  using Cached = int8_t;
  using PackedQuery = uint32_t;
  using PackedProbs = uint32_t;
  static constexpr int kScoreRows = 4;   // 4 x 2 accumulators
  static constexpr int kOutputRows = 4;  // 4 x 4 accumulators of 16 dimensions
  static int64_t query_elems(int64_t d) { return d / 4 + 2; }
  static constexpr int64_t kProbElems = kKeys / 2 + 1;

  // The largest |x_i| of n values (a multiple of 8).
  static float abs_max(const float* x, int64_t n) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 amax = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    return max_of(amax);
  }

  // x[0..8) * inverse, rounded half to even.
  static __m256i rounded(const float* x, __m256 inverse) {
    return _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x), inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }

  // x's n values (a multiple of 8) as int16 (pairs of them per uint32), x_i ~ q_i * scale with scale = max |x| /
  // 32767, q_i = x_i * (32767 / max |x|) rounded half to even; the scale's bits after them.
  static void to_int16(const float* x, int64_t n, uint32_t* out) {
    const float top = abs_max(x, n), scale = top / 32767.f;
    int16_t* values = reinterpret_cast<int16_t*>(out);
    if (top > 0.f) {
      const __m256 inverse = _mm256_set1_ps(32767.f / top);
      for (int64_t i = 0; i < n; i += 8) {
        const __m256i q32 = rounded(x + i, inverse);  // |q| <= 32767 (+ a rounding): packs saturates
        _mm_storeu_si128(reinterpret_cast<__m128i*>(values + i), _mm_packs_epi32(_mm256_castsi256_si128(q32), _mm256_extracti128_si256(q32, 1)));
      }
    } else {
      std::fill_n(values, n, int16_t{0});
    }
    std::memcpy(out + n / 2, &scale, sizeof(float));
  }

  static float scale_of(const uint32_t* packed, int64_t words) {
    float scale;
    std::memcpy(&scale, packed + words, sizeof(float));
    return scale;
  }

  // The query row x's d values as int8 (four per uint32), x_i ~ q_i * scale with scale = max |x| / 127, q_i = x_i *
  // (127 / max |x|) rounded half to even; then the scale's bits and 128 * sum q.
  static void pack_query(const float* x, int64_t d, PackedQuery* out) {
    const float top = abs_max(x, d), scale = top / 127.f;
    int8_t* values = reinterpret_cast<int8_t*>(out);
    int32_t sum = 0;
    if (top > 0.f) {
      const __m256 inverse = _mm256_set1_ps(127.f / top);
      for (int64_t i = 0; i < d; i += 8) {
        alignas(32) int32_t q32[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(q32), rounded(x + i, inverse));
        for (int j = 0; j < 8; ++j) {
          values[i + j] = static_cast<int8_t>(std::clamp(q32[j], -127, 127));  // |q| <= 127 (+ a rounding)
          sum += values[i + j];
        }
      }
    } else {
      std::fill_n(values, d, int8_t{0});
    }
    std::memcpy(out + d / 4, &scale, sizeof(float));
    const int32_t offset = 128 * sum;
    std::memcpy(out + d / 4 + 1, &offset, sizeof(int32_t));
  }

  // scores [kRows][32] = (sum_i q_i k_i) * (q scale * scale) * k scale.
  template <int kRows>
  static void score_tile(const PackedQuery* q, const KeyBlock<int8_t>& b, int64_t block_size, int64_t d, float scale, float* scores) {
    const int64_t qe = query_elems(d);
    alignas(64) int32_t dots[kRows][kKeys];
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512i acc[kRows][2];
    for (auto& row : acc) row[0] = row[1] = _mm512_setzero_si512();
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t p = 0; p < d / 4; ++p) {
      __m512i k[2];  // per group, its 16 keys' dimensions 4p .. 4p + 3, plus 128 (unsigned)
      for (int g = 0; g < 2; ++g) k[g] = _mm512_xor_si512(_mm512_loadu_si512(b.keys[g] + p * block_size * 4), flip);
      for (int r = 0; r < kRows; ++r) {
        const __m512i qp = _mm512_set1_epi32(static_cast<int>(q[r * qe + p]));
        for (int g = 0; g < 2; ++g) acc[r][g] = _mm512_dpbusd_epi32(acc[r][g], k[g], qp);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      const __m512i offset = _mm512_set1_epi32(static_cast<int>(q[r * qe + d / 4 + 1]));
      for (int g = 0; g < 2; ++g) _mm512_store_si512(dots[r] + 16 * g, _mm512_sub_epi32(acc[r][g], offset));
    }
#else
    for (int r = 0; r < kRows; ++r) {
      const int8_t* qr = reinterpret_cast<const int8_t*>(q + r * qe);
      for (int64_t j = 0; j < kKeys; ++j) {
        int32_t dot = 0;
        for (int64_t i = 0; i < d; ++i) dot += qr[i] * b.keys[j / kGroup][key_offset<int8_t>(j % kGroup, i, block_size)];
        dots[r][j] = dot;
      }
    }
#endif
    using L = WideLanes;
    for (int r = 0; r < kRows; ++r) {
      const typename L::V coefficient = L::set1(scale_of(q + r * qe, d / 4) * scale);
      for (int64_t j = 0; j < kKeys; j += L::kLanes)
        L::store(scores + r * kKeys + j, L::mul(L::mul(L::load(dots[r] + j), coefficient), L::load(key_at(b.key_scales, j))));
    }
  }

  // The probabilities times their values' scales, as int16 pairs of keys and a scale.
  static void pack_probs(const float* x, const KeyBlock<int8_t>& b, PackedProbs* p) {
    using L = WideLanes;
    alignas(64) float scaled[kKeys];
    for (int64_t j = 0; j < kKeys; j += L::kLanes) L::store(scaled + j, L::mul(L::load(x + j), L::load(key_at(b.value_scales, j))));
    to_int16(scaled, kKeys, p);
  }

  // out [kRows][D] = out * rescale + (sum_j p_j v_j) * p scale, each sum over the block's keys in integers.
  template <int kRows>
  static void output_tile(const PackedProbs* p, const float* rescale, const KeyBlock<int8_t>& b, int64_t d, float* out) {
    for (int64_t dim0 = 0; dim0 < d; dim0 += 64)
      with_vectors((d - dim0) / 16, [&](auto vectors) { output_piece<kRows, decltype(vectors)::value>(p, rescale, b, d, dim0, out); });
  }

  template <int kRows, int kVectors>
  static void output_piece(const PackedProbs* p, const float* rescale, const KeyBlock<int8_t>& b, int64_t d, int64_t dim0, float* out) {
    alignas(64) int32_t sums[kRows][kVectors * 16];
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512i acc[kRows][kVectors];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_si512();
    for (int64_t pair = 0; pair < kKeys / 2; ++pair) {
      const int8_t* first = b.values[pair / (kGroup / 2)] + (pair % (kGroup / 2) * d + dim0) * 2;  // the pair's values
      __m512i v[kVectors];
      for (int c = 0; c < kVectors; ++c) v[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + 32 * c)));
      for (int r = 0; r < kRows; ++r) {
        const __m512i pp = _mm512_set1_epi32(static_cast<int>(p[r * kProbElems + pair]));
        for (int c = 0; c < kVectors; ++c) acc[r][c] = _mm512_dpwssd_epi32(acc[r][c], v[c], pp);
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kVectors; ++c) _mm512_store_si512(sums[r] + 16 * c, acc[r][c]);
#else
    for (int r = 0; r < kRows; ++r) {
      const int16_t* pr = reinterpret_cast<const int16_t*>(p + r * kProbElems);
      for (int64_t i = 0; i < kVectors * 16; ++i) {
        int32_t sum = 0;
        for (int64_t j = 0; j < kKeys; ++j) sum += pr[j] * b.values[j / kGroup][value_offset<int8_t>(j % kGroup, dim0 + i, d)];
        sums[r][i] = sum;
      }
    }
#endif
    using L = WideLanes;
    for (int r = 0; r < kRows; ++r) {
      const typename L::V coefficient = L::set1(scale_of(p + r * kProbElems, kKeys / 2)), keep = L::set1(rescale[r]);
      for (int64_t i = 0; i < kVectors * 16; i += L::kLanes) {
        float* y = out + r * d + dim0 + i;
        L::store(y, L::add(L::mul(L::load(y), keep), L::mul(L::load(sums[r] + i), coefficient)));
      }
    }
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
  using PackedQuery = uint32_t;
  using PackedProbs = uint32_t;
  static constexpr int kScoreRows = 8;   // 8 x 2 accumulators
  static constexpr int kOutputRows = 4;  // 4 x 4 accumulators of 16 dimensions
  static int64_t query_elems(int64_t d) { return d / 2; }
  static constexpr int64_t kProbElems = kKeys / 2;

  static void pack_query(const float* x, int64_t d, PackedQuery* out) {
    for (int64_t i = 0; i < d; i += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(out) + i), bf16(_mm512_loadu_ps(x + i)));
  }

  template <int kRows>
  static void score_tile(const PackedQuery* q, const KeyBlock<Cached>& b, int64_t block_size, int64_t d, float scale, float* scores) {
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

  static void pack_probs(const float* x, const KeyBlock<Cached>&, PackedProbs* p) {
    for (int64_t j = 0; j < kKeys; j += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(p) + j), bf16(_mm512_loadu_ps(x + j)));
  }

  template <int kRows>
  static void output_tile(const PackedProbs* p, const float* rescale, const KeyBlock<Cached>& b, int64_t d, float* out) {
    for (int64_t dim0 = 0; dim0 < d; dim0 += 64)
      with_vectors((d - dim0) / 16, [&](auto vectors) { output_piece<kRows, decltype(vectors)::value>(p, rescale, b, d, dim0, out); });
  }

  // kVectors vectors of 16 dimensions from dim0 (a compile-time count, so that the accumulators stay in registers).
  template <int kRows, int kVectors>
  static void output_piece(const PackedProbs* p, const float* rescale, const KeyBlock<Cached>& b, int64_t d, int64_t dim0, float* out) {
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

// exp(x - max) of 32 scores in place (-inf → 0); returns their sum, in a fixed order on any vector width.
float exp_block(float* x, float max) {
  using L = WideLanes;
  for (int64_t j = 0; j < kKeys; j += L::kLanes) L::store(x + j, L::exp(L::add(L::load(x + j), L::set1(-max))));
  // Lane i of 8: exps i, i + 8, i + 16, i + 24 in turn; then the 8 lanes in turn.
  __m256 lanes = _mm256_loadu_ps(x);
  for (int64_t j = 8; j < kKeys; j += 8) lanes = _mm256_add_ps(lanes, _mm256_loadu_ps(x + j));
  alignas(32) float parts[8];
  _mm256_store_ps(parts, lanes);
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
  return max_of(max);
}

// One entry of the call: `count` query rows from flat row `row`, at positions first .. first + count - 1, whose
// context (positions 0 .. first + count - 1) lives in the cache blocks of `table`.
struct Entry {
  int64_t row, count, first;
  const int64_t* table;
};

struct Cache {
  int64_t kv_heads, slots, d, width, block_size, window;  // width: a row's elements (d, or d + 2 in an int8 cache)
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
    const int64_t start = (h * c.slots + e.table[pos / c.block_size] * c.block_size) * c.width, offset = pos % c.block_size;
    b.keys[g] = k_cache + start + key_offset<T>(offset, 0, c.block_size);  // the group's first key, dimension 0
    b.values[g] = v_cache + start + value_offset<T>(offset, 0, c.d);
    if constexpr (std::is_same_v<T, int8_t>) {
      b.key_scales[g] = block_scales(k_cache + start, c.block_size, c.d) + offset;
      b.value_scales[g] = block_scales(v_cache + start, c.block_size, c.d) + offset;
    }
  }
  return b;
}

// Asks for the cache line at p to be brought into L2 (into L1, prefetcht0, more misses wait for a slot). As inline
// assembly: GCC deletes a loop of __builtin_prefetch, which it counts as having no side effects.
inline void prefetch(const void* p) { asm volatile("prefetcht1 (%0)" : : "r"(p)); }

// Asks for block b's keys and values (and an int8 block's scales) to be brought in while the block before it is
// computed: on a long context, the products and the reads from memory then overlap, where without it they took
// turns (one 4,000-token row: about a quarter less time, int8 or bfloat16).
template <typename T>
inline void prefetch_block(const KeyBlock<T>& b, const Cache& c) {
  constexpr int64_t e = kKeyWidth<T>;
  const int64_t group_bytes = kGroup * c.d * static_cast<int64_t>(sizeof(T));  // a group's keys, or values
  const int64_t key_run = kGroup * e * static_cast<int64_t>(sizeof(T));  // a group's keys per element (pair)
  for (int g = 0; g < 2; ++g) {
    const char* keys = reinterpret_cast<const char*>(b.keys[g]);
    const char* values = reinterpret_cast<const char*>(b.values[g]);
    if (c.block_size == kGroup) {  // the group's keys are the block's: contiguous
      for (int64_t i = 0; i < group_bytes; i += 64) prefetch(keys + i);
    } else {
      const int64_t stride = c.block_size * e * static_cast<int64_t>(sizeof(T));
      for (int64_t i = 0; i < c.d / e; ++i) prefetch(keys + i * stride), prefetch(keys + i * stride + key_run - 1);
    }
    for (int64_t i = 0; i < group_bytes; i += 64) prefetch(values + i);
    if constexpr (std::is_same_v<T, int8_t>) {
      prefetch(b.key_scales[g]);
      prefetch(b.value_scales[g]);
    }
  }
}

// Rows' attention over their partitions folded so far, in increasing order: per row the output (d floats, not yet
// divided by the sum), the largest score (-inf before a visible partition) and the sum of exp(score - max).
// A partition's own attention has the same form; folding one adds it to those before it: the same floats wherever
// each partition was computed.
struct Folded {
  std::vector<float> out, max, sum;

  void reset(int64_t rows, int64_t d) {
    out.resize(rows * d);
    max.assign(rows, kNegInf);
    sum.assign(rows, 0.f);
  }

  // Row r's next partition: its output `part_out`, its largest score and its sum.
  void fold(int64_t r, int64_t d, const float* part_out, float part_max, float part_sum) {
    if (part_max == kNegInf) return;  // nothing visible in this partition
    float* row = out.data() + r * d;
    if (max[r] == kNegInf) {  // the first visible partition, as it is
      std::copy(part_out, part_out + d, row);
      max[r] = part_max;
      sum[r] = part_sum;
      return;
    }
    const float top = std::max(max[r], part_max), keep = std::exp(max[r] - top), add = std::exp(part_max - top);
    for (int64_t i = 0; i < d; ++i) row[i] = row[i] * keep + part_out[i] * add;
    sum[r] = sum[r] * keep + part_sum * add;
    max[r] = top;
  }
};

template <typename P>
struct Scratch {
  std::vector<typename P::PackedQuery> q;
  std::vector<typename P::PackedProbs> p;
  std::vector<float> scores, rescale;
  Folded part;    // the partition being computed (its blocks folded in by the online softmax)
  Folded folded;  // the partitions before it
};

// fn(std::integral_constant<int, rows>) for a tile of up to `rows` query rows: a tile of exactly `rows` where they
// are fewer than kMax (a decode's query heads of one KV head), else of kMax.
template <int kMax, typename Fn>
inline void with_tile(int64_t rows, Fn&& fn) {
  if (rows >= kMax) fn(std::integral_constant<int, kMax>{});
  else if (rows <= 1) fn(std::integral_constant<int, 1>{});
  else if (rows == 2) fn(std::integral_constant<int, 2>{});
  else if (rows == 3) fn(std::integral_constant<int, 3>{});
  else fn(std::integral_constant<int, std::min(kMax, 4)>{});
}

// The rows of a work item: query rows [i0, i1) of entry e (positions e.first + i), the `group` query heads of KV
// head h; row r is position i0 + r / group, query head h * group + r % group.
struct Rows {
  int64_t entry, h, i0, i1;

  int64_t count(int64_t group) const { return (i1 - i0) * group; }
  // Where row r is in a [T, heads, d] tensor whose token rows are `stride` floats apart (e: the rows' entry).
  int64_t offset(const Entry& e, int64_t r, int64_t group, int64_t d, int64_t stride) const {
    return (e.row + i0 + r / group) * stride + (h * group + r % group) * d;
  }
};

// The partitions of rows' contexts: from the one holding the first row's lowest visible key to the last row's.
inline int64_t first_partition(const Entry& e, const Rows& rows, const Cache& c) { return lowest_key(e.first + rows.i0, c.window) / kPartitionKeys; }
inline int64_t end_partition(const Entry& e, const Rows& rows) { return (e.first + rows.i1 - 1) / kPartitionKeys + 1; }

// The queries of `rows`, packed for the products, and the scratch sized for them.
template <typename P>
int64_t pack_rows(const float* q, int64_t q_row_stride, const Entry& e, const Rows& rows, int64_t group, int64_t d, Scratch<P>& s) {
  const int64_t n = rows.count(group), qe = P::query_elems(d);
  constexpr int64_t kTile = std::max(P::kScoreRows, P::kOutputRows);
  const int64_t padded = (n + kTile - 1) / kTile * kTile;  // whole tiles of either size
  s.q.assign(padded * qe, 0);
  s.p.assign(padded * P::kProbElems, 0);
  s.scores.resize(padded * kKeys);
  s.rescale.resize(padded);
  for (int64_t r = 0; r < n; ++r) P::pack_query(q + rows.offset(e, r, group, d, q_row_stride), d, s.q.data() + r * qe);
  return n;
}

// Partition `part` of the rows' contexts (packed by pack_rows), into s.part.
template <typename P>
void attend_partition(const typename P::Cached* k_cache, const typename P::Cached* v_cache, const Entry& e, const Cache& c, const Rows& rows,
                      int64_t group, int64_t part, float scale, Scratch<P>& s) {
  const int64_t d = c.d, n = rows.count(group), qe = P::query_elems(d);
  const int64_t padded = static_cast<int64_t>(s.rescale.size());
  s.part.reset(padded, d);
  std::fill(s.part.out.begin(), s.part.out.end(), 0.f);
  std::fill(s.rescale.begin(), s.rescale.end(), 1.f);
  const int64_t first_block = std::max(lowest_key(e.first + rows.i0, c.window), part * kPartitionKeys) / kKeys;
  const int64_t end_key = std::min(e.first + rows.i1, (part + 1) * kPartitionKeys);
  for (int64_t block = first_block; block * kKeys < end_key; ++block) {
    const int64_t key0 = block * kKeys;
    const KeyBlock<typename P::Cached> b = key_block(k_cache, v_cache, e, c, rows.h, block);
    if ((block + kAhead) * kKeys < end_key) prefetch_block(key_block(k_cache, v_cache, e, c, rows.h, block + kAhead), c);
    with_tile<P::kScoreRows>(n, [&](auto tile) {
      constexpr int kRows = decltype(tile)::value;
      for (int64_t r = 0; r < n; r += kRows) P::template score_tile<kRows>(s.q.data() + r * qe, b, c.block_size, d, scale, s.scores.data() + r * kKeys);
    });
    for (int64_t r = 0; r < n; ++r) {
      float* x = s.scores.data() + r * kKeys;
      const int64_t pos = e.first + rows.i0 + r / group;
      // Keys key0 + j visible from pos: j in [lo, hi).
      const int64_t lo = std::clamp<int64_t>(lowest_key(pos, c.window) - key0, 0, kKeys), hi = std::clamp<int64_t>(pos + 1 - key0, 0, kKeys);
      const float block_max = mask_block(x, lo, hi);
      float &max = s.part.max[r], &sum = s.part.sum[r];
      const float new_max = std::max(max, block_max);
      if (new_max == kNegInf) {  // nothing visible yet: no probabilities, nothing to rescale
        std::fill_n(x, kKeys, 0.f);
        s.rescale[r] = 1.f;
      } else {
        // 0 on the first visible block (max was -inf), exactly 1 if unchanged (exp(0), without the call)
        s.rescale[r] = new_max == max ? 1.f : std::exp(max - new_max);
        sum = sum * s.rescale[r] + exp_block(x, new_max);
        max = new_max;
      }
      P::pack_probs(x, b, s.p.data() + r * P::kProbElems);
    }
    with_tile<P::kOutputRows>(n, [&](auto tile) {
      constexpr int kRows = decltype(tile)::value;
      for (int64_t r = 0; r < n; r += kRows)
        P::template output_tile<kRows>(s.p.data() + r * P::kProbElems, s.rescale.data() + r, b, d, s.part.out.data() + r * d);
    });
  }
}

// The rows' outputs from all their partitions folded: out / sum.
inline void write_rows(const Entry& e, const Rows& rows, int64_t group, int64_t d, int64_t out_row_stride, const Folded& folded, float* y) {
  for (int64_t r = 0; r < rows.count(group); ++r) {
    float* row = y + rows.offset(e, r, group, d, out_row_stride);
    const float inverse = 1.f / folded.sum[r];
    for (int64_t i = 0; i < d; ++i) row[i] = folded.out[r * d + i] * inverse;
  }
}

// Work items are rows (an entry's positions, one KV head) and all their partitions, one thread computing and
// folding them in turn; where those are too few to keep the threads busy (a few sequences decoding), each
// partition is an item of its own and the folds follow, in the same order: the same floats either way.
template <typename P>
void attention(const float* q, int64_t q_row_stride, int64_t heads, const typename P::Cached* k_cache, const typename P::Cached* v_cache,
               const std::vector<Entry>& entries, const Cache& c, float scale, float* y) {
  const int64_t group = heads / c.kv_heads, positions = std::max<int64_t>(kQueryRows / group, 1), d = c.d, out_row_stride = heads * d;
  std::vector<Rows> all_rows;
  for (int64_t b = 0; b < static_cast<int64_t>(entries.size()); ++b) {
    const Entry& e = entries[b];
    for (int64_t i = (e.count + positions - 1) / positions - 1; i >= 0; --i)  // the latest positions (most keys) first
      for (int64_t h = 0; h < c.kv_heads; ++h) all_rows.push_back({b, h, i * positions, std::min(e.count, (i + 1) * positions)});
  }
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  if (threads == 1 || static_cast<int64_t>(all_rows.size()) >= kItemsPerThread * threads) {
    parallel_chunks(static_cast<int64_t>(all_rows.size()), 1, [&](int64_t begin, int64_t end) {
      thread_local Scratch<P> s;
      for (int64_t n = begin; n < end; ++n) {
        const Rows& rows = all_rows[n];
        const Entry& e = entries[rows.entry];
        const int64_t count = pack_rows(q, q_row_stride, e, rows, group, d, s);
        s.folded.reset(count, d);
        for (int64_t part = first_partition(e, rows, c); part < end_partition(e, rows); ++part) {
          attend_partition(k_cache, v_cache, e, c, rows, group, part, scale, s);
          for (int64_t r = 0; r < count; ++r) s.folded.fold(r, d, s.part.out.data() + r * d, s.part.max[r], s.part.sum[r]);
        }
        write_rows(e, rows, group, d, out_row_stride, s.folded, y);
      }
    });
    return;
  }
  // One item per partition: its rows' out, max and sum at `offset` floats into `partials` ((d + 2) floats a row).
  struct Item {
    int64_t rows, part, offset;
  };
  std::vector<Item> items;
  std::vector<int64_t> first_item;
  int64_t size = 0;
  for (int64_t n = 0; n < static_cast<int64_t>(all_rows.size()); ++n) {
    const Rows& rows = all_rows[n];
    const Entry& e = entries[rows.entry];
    first_item.push_back(static_cast<int64_t>(items.size()));
    for (int64_t part = end_partition(e, rows) - 1; part >= first_partition(e, rows, c); --part) {  // the latest keys first
      items.push_back({n, part, size});
      size += rows.count(group) * (d + 2);
    }
  }
  first_item.push_back(static_cast<int64_t>(items.size()));
  std::vector<float> partials(size);
  parallel_chunks(static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch<P> s;
    for (int64_t n = begin; n < end; ++n) {
      const Item& it = items[n];
      const Rows& rows = all_rows[it.rows];
      const Entry& e = entries[rows.entry];
      const int64_t count = pack_rows(q, q_row_stride, e, rows, group, d, s);
      attend_partition(k_cache, v_cache, e, c, rows, group, it.part, scale, s);
      float* partial = partials.data() + it.offset;
      std::copy(s.part.out.begin(), s.part.out.begin() + count * d, partial);
      std::copy(s.part.max.begin(), s.part.max.begin() + count, partial + count * d);
      std::copy(s.part.sum.begin(), s.part.sum.begin() + count, partial + count * (d + 1));
    }
  });
  Folded folded;
  for (int64_t n = 0; n < static_cast<int64_t>(all_rows.size()); ++n) {
    const Rows& rows = all_rows[n];
    const int64_t count = rows.count(group);
    folded.reset(count, d);
    for (int64_t i = first_item[n + 1] - 1; i >= first_item[n]; --i) {  // items were made latest partition first
      const float* partial = partials.data() + items[i].offset;
      for (int64_t r = 0; r < count; ++r) folded.fold(r, d, partial + r * d, partial[count * d + r], partial[count * (d + 1) + r]);
    }
    write_rows(entries[rows.entry], rows, group, d, out_row_stride, folded, y);
  }
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
  const int64_t kv_heads = k_cache.size(0), slots = k_cache.size(1), width = k_cache.size(2), d = cache_head_dim(k_cache);
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
  const Cache c{kv_heads, slots, d, width, block_size, window};
  const float* qp = q.data_ptr<float>();
  float* y = out.data_ptr<float>();
  if (k_cache.scalar_type() == at::kBFloat16) {
#ifdef __AVX512BF16__
    TORCH_CHECK(d % 16 == 0, "a bfloat16 cache needs head_dim a multiple of 16, got ", d);
    attention<Bf16Products>(qp, q.stride(0), heads, k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), entries, c, static_cast<float>(scale), y);
#else
    TORCH_CHECK(false, "a bfloat16 cache needs a CPU with AVX512-BF16 (tokenloop.kernels.bfloat16_cache_supported)");
#endif
  } else if (k_cache.scalar_type() == at::kChar) {
    TORCH_CHECK(d % 16 == 0 && d <= 256, "an int8 cache needs head_dim a multiple of 16, at most 256, got ", d);
    attention<Int8Products>(qp, q.stride(0), heads, k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), entries, c, static_cast<float>(scale), y);
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

AOTITorchError aoti_torch_cpu_paged_attention(AtenTensorHandle q, AtenTensorHandle k_cache, AtenTensorHandle v_cache, AtenTensorHandle block_tables, int64_t block_size, AtenTensorHandle query_start, AtenTensorHandle query_count, AtenTensorHandle first_position, int64_t window, double scale, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(*ret0 = aoti_shim::output(paged_attention(aoti_shim::tensor(q), aoti_shim::tensor(k_cache), aoti_shim::tensor(v_cache), aoti_shim::tensor(block_tables), block_size, aoti_shim::tensor(query_start), aoti_shim::tensor(query_count), aoti_shim::tensor(first_position), window, scale));)
}
