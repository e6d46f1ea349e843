// y = x W^T for float32 weights: every product of the exact float32 path (decode, verify and prefill alike).
//
// Each output is the same sequence of vector multiply-adds over K, then one horizontal sum, whatever the row
// count, the tiling or the thread count (threads share out outputs, never K): a row's result does not depend on
// the rows beside it, so a token gets the same floats decoded, verified, or prefilled in a chunk of any size.
// BLAS is not used for any size: its summation order changes with the shape of the product.
//
// For two to a few dozen rows, BLAS's general matrix product first packs the weight matrix (another pass over
// every weight, and a write) and costs about twice its one-row product. Here each group of weight rows is read
// once per block of up to kRowBlock activation rows and multiplied with all of them while it sits in L1, so a
// decode or verify step costs about one pass over the weights; a prefill goes block by block, each block's
// activations staying in L2 while the weights stream past.
#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "aoti_shims.h"
#include "parallel.h"

namespace {

constexpr int64_t kRowBlock = 64;

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One vector of floats: 16 lanes where the library is built with AVX-512 (32 registers: a 4 x 6 tile), else 8
// (AVX2's 16 registers: a 4 x 3 tile). The choice is made once per build, so every row count runs the same lanes.
// K's last k % kLanes floats are read by a masked load (zeros beyond K), the same way for every output.
#ifdef __AVX512F__
using Vec = __m512;
constexpr int64_t kLanes = 16;
constexpr int kCols = 6;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) {
  return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}
struct TailLoad {
  __mmask16 mask;
  explicit TailLoad(int64_t n) : mask(static_cast<__mmask16>((1u << n) - 1)) {}
  Vec operator()(const float* p) const { return _mm512_maskz_loadu_ps(mask, p); }
};
#else
using Vec = __m256;
constexpr int64_t kLanes = 8;
constexpr int kCols = 3;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return hsum8(v); }
struct TailLoad {
  __m256i mask;
  explicit TailLoad(int64_t n)
      : mask(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))) {}
  Vec operator()(const float* p) const { return _mm256_maskload_ps(p, mask); }
};
#endif

// kRows activation rows (x, stride k) against kTileCols weight rows (w, stride k): y[r * y_stride + c].
template <int kRows, int kTileCols>
void dot_tile(const float* x, const float* w, int64_t k, float* y, int64_t y_stride) {
  Vec acc[kRows][kTileCols];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kTileCols; ++c) acc[r][c] = vzero();
  const auto step = [&](int64_t i, auto load) {
    Vec wv[kTileCols];
    for (int c = 0; c < kTileCols; ++c) wv[c] = load(w + c * k + i);
    for (int r = 0; r < kRows; ++r) {
      const Vec xv = load(x + r * k + i);
      for (int c = 0; c < kTileCols; ++c) acc[r][c] = vfmadd(xv, wv[c], acc[r][c]);
    }
  };
  const int64_t body = k - k % kLanes;
  for (int64_t i = 0; i < body; i += kLanes) step(i, vload);
  if (body < k) step(body, TailLoad(k - body));
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kTileCols; ++c) y[r * y_stride + c] = vsum(acc[r][c]);
}

// All m rows against kTileCols weight rows: tiles of 4 rows, then one tile of the 1 to 3 left.
template <int kTileCols>
void rows_against(const float* x, int64_t m, const float* w, int64_t k, float* y, int64_t n) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) dot_tile<4, kTileCols>(x + r * k, w, k, y + r * n, n);
  switch (m - r) {
    case 3: dot_tile<3, kTileCols>(x + r * k, w, k, y + r * n, n); break;
    case 2: dot_tile<2, kTileCols>(x + r * k, w, k, y + r * n, n); break;
    case 1: dot_tile<1, kTileCols>(x + r * k, w, k, y + r * n, n); break;
    default: break;
  }
}

// rows_against for the last group of weight rows, which may hold fewer than kCols (cols of them).
template <int kTileCols = kCols>
void rows_against_cols(int cols, const float* x, int64_t m, const float* w, int64_t k, float* y, int64_t n) {
  if constexpr (kTileCols > 0) {
    if (cols == kTileCols) return rows_against<kTileCols>(x, m, w, k, y, n);
    rows_against_cols<kTileCols - 1>(cols, x, m, w, k, y, n);
  }
}

at::Tensor f32_matmul(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a [M, K] float32 tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.size(1) == x.size(1), "weight must be a [N, K] float32 tensor");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Work in groups of kCols weight rows (4 x kCols accumulators, kCols weight and 1 activation registers), the
  // last group possibly shorter, and blocks of kRowBlock activation rows. A unit of work is one row block against
  // a chunk of at least 48 weight rows (each thread's weight reads long and sequential).
  const int64_t groups = (n + kCols - 1) / kCols, row_blocks = (m + kRowBlock - 1) / kRowBlock;
  const int64_t chunk = chunk_size(groups, 48 / kCols);
  const int64_t chunks = (groups + chunk - 1) / chunk;
  parallel_chunks(row_blocks * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t row = unit / chunks * kRowBlock, rows = std::min(kRowBlock, m - row);
      const int64_t first = unit % chunks * chunk, last = std::min(groups, first + chunk);
      for (int64_t g = first; g < last; ++g) {
        const int cols = static_cast<int>(std::min<int64_t>(kCols, n - kCols * g));
        rows_against_cols(cols, xp + row * k, rows, wp + kCols * g * k, k, yp + row * n + kCols * g, n);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloop, m) { m.def("f32_matmul(Tensor x, Tensor weight) -> Tensor"); }

TORCH_LIBRARY_IMPL(tokenloop, CPU, m) { m.impl("f32_matmul", &f32_matmul); }

AOTITorchError aoti_torch_cpu_f32_matmul(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(*ret0 = aoti_shim::output(f32_matmul(aoti_shim::tensor(x), aoti_shim::tensor(weight)));)
}
