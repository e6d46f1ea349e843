// The KV cache as tokenloop's kernels take it: per layer, k_cache and v_cache [kv_heads, slots, head_dim],
// alike, contiguous, float16 (the fast path) or float32.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

inline void check_kv_caches(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache must be alike [kv_heads, slots, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == at::kHalf || k_cache.scalar_type() == at::kFloat, "the caches must be float16 or float32");
}

// fn(k, v) with the caches' data as at::Half* or float* (checked by check_kv_caches).
template <typename Fn>
inline void with_cache_data(const at::Tensor& k_cache, const at::Tensor& v_cache, Fn&& fn) {
  if (k_cache.scalar_type() == at::kHalf)
    fn(k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>());
  else
    fn(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
}
