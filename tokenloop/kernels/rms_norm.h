// RMSNorm of one row in one pass, out = weight * (x / sqrt(mean(x^2) + eps)), as the eager ops compute it (float32,
// each product rounded on its own), for rms_norm.cpp and for the per-head query and key norms of rotary_cache.cpp.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

// The sum of x^2 over n floats, in 8 lanes, then across them.
inline float sum_squares(const float* x, int64_t n) {
  __m256 lanes = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    lanes = _mm256_add_ps(lanes, _mm256_mul_ps(v, v));
  }
  alignas(32) float parts[8];
  _mm256_store_ps(parts, lanes);
  float sum = 0.0f;
  for (const float part : parts) sum += part;
  for (; i < n; ++i) sum += x[i] * x[i];
  return sum;
}

// out may be x (in place).
inline void rms_normalize(const float* x, const float* weight, float eps, int64_t n, float* out) {
  const float inverse_rms = 1.0f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inverse_rms);
}
