// Rotary embedding and KV cache write in one pass over a step's fused q/k/v projection, for eager steps
// (prefill and mixed batches; the compiled decode step has inductor fuse the same ops). Eager PyTorch makes
// five passes over the new tokens' q and k (negate, concatenate, two products, a sum), then converts k and v
// to the cache's dtype and copies them into their slots: at 2,048 prompt tokens, about 8% of the step.
//
// qkv [T, (q_heads + 2 kv_heads) * D] float32, the projection's output: q and k are rotated in place
// (rotate-half RoPE: x * cos + rotate_half(x) * sin, cos and sin [T, D]); k and v are also written to
// k_cache and v_cache (kv_cache.h: [kv_heads, slots, width] in blocks of block_size; an int8 cache's quantized per
// token and head) at slot slot_mapping[t]. With q_norm and k_norm ([D] float32 each, Gemma 3's per-head norms),
// each query and key head is RMS-normalised first, as the eager norms would (five passes each, and a copy to put
// q, k and v back together).
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "aoti_shims.h"
#include "kv_cache.h"
#include "rms_norm.h"

namespace {

// out = x * cos + rotate_half(x) * sin for one head of D values (rotate_half(x) = [-x2, x1]).
inline void rotate(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    out[i] = x1 * cos[i] - x2 * sin[i];
    out[i + half] = x2 * cos[i + half] + x1 * sin[i + half];
  }
}

template <typename T>
void rotary_cache_rows(float* qkv, const float* cos, const float* sin, T* k_cache, T* v_cache, const int64_t* slot_mapping, int64_t tokens,
                       int64_t q_heads, int64_t kv_heads, int64_t slots, int64_t d, int64_t width, int64_t block_size, const float* q_norm,
                       const float* k_norm, float eps) {
  const int64_t row_width = (q_heads + 2 * kv_heads) * d;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    float rotated[1024];  // one head; D <= 1024 is checked
    for (int64_t t = begin; t < end; ++t) {
      float* row = qkv + t * row_width;
      const float *c = cos + t * d, *s = sin + t * d;
      for (int64_t h = 0; h < q_heads + kv_heads; ++h) {
        float* x = row + h * d;
        if (const float* norm = h < q_heads ? q_norm : k_norm) rms_normalize(x, norm, eps, d, x);
        rotate(x, c, s, d, rotated);
        for (int64_t i = 0; i < d; ++i) x[i] = rotated[i];
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        const float* k = row + (q_heads + h) * d;
        const float* v = row + (q_heads + kv_heads + h) * d;
        const int64_t block = h * slots + slot_mapping[t] / block_size * block_size, j = slot_mapping[t] % block_size;
        T* k_out = k_cache + block * width;
        T* v_out = v_cache + block * width;
        if constexpr (std::is_same_v<T, int8_t>) {
          block_scales(k_out, block_size, d)[j] = quantize_int8(k, d, [&](int64_t i, int8_t q) { k_out[key_offset<T>(j, i, block_size)] = q; });
          block_scales(v_out, block_size, d)[j] = quantize_int8(v, d, [&](int64_t i, int8_t q) { v_out[value_offset<T>(j, i, d)] = q; });
        } else {
          for (int64_t i = 0; i < d; ++i) {
            k_out[key_offset<T>(j, i, block_size)] = static_cast<T>(k[i]);
            v_out[value_offset<T>(j, i, d)] = static_cast<T>(v[i]);
          }
        }
      }
    }
  });
}

void rotary_cache_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& slot_mapping, int64_t block_size, int64_t q_heads, const std::optional<at::Tensor>& q_norm,
                        const std::optional<at::Tensor>& k_norm, double eps) {
  check_kv_caches(k_cache, v_cache, block_size);
  const int64_t kv_heads = k_cache.size(0), slots = k_cache.size(1), width = k_cache.size(2), d = cache_head_dim(k_cache), tokens = qkv.size(0);
  TORCH_CHECK(d % 2 == 0 && d <= 1024, "head_dim must be even and at most 1024, got ", d);
  TORCH_CHECK(k_cache.scalar_type() != at::kChar || d % 4 == 0, "an int8 cache needs head_dim a multiple of 4, got ", d);
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous() && qkv.size(1) == (q_heads + 2 * kv_heads) * d,
              "qkv must be a contiguous [T, (q_heads + 2 * kv_heads) * head_dim] float32 tensor");
  for (const auto* table : {&cos, &sin})
    TORCH_CHECK(table->scalar_type() == at::kFloat && table->is_contiguous() && table->sizes() == at::IntArrayRef({tokens, d}),
                "cos and sin must be contiguous [T, head_dim] float32 tensors");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == tokens,
              "slot_mapping must be a contiguous [T] int64 tensor");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together");
  for (const auto* norm : {&q_norm, &k_norm})
    TORCH_CHECK(!norm->has_value() || ((*norm)->scalar_type() == at::kFloat && (*norm)->is_contiguous() && (*norm)->sizes() == at::IntArrayRef({d})),
                "q_norm and k_norm must be contiguous [head_dim] float32 tensors");
  const float* q_w = q_norm ? q_norm->data_ptr<float>() : nullptr;
  const float* k_w = k_norm ? k_norm->data_ptr<float>() : nullptr;
  float* x = qkv.data_ptr<float>();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "slot ", slot[t], " is outside the cache's ", slots, " slots");
  with_cache_data(k_cache, v_cache, [&](auto* k, auto* v) {
    rotary_cache_rows(x, cos.data_ptr<float>(), sin.data_ptr<float>(), k, v, slot, tokens, q_heads, kv_heads, slots, d, width, block_size, q_w, k_w, static_cast<float>(eps));
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloop, m) {
  m.def("rotary_cache_write(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, int block_size, "
        "int q_heads, Tensor? q_norm=None, Tensor? k_norm=None, float eps=0.0) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloop, CPU, m) { m.impl("rotary_cache_write", &rotary_cache_write); }

AOTITorchError aoti_torch_cpu_rotary_cache_write(AtenTensorHandle qkv, AtenTensorHandle cos, AtenTensorHandle sin, AtenTensorHandle k_cache, AtenTensorHandle v_cache, AtenTensorHandle slot_mapping, int64_t block_size, int64_t q_heads, AtenTensorHandle* q_norm, AtenTensorHandle* k_norm, double eps, AtenTensorHandle* no_output) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(rotary_cache_write(aoti_shim::tensor(qkv), aoti_shim::tensor(cos), aoti_shim::tensor(sin), aoti_shim::tensor(k_cache), aoti_shim::tensor(v_cache), aoti_shim::tensor(slot_mapping), block_size, q_heads, aoti_shim::optional(q_norm), aoti_shim::optional(k_norm), eps);)
}
