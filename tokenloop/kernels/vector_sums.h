// Sums across vector lanes, shared by the kernels: a horizontal sum of 8 floats, and the softmax's exp-and-sum.
// Include after CPU_CAPABILITY is defined (at::vec picks its vector width from it); internal linkage, since that
// width may differ from one source file to the next.
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// p[j] = exp(p[j] - max) for j < n; returns their sum. Masked scores are -inf and become 0.
inline float exp_and_sum(float* p, int64_t n, float max) {
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

}  // namespace
