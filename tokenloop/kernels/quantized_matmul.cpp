// y = x W^T for GGUF-quantized W, computed as llama.cpp does on a CPU: the activations are quantized to
// int8 per block of 32 (one float scale each), and each block's dot product is an integer one
// (vpmaddubsw: 32 multiply-adds of unsigned × signed bytes per instruction), scaled once per block.
// PyTorch's own int4 kernel unpacks to bfloat16 and is compute-bound on this; the integer form is not.
//
// Weight formats (w = q * scale + offset per block of 32 weights along K):
//   q4: rows in groups of 8, interleaved as llama.cpp's repacked CPU formats are: weight [N / 8, K / 32, 128]
//       holds, for row group R and block g, 4 chunks p of 32 bytes, chunk p = 4 bytes of each of the 8 rows
//       i in turn, the bytes 4p .. 4p+3 of that row's GGUF block (byte j = weight j in the low nibble,
//       weight j + 16 in the high one). Scales and offsets are [N / 8, K / 32, 8] (Q4_1: offset = m;
//       Q4_0: offset = -8 * scale).
//   q8: the same with signed bytes, w = q * scale (Q8_0): weight [N / 8, K / 32, 256], 8 chunks of 4 bytes
//       per row; scales [N / 8, K / 32, 8], or [N / 8, K / 32, 16] with a scale per 16 weights (Q6_K): the
//       rows' scales of weights 0..15, then of 16..31.
//   q5: w = (u - 16) * scale with u in 0..31 (Q5_0), as GGUF holds it: weight [N / 8, K / 32, 160], q4's 4 chunks
//       of u's low nibbles, then a fifth chunk of each row's 4 bytes of fifth bits (bit j: weight j's). Scales
//       [N / 8, K / 32, 8]. Five eighths of the bytes the same weights take as q8, and the same products.
// Scales and offsets are float16 where the file's are (Q4_0, Q4_1, Q8_0, Q5_0), or, for the K-quants, the file's
// small integers per sub-block (uint8 Q4_K scales and mins, int8 Q6_K scales) with a float16 per 256 weights and
// row ([N / 8, K / 256, 8]: d, or -dmin for offsets), multiplied here: exact in float32 (11 bits times at most 8),
// so the same floats as a float32 copy of d * sc in a quarter of the bytes. Float32 scales are taken too.
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include "aoti_shims.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
// One block of 8 interleaved rows.
constexpr int64_t kQ4GroupBytes = 8 * kBlock / 2;
constexpr int64_t kQ8GroupBytes = 8 * kBlock;
constexpr int64_t kQ5GroupBytes = kQ4GroupBytes + 8 * kBlock / 8;
// How far ahead the kernels ask for weight bytes: a decode step's weights come from memory, in calls too short
// for the hardware prefetcher to get going (at one row, about 7% less time for q4, 5% for the q8 LM head, than
// without; 4 KiB ahead took Gemma 3's LM head about 10% less time than 2 KiB: 3.48 against 3.86 ms).
constexpr int64_t kPrefetchBytes = 4096;

// Activations as int8 per block of 32: x ≈ scale * q, with each block's sum scale * sum_j q_j for the q4 offset
// term. That sum is of the quantized values, not of x: the product is then exactly that of the quantized
// activations with the weights, whose rounding errors partly cancel (sum_j w_j e_j, w_j centred on 0); with
// x's own sum the error would be sum_j (w_j - offset) e_j, two to three times larger. Raw pointers into a
// per-thread buffer that the next call reuses: a decode step makes hundreds of calls, and allocations would be
// a tenth of them.
struct Activations {
  const int8_t* q;
  const float* scale;
  const float* sum;
  const int32_t* half_sums;  // per block, sum(q) over weights 0..15 and over 16..31: the q8 kernel's correction
  int64_t k, groups;

  // The rows from r on.
  Activations from_row(int64_t r) const { return {q + r * k, scale + r * groups, sum + r * groups, half_sums + 2 * r * groups, k, groups}; }
};

