// The KV cache as tokenloop's kernels take it: per layer, k_cache and v_cache [kv_heads, slots, head_dim], alike,
// contiguous, bfloat16 (the fast path where the CPU has AVX512-BF16), float16 or float32. Slot s is position
// s % block_size of cache block s / block_size, and each block's block_size * head_dim elements (per KV head) are
// laid out for attention's products, so that attention reads them where they are:
// - keys dimension-major, [head_dim / E][block_size][E]: one load gives a dimension (pair) of consecutive keys;
// - values key-major, [block_size / E][head_dim][E];
// E = 2 for bfloat16 (the pairs vdpbf16ps multiplies), 1 otherwise (values are then plain rows). Whole blocks
// move as they are; models/kv_layout.py is the same layout in PyTorch.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

template <typename T>
constexpr int64_t kPairWidth = std::is_same_v<T, at::BFloat16> ? 2 : 1;

inline void check_kv_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t block_size) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache must be alike [kv_heads, slots, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 || k_cache.scalar_type() == at::kHalf || k_cache.scalar_type() == at::kFloat,
              "the caches must be bfloat16, float16 or float32");
  TORCH_CHECK(block_size > 0 && block_size % 16 == 0 && k_cache.size(1) % block_size == 0,
              "block_size must be a multiple of 16 that divides the cache's slots, got ", block_size);
  TORCH_CHECK(k_cache.size(2) % 2 == 0, "head_dim must be even, got ", k_cache.size(2));
}

// Offsets, within a block, of dimension i of the key and of the value at in-block position j.
template <typename T>
inline int64_t key_offset(int64_t j, int64_t i, int64_t block_size) {
  constexpr int64_t e = kPairWidth<T>;
  return (i / e * block_size + j) * e + i % e;
}

template <typename T>
inline int64_t value_offset(int64_t j, int64_t i, int64_t d) {
  constexpr int64_t e = kPairWidth<T>;
  return (j / e * d + i) * e + j % e;
}

// fn(k, v) with the caches' data as at::BFloat16*, at::Half* or float* (checked by check_kv_caches).
template <typename Fn>
inline void with_cache_data(const at::Tensor& k_cache, const at::Tensor& v_cache, Fn&& fn) {
  if (k_cache.scalar_type() == at::kBFloat16)
    fn(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
  else if (k_cache.scalar_type() == at::kHalf)
    fn(k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>());
  else
    fn(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
}
