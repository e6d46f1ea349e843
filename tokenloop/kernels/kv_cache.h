// The KV cache as tokenloop's kernels take it: per layer, k_cache and v_cache [kv_heads, slots, width], alike,
// contiguous, bfloat16 (the fast path where the CPU has AVX512-BF16), float16, float32 or int8. Slot s is position
// s % block_size of cache block s / block_size, and each block's block_size * width elements (per KV head) are
// laid out for attention's products, so that attention reads them where they are:
// - keys dimension-major, [head_dim / K][block_size][K]: one load gives K dimensions of consecutive keys;
// - values key-major, [block_size / E][head_dim][E];
// E = 2 for bfloat16 and int8 (the pairs vdpbf16ps and vpdpwssd multiply), 1 otherwise (values are then plain
// rows); K = E, but 4 for int8 keys (the quadruples vpdpbusd multiplies). An int8 block's keys and values (each
// token's head: q_i * scale) are followed by its block_size float16 scales, so that its rows are head_dim + 2 bytes
// and the scales move with the block. Whole blocks move as they are; models/kv_layout.py is the same layout in
// PyTorch.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

template <typename T>
constexpr int64_t kPairWidth = std::is_same_v<T, at::BFloat16> || std::is_same_v<T, int8_t> ? 2 : 1;
template <typename T>
constexpr int64_t kKeyWidth = std::is_same_v<T, int8_t> ? 4 : kPairWidth<T>;

inline void check_kv_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t block_size) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache must be alike [kv_heads, slots, width]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 || k_cache.scalar_type() == at::kHalf || k_cache.scalar_type() == at::kFloat ||
                  k_cache.scalar_type() == at::kChar,
              "the caches must be bfloat16, float16, float32 or int8");
  TORCH_CHECK(block_size > 0 && block_size % 16 == 0 && k_cache.size(1) % block_size == 0,
              "block_size must be a multiple of 16 that divides the cache's slots, got ", block_size);
  TORCH_CHECK(k_cache.size(2) % 2 == 0, "head_dim must be even, got ", k_cache.size(2));
}

constexpr int64_t kScaleBytes = 2;  // an int8 cache's per-token float16 scale

// The head size of a cache [kv_heads, slots, width]: its rows but for an int8 cache's scale.
inline int64_t cache_head_dim(const at::Tensor& cache) { return cache.size(2) - (cache.scalar_type() == at::kChar ? kScaleBytes : 0); }

// The float16 scales of an int8 block's tokens, after its block_size * d keys or values.
inline at::Half* block_scales(int8_t* block, int64_t block_size, int64_t d) { return reinterpret_cast<at::Half*>(block + block_size * d); }
inline const at::Half* block_scales(const int8_t* block, int64_t block_size, int64_t d) {
  return reinterpret_cast<const at::Half*>(block + block_size * d);
}

// A head's d values x as int8 q_i with x_i ~ q_i * scale, passed to out(i, q_i); returns scale = max |x_i| / 127
// rounded to float16, and q_i = x_i / scale rounded half to even (0 where x is all zeros), as kv_layout.quantize.
template <typename Out>
inline at::Half quantize_int8(const float* x, int64_t d, Out&& out) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::abs(x[i]));
  const at::Half scale = amax / 127.f;
  const float s = scale;
  for (int64_t i = 0; i < d; ++i) out(i, s > 0.f ? static_cast<int8_t>(std::clamp(std::nearbyint(x[i] / s), -127.f, 127.f)) : int8_t{0});
  return scale;
}

// Offsets, within a block, of dimension i of the key and of the value at in-block position j.
template <typename T>
inline int64_t key_offset(int64_t j, int64_t i, int64_t block_size) {
  constexpr int64_t e = kKeyWidth<T>;
  return (i / e * block_size + j) * e + i % e;
}

template <typename T>
inline int64_t value_offset(int64_t j, int64_t i, int64_t d) {
  constexpr int64_t e = kPairWidth<T>;
  return (j / e * d + i) * e + j % e;
}

// fn(k, v) with the caches' data as at::BFloat16*, at::Half*, float* or int8_t* (checked by check_kv_caches).
template <typename Fn>
inline void with_cache_data(const at::Tensor& k_cache, const at::Tensor& v_cache, Fn&& fn) {
  if (k_cache.scalar_type() == at::kBFloat16)
    fn(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
  else if (k_cache.scalar_type() == at::kHalf)
    fn(k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>());
  else if (k_cache.scalar_type() == at::kChar)
    fn(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
  else
    fn(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
}
