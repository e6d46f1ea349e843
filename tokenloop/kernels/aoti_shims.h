// The ops' entry points for the compiled decode step (engine/compiled_decode.py). AOTInductor calls an op it has
// no C function for through its proxy executor: the arguments boxed into a stack, the op looked up by name, the
// dispatcher, the outputs unboxed; a few microseconds each, and a SmolLM2 decode step makes about 200 such calls.
// With a C function (AOTInductor's C shim convention: tensors as handles, an optional tensor as a pointer to one or
// null, strings as C strings, each output through a pointer, retN, and an op without one given a null pointer,
// no_output) the package calls the kernel directly.
//
// These declarations are the one list of them: the sources define each beside its op (the compiler checks them
// against these), and kernels/__init__.py reads them from here for inductor (aot_inductor.custom_ops_to_c_shims),
// one declaration a line, named aoti_torch_cpu_<op>.
#pragma once

#include <torch/csrc/inductor/aoti_torch/utils.h>

extern "C" {
AOTITorchError aoti_torch_cpu_q4_matmul(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle offset, AtenTensorHandle* scale_per_256, AtenTensorHandle* offset_per_256, AtenTensorHandle* ret0);
AOTITorchError aoti_torch_cpu_q8_matmul(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle* scale_per_256, AtenTensorHandle* ret0);
AOTITorchError aoti_torch_cpu_q5_matmul(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle* ret0);
AOTITorchError aoti_torch_cpu_q4_gated_matmul(AtenTensorHandle gate_up, AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle offset, const char* activation, AtenTensorHandle* scale_per_256, AtenTensorHandle* offset_per_256, AtenTensorHandle* ret0);
AOTITorchError aoti_torch_cpu_q8_gated_matmul(AtenTensorHandle gate_up, AtenTensorHandle weight, AtenTensorHandle scale, const char* activation, AtenTensorHandle* scale_per_256, AtenTensorHandle* ret0);
AOTITorchError aoti_torch_cpu_q5_gated_matmul(AtenTensorHandle gate_up, AtenTensorHandle weight, AtenTensorHandle scale, const char* activation, AtenTensorHandle* ret0);
AOTITorchError aoti_torch_cpu_f32_matmul(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle* ret0);
AOTITorchError aoti_torch_cpu_rms_norm(AtenTensorHandle x, AtenTensorHandle weight, double eps, AtenTensorHandle* ret0);
AOTITorchError aoti_torch_cpu_rotary_cache_write(AtenTensorHandle qkv, AtenTensorHandle cos, AtenTensorHandle sin, AtenTensorHandle k_cache, AtenTensorHandle v_cache, AtenTensorHandle slot_mapping, int64_t block_size, int64_t q_heads, AtenTensorHandle* q_norm, AtenTensorHandle* k_norm, double eps, AtenTensorHandle* no_output);
AOTITorchError aoti_torch_cpu_paged_attention(AtenTensorHandle q, AtenTensorHandle k_cache, AtenTensorHandle v_cache, AtenTensorHandle block_tables, int64_t block_size, AtenTensorHandle query_start, AtenTensorHandle query_count, AtenTensorHandle first_position, int64_t window, double scale, AtenTensorHandle* ret0);
}

namespace aoti_shim {

inline const at::Tensor& tensor(AtenTensorHandle handle) { return *torch::aot_inductor::tensor_handle_to_tensor_pointer(handle); }

inline std::optional<at::Tensor> optional(AtenTensorHandle* handle) {
  return handle == nullptr ? std::nullopt : std::optional<at::Tensor>(tensor(*handle));
}

inline AtenTensorHandle output(at::Tensor&& t) { return torch::aot_inductor::new_tensor_handle(std::move(t)); }

}  // namespace aoti_shim
