// y = x W^T for float32 weights and a few activation rows: decode and verify steps of the exact float32 path.
//
// For two to a few dozen rows, BLAS's general matrix product first packs the weight matrix (another pass over
// every weight, and a write) and costs about twice its one-row product, which reads each weight once: a
// verify step of k + 1 query tokens then costs two decode steps. Here each triple of weight rows is read once and
// multiplied with every activation row while it sits in L1, so any row count up to kMaxRows costs about one
// pass over the weights. Each output is the same sequence of 8-lane multiply-adds over K, then one horizontal
// sum, whatever the row count or tiling: a row's result does not depend on the rows beside it (so decoding and
// verifying give the same floats). Above kMaxRows (prefill) the product is BLAS's.
#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
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

// kRows activation rows (x, stride k) against kCols weight rows (w, stride k): y[r * y_stride + c].
template <int kRows, int kCols>
void dot_tile(const float* x, const float* w, int64_t k, float* y, int64_t y_stride) {
  __m256 acc[kRows][kCols];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    __m256 wv[kCols];
    for (int c = 0; c < kCols; ++c) wv[c] = _mm256_loadu_ps(w + c * k + i);
    for (int r = 0; r < kRows; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * k + i);
      for (int c = 0; c < kCols; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) y[r * y_stride + c] = hsum8(acc[r][c]);
}

// All m rows against kCols weight rows, in tiles of up to 4 rows.
template <int kCols>
void rows_against(const float* x, int64_t m, const float* w, int64_t k, float* y, int64_t n) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) dot_tile<4, kCols>(x + r * k, w, k, y + r * n, n);
  for (; r < m; ++r) dot_tile<1, kCols>(x + r * k, w, k, y + r * n, n);
}

at::Tensor f32_matmul(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a [M, K] float32 tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.size(1) == x.size(1), "weight must be a [N, K] float32 tensor");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  if (m > kMaxRows || k % 8 != 0 || !weight.is_contiguous()) return at::mm(x, weight.t());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  const float *xp = xc.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Work in triples of weight rows (a 4 x 3 tile: 12 accumulators, 3 weight and 1 activation registers of
  // AVX2's 16); chunks of at least 16 triples keep each thread's reads long and sequential.
  const int64_t triples = n / 3;
  parallel_chunks(triples, chunk_size(triples, 16), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rows_against<3>(xp, m, wp + 3 * t * k, k, yp + 3 * t, n);
  });
  for (int64_t c = 3 * triples; c < n; ++c) rows_against<1>(xp, m, wp + c * k, k, yp + c, n);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloop, m) { m.def("f32_matmul(Tensor x, Tensor weight) -> Tensor"); }

TORCH_LIBRARY_IMPL(tokenloop, CPU, m) { m.impl("f32_matmul", &f32_matmul); }
