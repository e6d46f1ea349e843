// y = x W^T for GGUF-quantized W, computed as llama.cpp does on a CPU: the activations are quantized to
// int8 per block of 32 (one float scale each), and each block's dot product is an integer one
// (vpmaddubsw: 32 multiply-adds of unsigned × signed bytes per instruction), scaled once per block.
// PyTorch's own int4 kernel unpacks to bfloat16 and is compute-bound on this; the integer form is not.
//
// Weight formats, one block of 32 weights per (row n, group g):
//   q4: 16 bytes, byte j = weight j (low nibble) and weight j+16 (high nibble), GGUF's order;
//       w = q * scale + offset (Q4_1: offset = m; Q4_0: offset = -8 * scale).
//   q8: 32 signed bytes, w = q * scale (Q8_0).
// Scales and offsets are float16, as in the file: exact, and a sixth of the bytes a step reads instead of a third.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;

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
  int64_t k, groups;
};

Activations quantize_rows(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / kBlock;
  thread_local std::vector<int8_t> q_buffer;
  thread_local std::vector<float> scale_buffer;
  q_buffer.resize(m * k);
  scale_buffer.resize(2 * m * groups);
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q_buffer.data();
  float* sp = scale_buffer.data();
  float* up = sp + m * groups;
  at::parallel_for(0, m * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* v = xp + b * kBlock;
      float amax = 0.f;
      for (int j = 0; j < kBlock; ++j) amax = std::fmax(amax, std::fabs(v[j]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int sum = 0;
      for (int j = 0; j < kBlock; ++j) {
        const int q = static_cast<int>(std::nearbyint(v[j] * inv));
        qp[b * kBlock + j] = static_cast<int8_t>(q);
        sum += q;
      }
      sp[b] = amax / 127.f;
      up[b] = sp[b] * static_cast<float>(sum);
    }
  });
  return {qp, sp, up, k, groups};
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Eight int32 partial dot products of one weight block with one activation block.
inline __m256i dot_q4(__m256i w_unsigned, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w_unsigned, x), _mm256_set1_epi16(1));
}

inline __m256i dot_q8(__m256i w, __m256i x) {
  // vpmaddubsw multiplies unsigned by signed bytes: move w's sign onto x.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
}

inline __m256i load_weight_block(const uint8_t* block, std::true_type /*q4*/) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low4), _mm_and_si128(packed, low4));
}

inline __m256i load_weight_block(const uint8_t* block, std::false_type /*q8*/) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
}

inline float dot(const uint16_t* a_half, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a_half + i)));
    acc = _mm256_fmadd_ps(a, _mm256_loadu_ps(b + i), acc);
  }
  float s = hsum(acc);
  for (; i < n; ++i) s += _cvtsh_ss(a_half[i]) * b[i];
  return s;
}

// kRows activation rows against one weight row. The rows are a template parameter so that their
// accumulators live in registers; two accumulators per row, for even and odd blocks, halve the chain of
// dependent multiply-adds (a single row would wait on each one's latency).
template <bool kQ4, int kRows>
void dot_rows(const Activations& x, const uint8_t* wrow, const uint16_t* srow, const uint16_t* orow, float* y, int64_t y_stride) {
  constexpr int64_t bytes_per_block = kQ4 ? 16 : 32;
  __m256 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  auto block = [&](int64_t g, int parity) {
    const __m256i w = load_weight_block(wrow + g * bytes_per_block, std::bool_constant<kQ4>{});
    for (int r = 0; r < kRows; ++r) {
      const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + r * x.k + g * kBlock));
      const __m256i d = kQ4 ? dot_q4(w, xb) : dot_q8(w, xb);
      acc[r][parity] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(_cvtsh_ss(srow[g]) * x.scale[r * x.groups + g]), acc[r][parity]);
    }
  };
  int64_t g = 0;
  for (; g + 2 <= x.groups; g += 2) {
    block(g, 0);
    block(g + 1, 1);
  }
  if (g < x.groups) block(g, 0);
  for (int r = 0; r < kRows; ++r) {
    float v = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
    if constexpr (kQ4) v += dot(orow, x.sum + r * x.groups, x.groups);
    y[r * y_stride] = v;
  }
}

template <bool kQ4>
void matmul_rows(const Activations& x0, int64_t m, const uint8_t* weight, const uint16_t* scale, const uint16_t* offset,
                 int64_t n_rows, float* y) {
  const int64_t k = x0.k, groups = x0.groups, row_bytes = groups * (kQ4 ? 16 : 32);
  at::parallel_for(0, n_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* wrow = weight + n * row_bytes;
      const uint16_t* srow = scale + n * groups;
      const uint16_t* orow = kQ4 ? offset + n * groups : nullptr;
      for (int64_t r = 0; r < m;) {
        const Activations x{x0.q + r * k, x0.scale + r * groups, x0.sum + r * groups, k, groups};
        float* yr = y + r * n_rows + n;
        switch (std::min<int64_t>(m - r, 4)) {
          case 4: dot_rows<kQ4, 4>(x, wrow, srow, orow, yr, n_rows); r += 4; break;
          case 3: dot_rows<kQ4, 3>(x, wrow, srow, orow, yr, n_rows); r += 3; break;
          case 2: dot_rows<kQ4, 2>(x, wrow, srow, orow, yr, n_rows); r += 2; break;
          default: dot_rows<kQ4, 1>(x, wrow, srow, orow, yr, n_rows); r += 1; break;
        }
      }
    }
  });
}

const uint16_t* half_bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); }

void check(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, at::ScalarType weight_type, int64_t bytes_per_block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous [M, K] float32 tensor");
  TORCH_CHECK(x.size(1) % kBlock == 0, "K must be a multiple of 32, got ", x.size(1));
  TORCH_CHECK(weight.scalar_type() == weight_type && weight.is_contiguous(), "weight must be contiguous ", weight_type);
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.is_contiguous(), "scales must be contiguous float16");
  TORCH_CHECK(weight.size(1) == x.size(1) / kBlock * bytes_per_block, "weight has ", weight.size(1),
              " bytes per row, expected ", x.size(1) / kBlock * bytes_per_block);
  TORCH_CHECK(scale.size(0) == weight.size(0) && scale.size(1) == x.size(1) / kBlock, "scales must be [N, K / 32]");
}

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& offset) {
  check(x, weight, scale, at::kByte, 16);
  TORCH_CHECK(offset.sizes() == scale.sizes() && offset.scalar_type() == at::kHalf && offset.is_contiguous(), "offsets must be like scales");
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  matmul_rows<true>(quantize_rows(x), x.size(0), weight.data_ptr<uint8_t>(), half_bits(scale), half_bits(offset),
                    weight.size(0), y.data_ptr<float>());
  return y;
}

at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  check(x, weight, scale, at::kChar, 32);
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  matmul_rows<false>(quantize_rows(x), x.size(0), reinterpret_cast<const uint8_t*>(weight.data_ptr<int8_t>()), half_bits(scale), nullptr,
                     weight.size(0), y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY(tokenloop, m) {
  m.def("q4_matmul(Tensor x, Tensor weight, Tensor scale, Tensor offset) -> Tensor");
  m.def("q8_matmul(Tensor x, Tensor weight, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloop, CPU, m) {
  m.impl("q4_matmul", &q4_matmul);
  m.impl("q8_matmul", &q8_matmul);
}