// One block of 32: q = round-half-even(v * 127 / amax) (the rounding of std::nearbyint, vectorized), scale
// amax / 127, scale * sum(q), and the integer sums of q's two halves. Eight lanes at a time: done one value at a
// time, this was a fifth of the kernel's time at 32 rows.
inline int32_t lane_sum(__m256i v) {
  __m128i total4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  total4 = _mm_add_epi32(total4, _mm_shuffle_epi32(total4, _MM_SHUFFLE(1, 0, 3, 2)));
  total4 = _mm_add_epi32(total4, _mm_shuffle_epi32(total4, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(total4);
}

inline void quantize_block(const float* v, int8_t* q, float* scale, float* sum, int32_t* half_sums) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 x[4];
  __m256 amax8 = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, x[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i i[4];
  for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(x[j], inv));  // rounds to nearest even
  // Packing works within 128-bit lanes; the permutation puts the 32 bytes back in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  half_sums[0] = lane_sum(_mm256_add_epi32(i[0], i[1]));
  half_sums[1] = lane_sum(_mm256_add_epi32(i[2], i[3]));
  *scale = amax / 127.f;
  *sum = *scale * static_cast<float>(half_sums[0] + half_sums[1]);
}

// A gated MLP's down projection takes act(gate) * up. Computed block by block as it is quantized, instead of two
// more passes over an [M, K] tensor and a copy of it (at 2,048 prompt tokens, about 6% of a step). Both
// activations are x * sigmoid(z): SiLU z = x, GELU-tanh z = 2 sqrt(2 / pi) (x + 0.044715 x^3) (as 0.5 (1 + tanh(z / 2))
// = sigmoid(z)), with ATen's 20-ulp exp: its relative error, about 1e-6, is far below the int8 rounding the
// activations take next (1 / 254), and it costs a fraction of the 1-ulp tanh (GELU took a third of a Gemma 3 down
// projection's time at 1,024 rows).
enum class Gate { kNone, kSiLU, kGeluTanh };

template <Gate kGate>
inline void gated_block(const float* gate, const float* up, float* out) {
  using Vec = at::vec::Vectorized<float>;
  for (int64_t i = 0; i < kBlock; i += Vec::size()) {
    const Vec x = Vec::loadu(gate + i);
    Vec z = x;
    if constexpr (kGate == Gate::kGeluTanh) z = Vec(static_cast<float>(M_SQRT2 * M_2_SQRTPI)) * (x + Vec(0.044715f) * x * x * x);
    const Vec act = x / (Vec(1.f) + z.neg().exp_u20());
    (act * Vec::loadu(up + i)).store(out + i);
  }
}

// x [M, K] float32, or with a gate x = [gate | up] [M, 2K] and the activations act(gate) * up.
template <Gate kGate>
Activations quantize_rows(const at::Tensor& x) {
  constexpr bool kGated = kGate != Gate::kNone;
  const int64_t m = x.size(0), k = x.size(1) / (kGated ? 2 : 1), groups = k / kBlock;
  thread_local std::vector<int8_t> q_buffer;
  thread_local std::vector<float> scale_buffer;
  thread_local std::vector<int32_t> sum_buffer;
  q_buffer.resize(m * k);
  scale_buffer.resize(2 * m * groups);
  sum_buffer.resize(2 * m * groups);
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q_buffer.data();
  float* sp = scale_buffer.data();
  float* up = sp + m * groups;
  int32_t* hp = sum_buffer.data();
  parallel_chunks(m * groups, chunk_size(m * groups, 64), [&](int64_t begin, int64_t end) {
    alignas(32) float gated[kBlock];
    for (int64_t b = begin; b < end; ++b) {
      const float* v = xp + (b / groups) * x.size(1) + (b % groups) * kBlock;
      if constexpr (kGated) {
        gated_block<kGate>(v, v + k, gated);
        v = gated;
      }
      quantize_block(v, qp + b * kBlock, sp + b, up + b, hp + 2 * b);
    }
  });
  return {qp, sp, up, hp, k, groups};
}

// 8 scales (or offsets) as floats, from float16 or float32 storage.
inline __m256 load_scales(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load_scales(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_scales(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
inline __m256 load_scales(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }

// Asks for the cache lines of the weight block kPrefetchBytes past this one (bytes long).
inline void prefetch_ahead(const void* block, int64_t bytes) {
  const char* ahead = static_cast<const char*>(block) + kPrefetchBytes;
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
}

inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline __m256i load_bytes(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// The vectors the kernels are written over: one lane per weight row, 8 lanes (one group of interleaved rows,
// AVX2) or 16 (two groups side by side, AVX-512). The products are the same integers and floats either way;
// AVX-512's vpdpbusd on 16 lanes does 64 byte multiply-adds where the 8-lane one does 32, and this CPU (AMD
// Zen 4) runs about 1.4 times as many a second that way (measured: 450 against 315 GMAC/s on 2 cores), with half
// the activation broadcasts.
struct Lanes8 {
  using Int = __m256i;
  using Float = __m256;
  static constexpr int kRowGroups = 1;
  // 32 bytes of a row group's block; `stride` (the next row group's) is unused.
  static Int load(const void* p, int64_t) { return load_bytes(p); }
  static Int broadcast(int32_t v) { return _mm256_set1_epi32(v); }
  static Int broadcast_bytes(char v) { return _mm256_set1_epi8(v); }
  static Int zeros() { return _mm256_setzero_si256(); }
  static Int bit_and(Int a, Int b) { return _mm256_and_si256(a, b); }
  static Int bit_xor(Int a, Int b) { return _mm256_xor_si256(a, b); }
  static Int shift_right_4(Int a) { return _mm256_srli_epi16(a, 4); }
  static Int shift_right_4_each32(Int a) { return _mm256_srli_epi32(a, 4); }
  // The same 4 int32 in every 128-bit lane (the lanes vpshufb works within).
  static Int lane_pattern(int32_t a, int32_t b, int32_t c, int32_t d) { return _mm256_setr_epi32(a, b, c, d, a, b, c, d); }
  static Int shuffle_bytes(Int a, Int index) { return _mm256_shuffle_epi8(a, index); }
  // a + 16 in each byte whose bits & select are not all zero.
  static Int add_16_where(Int a, Int bits, Int select) {
#ifdef __AVX512VNNI__
    return _mm256_mask_add_epi8(a, _mm256_test_epi8_mask(bits, select), a, _mm256_set1_epi8(16));
#else
    const Int set = _mm256_cmpeq_epi8(_mm256_and_si256(bits, select), select);
    return _mm256_add_epi8(a, _mm256_and_si256(set, _mm256_set1_epi8(16)));
#endif
  }
  static Int add32(Int a, Int b) { return _mm256_add_epi32(a, b); }
  static Int sub32(Int a, Int b) { return _mm256_sub_epi32(a, b); }
  static Float to_float(Int a) { return _mm256_cvtepi32_ps(a); }
  static Float splat(float v) { return _mm256_set1_ps(v); }
  static Float zero_floats() { return _mm256_setzero_ps(); }
  static Float fmadd(Float a, Float b, Float c) { return _mm256_fmadd_ps(a, b, c); }
  static Float mul(Float a, Float b) { return _mm256_mul_ps(a, b); }
  template <typename Scale>
  static Float scales(const Scale* p, int64_t) { return load_scales(p); }
  static void store(float* y, Float v) { _mm256_storeu_ps(y, v); }
#ifdef __AVX512VNNI__
  static Int dpbusd(Int acc, Int u, Int s) { return _mm256_dpbusd_epi32(acc, u, s); }
#endif
};

#ifdef __AVX512VNNI__
struct Lanes16 {
  using Int = __m512i;
  using Float = __m512;
  static constexpr int kRowGroups = 2;
  // 32 bytes of a row group's block, then the same 32 bytes of the next row group's (`stride` bytes on).
  static Int load(const void* p, int64_t stride) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(load_bytes(p)), load_bytes(static_cast<const char*>(p) + stride), 1);
  }
  static Int broadcast(int32_t v) { return _mm512_set1_epi32(v); }
  static Int broadcast_bytes(char v) { return _mm512_set1_epi8(v); }
  static Int zeros() { return _mm512_setzero_si512(); }
  static Int bit_and(Int a, Int b) { return _mm512_and_si512(a, b); }
  static Int bit_xor(Int a, Int b) { return _mm512_xor_si512(a, b); }
  static Int shift_right_4(Int a) { return _mm512_srli_epi16(a, 4); }
  static Int shift_right_4_each32(Int a) { return _mm512_srli_epi32(a, 4); }
  static Int lane_pattern(int32_t a, int32_t b, int32_t c, int32_t d) { return _mm512_set4_epi32(d, c, b, a); }
  static Int shuffle_bytes(Int a, Int index) { return _mm512_shuffle_epi8(a, index); }
  static Int add_16_where(Int a, Int bits, Int select) {
    return _mm512_mask_add_epi8(a, _mm512_test_epi8_mask(bits, select), a, _mm512_set1_epi8(16));
  }
  static Int add32(Int a, Int b) { return _mm512_add_epi32(a, b); }
  static Int sub32(Int a, Int b) { return _mm512_sub_epi32(a, b); }
  static Float to_float(Int a) { return _mm512_cvtepi32_ps(a); }
  static Float splat(float v) { return _mm512_set1_ps(v); }
  static Float zero_floats() { return _mm512_setzero_ps(); }
  static Float fmadd(Float a, Float b, Float c) { return _mm512_fmadd_ps(a, b, c); }
  static Float mul(Float a, Float b) { return _mm512_mul_ps(a, b); }
  template <typename Scale>
  static Float scales(const Scale* p, int64_t stride) {
    const __m512d low = _mm512_castps_pd(_mm512_castps256_ps512(load_scales(p)));  // (AVX512F has no 8-float insert)
    return _mm512_castpd_ps(_mm512_insertf64x4(low, _mm256_castps_pd(load_scales(p + stride)), 1));
  }
  static void store(float* y, Float v) { _mm512_storeu_ps(y, v); }
  static Int dpbusd(Int acc, Int u, Int s) { return _mm512_dpbusd_epi32(acc, u, s); }
};
#endif

// A block's integer dot products for one activation row, one int32 per lane (pairs of unsigned × signed bytes,
// summed exactly: no pair can saturate). AVX512-VNNI's vpdpbusd multiplies and sums 4 byte pairs into an int32
// lane in one instruction, where AVX2 needs vpmaddubsw, a widening vpmaddwd and an add: at 32 rows and more the
// kernel is bound by these instructions, not by memory. The same integers either way, so the same floats.
#ifdef __AVX512VNNI__
template <typename V>
struct Q4Dot {
  // Two accumulators, so that consecutive vpdpbusd (latency 4) do not wait for each other.
  typename V::Int low = V::zeros(), high = V::zeros();
  void add(typename V::Int w_low, typename V::Int x_low, typename V::Int w_high, typename V::Int x_high) {
    low = V::dpbusd(low, w_low, x_low), high = V::dpbusd(high, w_high, x_high);
  }
  typename V::Float floats() const { return V::to_float(V::add32(low, high)); }
};
// q5's weights go in as u = w + 16 (0..31): sum u x = sum w x + 16 sum x, and the second term comes off once per block.
template <typename V>
struct Q5Dot : Q4Dot<V> {
  typename V::Float floats(int32_t x_sum) const { return V::to_float(V::sub32(V::add32(this->low, this->high), V::broadcast(16 * x_sum))); }
};
// q8's signed weights go in as unsigned bytes u = w + 128 (w xor 0x80): sum u x = sum w x + 128 sum x, and the
// second term, from the activations' own integer sums, comes off once per sub-block. Moving w's sign onto x
// instead (as AVX2 must, below) costs a vpsignb per activation row and chunk: q8 ran a third slower than q4
// per weight, bound by those instructions.
template <typename V>
struct Q8Weights {
  typename V::Int u;
  explicit Q8Weights(typename V::Int w) : u(V::bit_xor(w, V::broadcast_bytes(static_cast<char>(0x80)))) {}
};
template <typename V>
struct Q8Dot {
  typename V::Int sum = V::zeros();
  void add(const Q8Weights<V>& w, typename V::Int x) { sum = V::dpbusd(sum, w.u, x); }
  typename V::Float floats(int32_t x_sum) const { return V::to_float(V::sub32(sum, V::broadcast(128 * x_sum))); }
};
using Lanes = Lanes16;
#else
inline __m256i widen_pairs(__m256i int16) { return _mm256_madd_epi16(int16, _mm256_set1_epi16(1)); }
// A block's 8 products per lane fit int16 (8 * 2 * 15 * 127 < 32767): summed there, widened once per block.
template <typename V>
struct Q4Dot {
  __m256i sum = _mm256_setzero_si256();
  void add(__m256i w_low, __m256i x_low, __m256i w_high, __m256i x_high) {
    sum = _mm256_add_epi16(sum, _mm256_add_epi16(_mm256_maddubs_epi16(w_low, x_low), _mm256_maddubs_epi16(w_high, x_high)));
  }
  __m256 floats() const { return _mm256_cvtepi32_ps(widen_pairs(sum)); }
};
// q5's u = w + 16 (0..31): a chunk's pairs fit int16 (2 * 2 * 31 * 128 < 32767), widened every chunk.
template <typename V>
struct Q5Dot {
  __m256i sum = _mm256_setzero_si256();
  void add(__m256i w_low, __m256i x_low, __m256i w_high, __m256i x_high) {
    sum = _mm256_add_epi32(sum, widen_pairs(_mm256_add_epi16(_mm256_maddubs_epi16(w_low, x_low), _mm256_maddubs_epi16(w_high, x_high))));
  }
  __m256 floats(int32_t x_sum) const { return _mm256_cvtepi32_ps(_mm256_sub_epi32(sum, _mm256_set1_epi32(16 * x_sum))); }
};
// vpmaddubsw's pairs of (w + 128) x could saturate int16, so w's sign moves onto x: |w| x sign(w), pairs up to
// 2 * 128 * 127, widened every chunk.
template <typename V>
struct Q8Weights {
  __m256i abs, sign;
  explicit Q8Weights(__m256i w) : abs(_mm256_sign_epi8(w, w)), sign(w) {}
};
template <typename V>
struct Q8Dot {
  __m256i sum = _mm256_setzero_si256();
  void add(const Q8Weights<V>& w, __m256i x) { sum = _mm256_add_epi32(sum, widen_pairs(_mm256_maddubs_epi16(w.abs, _mm256_sign_epi8(x, w.sign)))); }
  __m256 floats(int32_t) const { return _mm256_cvtepi32_ps(sum); }
};
using Lanes = Lanes8;
#endif

// A row group's scales (or offsets): 8 per sub-block, one per row, `stride` elements before the next row group's.
// With an integer Scale (the K-quants), each times its row's float16 of the 256 weights around it (`per_256`, 8 per
// super-block, `per_256_stride` before the next row group's).
template <typename Scale>
struct ScaleRows {
  const Scale* p = nullptr;
  int64_t stride = 0;
  const at::Half* per_256 = nullptr;
  int64_t per_256_stride = 0;

  ScaleRows at(int64_t row_group) const {
    return {p + row_group * stride, stride, per_256 ? per_256 + row_group * per_256_stride : nullptr, per_256_stride};
  }
  // The V::kRowGroups row groups' scales of sub-block i, of sub_blocks_per_256 in a super-block.
  template <typename V>
  typename V::Float load(int64_t i, int64_t sub_blocks_per_256) const {
    if constexpr (std::is_integral_v<Scale>) return V::mul(V::scales(p + i * 8, stride), V::scales(per_256 + i / sub_blocks_per_256 * 8, per_256_stride));
    else return V::scales(p + i * 8, stride);
  }
};

// Where a tile's weights are: V::kRowGroups row groups from `weight` on, each `stride` bytes (and scales)
// after the one before.
template <typename Scale>
struct RowGroups {
  const void* weight;
  int64_t stride;
  ScaleRows<Scale> scale;
  ScaleRows<Scale> offset;  // q4 only
};

// q4: kRows activation rows against V::kRowGroups groups of 8 interleaved weight rows (see the layout above), 8
// outputs per row group and activation row. One multiply-add multiplies 4 weights of each weight row by the
// same 4 activations, so its lanes are already per weight row: no horizontal sums, and each weight byte is
// unpacked once for all kRows rows.
template <typename V, int kRows, typename Scale>
void q4_rows(const Activations& x, const RowGroups<Scale>& w, float* y, int64_t y_stride) {
  const typename V::Int low4 = V::broadcast_bytes(0x0F);
  typename V::Float acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = V::zero_floats();
  for (int64_t g = 0; g < x.groups; ++g) {
    const uint8_t* wb = static_cast<const uint8_t*>(w.weight) + g * kQ4GroupBytes;
    for (int i = 0; i < V::kRowGroups; ++i) prefetch_ahead(wb + i * w.stride, kQ4GroupBytes);
    Q4Dot<V> dot[kRows];
    // Not unrolled: unrolled, gcc computes all 32 products of a 4-row tile before summing any and spills them.
#pragma GCC unroll 1
    for (int p = 0; p < 4; ++p) {
      const typename V::Int packed = V::load(wb + 32 * p, w.stride);
      const typename V::Int low = V::bit_and(packed, low4);                      // weights 4p .. 4p+3
      const typename V::Int high = V::bit_and(V::shift_right_4(packed), low4);  // weights 16+4p .. 16+4p+3
      for (int r = 0; r < kRows; ++r) {
        const int8_t* xb = x.q + r * x.k + g * kBlock;
        dot[r].add(low, V::broadcast(four_bytes(xb + 4 * p)), high, V::broadcast(four_bytes(xb + 16 + 4 * p)));
      }
    }
    const typename V::Float d = w.scale.template load<V>(g, 8), m = w.offset.template load<V>(g, 8);
    for (int r = 0; r < kRows; ++r) {
      acc[r] = V::fmadd(dot[r].floats(), V::mul(d, V::splat(x.scale[r * x.groups + g])), acc[r]);
      acc[r] = V::fmadd(m, V::splat(x.sum[r * x.groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) V::store(y + r * y_stride, acc[r]);
}

// q8: as q4, with 8 chunks of signed bytes per block (taken as Q8Weights: the multiply-adds take unsigned by
// signed bytes). kSubBlocks scales per block: 1, or 2 (chunks 0..3 are weights 0..15, chunks 4..7 weights
// 16..31, each half with its own scale).
template <typename V, int kRows, typename Scale, int kSubBlocks>
void q8_rows(const Activations& x, const RowGroups<Scale>& w, float* y, int64_t y_stride) {
  constexpr int kChunks = 8 / kSubBlocks;
  typename V::Float acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = V::zero_floats();
  for (int64_t g = 0; g < x.groups; ++g) {
    const int8_t* wb = static_cast<const int8_t*>(w.weight) + g * kQ8GroupBytes;
    for (int i = 0; i < V::kRowGroups; ++i) prefetch_ahead(wb + i * w.stride, kQ8GroupBytes);
    for (int sub = 0; sub < kSubBlocks; ++sub) {
      Q8Dot<V> dot[kRows];
      for (int c = sub * kChunks; c < (sub + 1) * kChunks; ++c) {
        const Q8Weights<V> weights(V::load(wb + 32 * c, w.stride));
        for (int r = 0; r < kRows; ++r) dot[r].add(weights, V::broadcast(four_bytes(x.q + r * x.k + g * kBlock + 4 * c)));
      }
      const typename V::Float d = w.scale.template load<V>(g * kSubBlocks + sub, 8 * kSubBlocks);
      for (int r = 0; r < kRows; ++r) {
        const int32_t* half = x.half_sums + 2 * (r * x.groups + g);
        const int32_t x_sum = kSubBlocks == 2 ? half[sub] : half[0] + half[1];
        acc[r] = V::fmadd(dot[r].floats(x_sum), V::mul(d, V::splat(x.scale[r * x.groups + g])), acc[r]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) V::store(y + r * y_stride, acc[r]);
}

// q5's weights as unsigned bytes u = w + 16 (0..31): q4's nibbles, each plus 16 where its fifth bit is set. Each
// row's fifth bits are one int32 lane: chunk p takes bits 4p .. 4p+3 (weights 4p ..) and 16+4p .. (weights
// 16+4p ..), which vpshufb spreads one to a byte.
template <typename V>
struct Q5Unpacker {
  const typename V::Int low4 = V::broadcast_bytes(0x0F);
  // Byte 0 (bits 0..3) or byte 2 (bits 16..19) of each row's lane, into that row's 4 bytes; then one bit each.
  const typename V::Int low_bits = V::lane_pattern(0x00000000, 0x04040404, 0x08080808, 0x0C0C0C0C);
  const typename V::Int high_bits = V::lane_pattern(0x02020202, 0x06060606, 0x0A0A0A0A, 0x0E0E0E0E);
  const typename V::Int bit_of_byte = V::broadcast(0x08040201);

  // The block's fifth bits, for chunk(): each call moves on to the next chunk's.
  typename V::Int fifth_bits(const uint8_t* block, int64_t stride) const { return V::load(block + kQ4GroupBytes, stride); }
  // Chunk p's weights 4p .. 4p+3 (low) and 16+4p .. 16+4p+3 (high) of each row, as u.
  void chunk(const uint8_t* block, int64_t stride, int p, typename V::Int& fifth, typename V::Int& low, typename V::Int& high) const {
    const typename V::Int packed = V::load(block + 32 * p, stride);
    low = V::add_16_where(V::bit_and(packed, low4), V::shuffle_bytes(fifth, low_bits), bit_of_byte);
    high = V::add_16_where(V::bit_and(V::shift_right_4(packed), low4), V::shuffle_bytes(fifth, high_bits), bit_of_byte);
    fifth = V::shift_right_4_each32(fifth);  // the next chunk's bits to the bottom of bytes 0 and 2
  }
};

// q5 for a few activation rows (decode), which are bound by memory: the weights are unpacked as they stream
// in, then summed as q8's are (sum u x - 16 sum x): the same integers and floats as the same weights held as q8.
template <typename V, int kRows, typename Scale>
void q5_rows(const Activations& x, const RowGroups<Scale>& w, float* y, int64_t y_stride) {
  const Q5Unpacker<V> unpack;
  typename V::Float acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = V::zero_floats();
  for (int64_t g = 0; g < x.groups; ++g) {
    const uint8_t* wb = static_cast<const uint8_t*>(w.weight) + g * kQ5GroupBytes;
    for (int i = 0; i < V::kRowGroups; ++i) prefetch_ahead(wb + i * w.stride, kQ5GroupBytes);
    typename V::Int fifth = unpack.fifth_bits(wb, w.stride), low, high;
    Q5Dot<V> dot[kRows];
#pragma GCC unroll 1
    for (int p = 0; p < 4; ++p) {
      unpack.chunk(wb, w.stride, p, fifth, low, high);
      for (int r = 0; r < kRows; ++r) {
        const int8_t* xb = x.q + r * x.k + g * kBlock;
        dot[r].add(low, V::broadcast(four_bytes(xb + 4 * p)), high, V::broadcast(four_bytes(xb + 16 + 4 * p)));
      }
    }
    const typename V::Float d = w.scale.template load<V>(g, 8);
    for (int r = 0; r < kRows; ++r) {
      const int32_t* half = x.half_sums + 2 * (r * x.groups + g);
      acc[r] = V::fmadd(dot[r].floats(half[0] + half[1]), V::mul(d, V::splat(x.scale[r * x.groups + g])), acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) V::store(y + r * y_stride, acc[r]);
}

// q5 blocks [blocks, 160] → q8 blocks [blocks, 256] of the same rows (w = u - 16), for many activation rows: unpacked
// once per call instead of once per tile of 4 rows (at 1,024 rows, q5_rows took a quarter longer than q8's kernel).
void widen_q5(const uint8_t* q5, int64_t blocks, int8_t* q8) {
  const Q5Unpacker<Lanes8> unpack;
  const __m256i sixteen = _mm256_set1_epi8(16);
  parallel_chunks(blocks, chunk_size(blocks, 256), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* block = q5 + b * kQ5GroupBytes;
      int8_t* out = q8 + b * kQ8GroupBytes;
      __m256i fifth = unpack.fifth_bits(block, 0), low, high;
      for (int p = 0; p < 4; ++p) {
        unpack.chunk(block, 0, p, fifth, low, high);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * p), _mm256_sub_epi8(low, sixteen));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * (4 + p)), _mm256_sub_epi8(high, sixteen));
      }
    }
  });
}

// Calls rows(x tile, first row, kRows) for tiles of up to 4 activation rows.
template <typename Fn>
inline void for_row_tiles(const Activations& x, int64_t m, Fn&& rows) {
  for (int64_t r = 0; r < m;) {
    const Activations tile = x.from_row(r);
    switch (std::min<int64_t>(m - r, 4)) {
      case 4: rows(tile, r, std::integral_constant<int, 4>{}); r += 4; break;
      case 3: rows(tile, r, std::integral_constant<int, 3>{}); r += 3; break;
      case 2: rows(tile, r, std::integral_constant<int, 2>{}); r += 2; break;
      default: rows(tile, r, std::integral_constant<int, 1>{}); r += 1; break;
    }
  }
}

// Below about 12 activation rows a product is bound by memory, not by its multiply-adds, and 16 lanes (two row
// groups' weights streaming at once) read it more slowly: Gemma 3's 262k-row LM head at one row took 10 ms
// against 7 on 8 lanes, about the same at 8 rows, and 20% less from 16 rows on. A row's floats are the same either way.
constexpr int64_t kWideMinRows = 12;

// Up to this many activation rows (a decode step's batch) go against the weights as one block: each weight byte is
// then read from memory once. In blocks sized for L1, a batch of 32 read every weight twice (Gemma 3's LM head of
// 178 MB as 356; its rows took 28 ms a step at 32 sequences).
constexpr int64_t kOneBlockRows = 64;

// y [m, row_groups * 8] = x W^T, in parallel over chunks of row groups, each against every activation row:
// rows(lanes, tile, first row group, kRows, out, n) with lanes Wide (two row groups at once, where built with
// AVX-512) or Lanes8 (the odd last one). Activation rows go in blocks of about 16 KiB, each block against all of
// a chunk's weight rows, so that the block stays in L1 while the weights stream through (prefill: about 9% less
// time at 1,024 rows). A product bound by memory goes in one chunk per thread, not 8: each chunk's weights are
// one stream from memory, and every stream starts below full speed, which a one-row product of a few hundred KB
// pays at each chunk (SmolLM2's decode step gained with each halving down to one; with a core taken by another
// process, one chunk a thread held up as well as two).
template <typename Wide, typename Rows>
void matmul_lanes(const Activations& x, int64_t m, int64_t row_groups, float* y, Rows&& rows) {
  constexpr int64_t kStep = Wide::kRowGroups;
  const int64_t n = row_groups * 8, units = (row_groups + kStep - 1) / kStep;
  const int64_t block_rows = m <= kOneBlockRows ? m : std::max<int64_t>(4, 16384 / x.k / 4 * 4);
  parallel_chunks(units, chunk_size(units, 4 / kStep, m < kWideMinRows ? 1 : 8), [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += block_rows) {
      const Activations block = x.from_row(r0);
      for (int64_t rg = begin * kStep; rg < std::min(end * kStep, row_groups); rg += kStep)
        for_row_tiles(block, std::min(block_rows, m - r0), [&](const Activations& tile, int64_t r, auto k_rows) {
          float* out = y + (r0 + r) * n + rg * 8;
          if (rg + kStep <= row_groups) rows(Wide{}, tile, rg, k_rows, out, n);
          else rows(Lanes8{}, tile, rg, k_rows, out, n);
        });
    }
  });
}

template <typename Rows>
void matmul_row_groups(const Activations& x, int64_t m, int64_t row_groups, float* y, Rows&& rows) {
  if (m >= kWideMinRows) matmul_lanes<Lanes>(x, m, row_groups, y, rows);
  else matmul_lanes<Lanes8>(x, m, row_groups, y, rows);
}

// Returns K: x is [M, K], or [M, 2K] for a gated MLP's [gate | up].
int64_t check_activations(const at::Tensor& x, bool gated = false) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous [M, ", gated ? "2K" : "K",
              "] float32 tensor");
  const int64_t k = x.size(1) / (gated ? 2 : 1);
  TORCH_CHECK(k % kBlock == 0 && k * (gated ? 2 : 1) == x.size(1), "K must be a multiple of 32, got ", gated ? "2K = " : "", x.size(1));
  return k;
}

// weight [N / 8, K / 32, group_bytes] of `type`.
void check_weight(const at::Tensor& weight, int64_t k, at::ScalarType type, const char* type_name, int64_t group_bytes) {
  TORCH_CHECK(weight.scalar_type() == type && weight.is_contiguous() && weight.dim() == 3, "weight must be a contiguous ", type_name,
              " [N / 8, K / 32, ", group_bytes, "] tensor");
  TORCH_CHECK(weight.size(1) == k / kBlock && weight.size(2) == group_bytes, "weight must be [N / 8, K / 32, ", group_bytes, "] for K = ", k,
              ", got ", weight.sizes());
}

void check_scales(const at::Tensor& t, at::IntArrayRef shape, const char* name, at::ScalarType type) {
  TORCH_CHECK(t.scalar_type() == type && t.is_contiguous(), name, " must be contiguous and of the scales' type");
  TORCH_CHECK(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
}

using Per256 = std::optional<at::Tensor>;

// Integer scales (or offsets) [N / 8, K / 32, ...] come with their float16 factors per 256 weights [N / 8, K / 256, 8];
// float ones without.
void check_per_256(const at::Tensor& scale, const Per256& per_256) {
  const bool integers = scale.scalar_type() == at::kByte || scale.scalar_type() == at::kChar;
  TORCH_CHECK(integers == per_256.has_value(), integers ? "uint8 or int8 scales need their float16 factors per 256 weights"
                                                         : "float scales take no factors per 256 weights");
  if (integers) {
    const at::Tensor& f = *per_256;
    TORCH_CHECK(f.scalar_type() == at::kHalf && f.is_contiguous() && f.dim() == 3 && f.size(0) == scale.size(0) && f.size(2) == 8 &&
                    f.size(1) * 8 == scale.size(1),
                "factors per 256 weights must be a contiguous float16 [N / 8, K / 256, 8] tensor, got ", f.sizes());
  }
}

// Calls fn(Scale{}) with Scale = at::Half or float, or uint8_t / int8_t for the K-quants' integers, which come with
// their float16s per 256 weights (per_256 [N / 8, K / 256, 8]) and only then.
template <typename Fn>
void with_scale_type(const at::Tensor& scale, const Per256& per_256, Fn&& fn) {
  const at::ScalarType type = scale.scalar_type();
  const bool integers = type == at::kByte || type == at::kChar;
  TORCH_CHECK(integers || type == at::kHalf || type == at::kFloat, "scales must be float16, float32, uint8 or int8");
  check_per_256(scale, per_256);
  if (type == at::kHalf) fn(at::Half{});
  else if (type == at::kFloat) fn(float{});
  else if (type == at::kByte) fn(uint8_t{});
  else fn(int8_t{});
}

// Scales (or offsets) [N / 8, K / 32, per_group] of Scale, and their factors, from row group 0.
template <typename Scale>
ScaleRows<Scale> scale_rows(const at::Tensor& t, const Per256& per_256) {
  ScaleRows<Scale> rows{t.data_ptr<Scale>(), t.size(1) * t.size(2)};
  if (per_256) rows.per_256 = per_256->data_ptr<at::Half>(), rows.per_256_stride = per_256->size(1) * 8;
  return rows;
}

// Many activation rows (prefill) multiply each scale into many tiles of 4 rows: K-quant scales are then multiplied
// out into float32 once per call instead of once per tile (which made a Q4_K or Q6_K product 6-12% slower at 1,024
// rows). The same floats either way. Calls product(scales, offsets) with the ScaleRows to use.
template <typename Scale, typename Fn>
void with_scales_for(int64_t m, int64_t row_groups, int64_t sub_blocks_per_256, const ScaleRows<Scale>& s, const ScaleRows<Scale>& o, Fn&& product) {
  if constexpr (std::is_integral_v<Scale>) {
    if (m >= kWideMinRows) {
      thread_local std::vector<float> buffers[2];
      ScaleRows<float> out[2];
      for (int t = 0; t < 2; ++t) {
        const ScaleRows<Scale>& in = t == 0 ? s : o;
        if (in.p == nullptr) continue;  // q8: no offsets
        buffers[t].resize(row_groups * in.stride);
        float* dst = buffers[t].data();
        parallel_chunks(row_groups, chunk_size(row_groups, 16), [&](int64_t begin, int64_t end) {
          for (int64_t rg = begin; rg < end; ++rg)
            for (int64_t i = 0; i < in.stride / 8; ++i) Lanes8::store(dst + rg * in.stride + i * 8, in.at(rg).template load<Lanes8>(i, sub_blocks_per_256));
        });
        out[t] = {dst, in.stride};
      }
      return product(out[0], out[1]);
    }
  }
  product(s, o);
}

template <Gate kGate>
at::Tensor q4_product(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& offset, const Per256& scale_per_256,
                      const Per256& offset_per_256) {
  const int64_t groups = check_activations(x, kGate != Gate::kNone) / kBlock;
  check_weight(weight, groups * kBlock, at::kByte, "uint8", kQ4GroupBytes);
  check_scales(scale, {weight.size(0), groups, 8}, "scales", scale.scalar_type());
  check_scales(offset, {weight.size(0), groups, 8}, "offsets", scale.scalar_type());
  check_per_256(offset, offset_per_256);  // (its scales are checked with their type below)
  at::Tensor y = at::empty({x.size(0), weight.size(0) * 8}, x.options());
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const Activations activations = quantize_rows<kGate>(x);
  with_scale_type(scale, scale_per_256, [&](auto type) {
    using Scale = decltype(type);
    const ScaleRows<Scale> s = scale_rows<Scale>(scale, scale_per_256), o = scale_rows<Scale>(offset, offset_per_256);
    with_scales_for(x.size(0), weight.size(0), 8, s, o, [&](const auto& scales, const auto& offsets) {
      using Used = std::remove_cv_t<std::remove_pointer_t<decltype(scales.p)>>;
      matmul_row_groups(activations, x.size(0), weight.size(0), y.data_ptr<float>(), [&](auto lanes, const Activations& tile, int64_t rg, auto k_rows, float* out, int64_t n) {
        const RowGroups<Used> at{w + rg * groups * kQ4GroupBytes, groups * kQ4GroupBytes, scales.at(rg), offsets.at(rg)};
        q4_rows<decltype(lanes), decltype(k_rows)::value>(tile, at, out, n);
      });
    });
  });
  return y;
}

// y [m, row_groups * 8] = x W^T for q8 weights w [row_groups, groups, 256] and scales [row_groups, groups, per_group].
template <typename Scale>
void q8_matmul_into(const Activations& x, int64_t m, const int8_t* w, int64_t row_groups, const ScaleRows<Scale>& s, int64_t per_group, float* y) {
  const int64_t groups = x.groups;
  matmul_row_groups(x, m, row_groups, y, [&](auto lanes, const Activations& tile, int64_t rg, auto k_rows, float* out, int64_t n) {
    using V = decltype(lanes);
    constexpr int kRows = decltype(k_rows)::value;
    const RowGroups<Scale> at{w + rg * groups * kQ8GroupBytes, groups * kQ8GroupBytes, s.at(rg), {}};
    if (per_group == 16) q8_rows<V, kRows, Scale, 2>(tile, at, out, n);
    else q8_rows<V, kRows, Scale, 1>(tile, at, out, n);
  });
}

template <Gate kGate>
at::Tensor q8_product(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, const Per256& scale_per_256) {
  const int64_t groups = check_activations(x, kGate != Gate::kNone) / kBlock;
  check_weight(weight, groups * kBlock, at::kChar, "int8", kQ8GroupBytes);
  TORCH_CHECK(scale.dim() == 3 && (scale.size(2) == 8 || scale.size(2) == 16), "scales must be [N / 8, K / 32, 8 or 16]");
  const int64_t per_group = scale.size(2);  // 8 rows' scales, once or twice (a scale per 16 weights)
  check_scales(scale, {weight.size(0), groups, per_group}, "scales", scale.scalar_type());
  at::Tensor y = at::empty({x.size(0), weight.size(0) * 8}, x.options());
  const Activations activations = quantize_rows<kGate>(x);
  with_scale_type(scale, scale_per_256, [&](auto type) {
    using Scale = decltype(type);
    with_scales_for(x.size(0), weight.size(0), per_group, scale_rows<Scale>(scale, scale_per_256), ScaleRows<Scale>{}, [&](const auto& scales, const auto&) {
      q8_matmul_into(activations, x.size(0), weight.data_ptr<int8_t>(), weight.size(0), scales, per_group, y.data_ptr<float>());
    });
  });
  return y;
}

template <Gate kGate>
at::Tensor q5_product(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  const int64_t groups = check_activations(x, kGate != Gate::kNone) / kBlock, m = x.size(0), row_groups = weight.size(0);
  check_weight(weight, groups * kBlock, at::kByte, "uint8", kQ5GroupBytes);
  check_scales(scale, {row_groups, groups, 8}, "scales", scale.scalar_type());
  at::Tensor y = at::empty({m, row_groups * 8}, x.options());
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const Activations activations = quantize_rows<kGate>(x);
  with_scale_type(scale, std::nullopt, [&](auto type) {
    using Scale = decltype(type);
    const ScaleRows<Scale> s = scale_rows<Scale>(scale, std::nullopt);
    if (m >= kWideMinRows) {  // bound by multiply-adds: q8's kernel on the weights widened once
      thread_local std::vector<int8_t> widened;
      widened.resize(row_groups * groups * kQ8GroupBytes);
      widen_q5(w, row_groups * groups, widened.data());
      q8_matmul_into(activations, m, widened.data(), row_groups, s, 8, y.data_ptr<float>());
      return;
    }
    matmul_row_groups(activations, m, row_groups, y.data_ptr<float>(), [&](auto lanes, const Activations& tile, int64_t rg, auto k_rows, float* out, int64_t n) {
      const RowGroups<Scale> at{w + rg * groups * kQ5GroupBytes, groups * kQ5GroupBytes, s.at(rg), {}};
      q5_rows<decltype(lanes), decltype(k_rows)::value>(tile, at, out, n);
    });
  });
  return y;
}

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& offset, const Per256& scale_per_256,
                     const Per256& offset_per_256) {
  return q4_product<Gate::kNone>(x, weight, scale, offset, scale_per_256, offset_per_256);
}

at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, const Per256& scale_per_256) {
  return q8_product<Gate::kNone>(x, weight, scale, scale_per_256);
}

at::Tensor q5_matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  return q5_product<Gate::kNone>(x, weight, scale);
}

// Calls fn(std::integral_constant<Gate, ...>) for a gated MLP's activation, named as the model configs name it.
template <typename Fn>
at::Tensor with_gate(c10::string_view activation, Fn&& fn) {
  if (activation == "silu") return fn(std::integral_constant<Gate, Gate::kSiLU>{});
  if (activation == "gelu_pytorch_tanh") return fn(std::integral_constant<Gate, Gate::kGeluTanh>{});
  TORCH_CHECK(false, "activation must be 'silu' or 'gelu_pytorch_tanh', got '", activation, "'");
}

// (act(gate) * up) W^T for gate_up = [gate | up] [M, 2K]: a gated MLP's down projection.
at::Tensor q4_gated_matmul(const at::Tensor& gate_up, const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& offset, c10::string_view activation,
                           const Per256& scale_per_256, const Per256& offset_per_256) {
  return with_gate(activation, [&](auto gate) { return q4_product<decltype(gate)::value>(gate_up, weight, scale, offset, scale_per_256, offset_per_256); });
}

at::Tensor q8_gated_matmul(const at::Tensor& gate_up, const at::Tensor& weight, const at::Tensor& scale, c10::string_view activation, const Per256& scale_per_256) {
  return with_gate(activation, [&](auto gate) { return q8_product<decltype(gate)::value>(gate_up, weight, scale, scale_per_256); });
}

at::Tensor q5_gated_matmul(const at::Tensor& gate_up, const at::Tensor& weight, const at::Tensor& scale, c10::string_view activation) {
  return with_gate(activation, [&](auto gate) { return q5_product<decltype(gate)::value>(gate_up, weight, scale); });
}

}  // namespace

TORCH_LIBRARY(tokenloop, m) {
  m.def("q4_matmul(Tensor x, Tensor weight, Tensor scale, Tensor offset, Tensor? scale_per_256=None, Tensor? offset_per_256=None) -> Tensor");
  m.def("q8_matmul(Tensor x, Tensor weight, Tensor scale, Tensor? scale_per_256=None) -> Tensor");
  m.def("q5_matmul(Tensor x, Tensor weight, Tensor scale) -> Tensor");
  m.def("q4_gated_matmul(Tensor gate_up, Tensor weight, Tensor scale, Tensor offset, str activation, Tensor? scale_per_256=None, Tensor? offset_per_256=None) -> Tensor");
  m.def("q8_gated_matmul(Tensor gate_up, Tensor weight, Tensor scale, str activation, Tensor? scale_per_256=None) -> Tensor");
  m.def("q5_gated_matmul(Tensor gate_up, Tensor weight, Tensor scale, str activation) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloop, CPU, m) {
  m.impl("q4_matmul", &q4_matmul);
  m.impl("q8_matmul", &q8_matmul);
  m.impl("q4_gated_matmul", &q4_gated_matmul);
  m.impl("q8_gated_matmul", &q8_gated_matmul);
  m.impl("q5_matmul", &q5_matmul);
  m.impl("q5_gated_matmul", &q5_gated_matmul);
}

using aoti_shim::optional;
using aoti_shim::tensor;

AOTITorchError aoti_torch_cpu_q4_matmul(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle offset, AtenTensorHandle* scale_per_256, AtenTensorHandle* offset_per_256, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(*ret0 = aoti_shim::output(q4_matmul(tensor(x), tensor(weight), tensor(scale), tensor(offset), optional(scale_per_256), optional(offset_per_256)));)
}

AOTITorchError aoti_torch_cpu_q8_matmul(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle* scale_per_256, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(*ret0 = aoti_shim::output(q8_matmul(tensor(x), tensor(weight), tensor(scale), optional(scale_per_256)));)
}

AOTITorchError aoti_torch_cpu_q5_matmul(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(*ret0 = aoti_shim::output(q5_matmul(tensor(x), tensor(weight), tensor(scale)));)
}

AOTITorchError aoti_torch_cpu_q4_gated_matmul(AtenTensorHandle gate_up, AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle offset, const char* activation, AtenTensorHandle* scale_per_256, AtenTensorHandle* offset_per_256, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(*ret0 = aoti_shim::output(q4_gated_matmul(tensor(gate_up), tensor(weight), tensor(scale), tensor(offset), activation, optional(scale_per_256), optional(offset_per_256)));)
}

AOTITorchError aoti_torch_cpu_q8_gated_matmul(AtenTensorHandle gate_up, AtenTensorHandle weight, AtenTensorHandle scale, const char* activation, AtenTensorHandle* scale_per_256, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(*ret0 = aoti_shim::output(q8_gated_matmul(tensor(gate_up), tensor(weight), tensor(scale), activation, optional(scale_per_256)));)
}

AOTITorchError aoti_torch_cpu_q5_gated_matmul(AtenTensorHandle gate_up, AtenTensorHandle weight, AtenTensorHandle scale, const char* activation, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(*ret0 = aoti_shim::output(q5_gated_matmul(tensor(gate_up), tensor(weight), tensor(scale), activation));)
}
