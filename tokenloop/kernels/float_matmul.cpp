// y = x W^T for float32 weights and a few activation rows: decode and verify steps of the exact float32 path.
//
// For two to a few dozen rows, BLAS's general matrix product first packs the weight matrix (another pass over
// every weight, and a write) and costs about twice its one-row product, which reads each weight once: a
// verify step of k + 1 query tokens then costs two decode steps. Here each triple of weight rows is read once and
// multiplied with every activation row while it sits in L1, so any row count up to kMaxRows costs about one
// pass over the weights. Each output is the same sequence of vector multiply-adds over K, then one horizontal
// sum, whatever the row count or tiling: a row's result does not depend on the rows beside it (so decoding and
// verifying give the same floats). Above kMaxRows (prefill) the product is BLAS's.
#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>

#include "parallel.h"

namespace {

constexpr int64_t kMaxRows = 32;

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One vector of floats: 16 lanes where the library is built with AVX-512 (32 registers: a 4 x 6 tile), else 8
// (AVX2's 16 registers: a 4 x 3 tile). The choice is made once per build, so every row count runs the same lanes.
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
#else
using Vec = __m256;
constexpr int64_t kLanes = 8;
constexpr int kCols = 3;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return hsum8(v); }
#endif

// kRows activation rows (x, stride k) against c weight rows (w, stride k): y[r * y_stride + c].
template <int kRows, int kTileCols>
void dot_tile(const float* x, const float* w, int64_t k, float* y, int64_t y_stride) {
  Vec acc[kRows][kTileCols];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kTileCols; ++c) acc[r][c] = vzero();
  for (int64_t i = 0; i < k; i += kLanes) {
    Vec wv[kTileCols];
    for (int c = 0; c < kTileCols; ++c) wv[c] = vload(w + c * k + i);
    for (int r = 0; r < kRows; ++r) {
      const Vec xv = vload(x + r * k + i);
      for (int c = 0; c < kTileCols; ++c) acc[r][c] = vfmadd(xv, wv[c], acc[r][c]);
    }
  }
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

at::Tensor f32_matmul(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a [M, K] float32 tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.size(1) == x.size(1), "weight must be a [N, K] float32 tensor");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  if (m > kMaxRows || k % kLanes != 0 || !weight.is_contiguous()) return at::mm(x, weight.t());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  const float *xp = xc.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Work in groups of kCols weight rows (4 x kCols accumulators, kCols weight and 1 activation registers);
  // chunks of at least 48 weight rows keep each thread's reads long and sequential.
  const int64_t groups = n / kCols;
  parallel_chunks(groups, chunk_size(groups, 48 / kCols), [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) rows_against<kCols>(xp, m, wp + kCols * g * k, k, yp + kCols * g, n);
  });
  for (int64_t c = kCols * groups; c < n; ++c) rows_against<1>(xp, m, wp + c * k, k, yp + c, n);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloop, m) { m.def("f32_matmul(Tensor x, Tensor weight) -> Tensor"); }

TORCH_LIBRARY_IMPL(tokenloop, CPU, m) { m.impl("f32_matmul", &f32_matmul); }
