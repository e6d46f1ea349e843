// RMSNorm over the rows of an eager step's activations in one pass per row. Eager PyTorch makes five (square,
// mean, add eps, reciprocal square root, product) and a sixth for the weight: Gemma 3's four norms per layer took
// about 5% of a 1,024-token prefill that way. The compiled decode step leaves the same ops to inductor.
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "aoti_shims.h"
#include "rms_norm.h"

namespace {

// x [T, D] float32, weight [D] float32 → weight * x / rms(x) per row, a new tensor.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous [T, D] float32 tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.size(0) == x.size(1),
              "weight must be a contiguous [D] float32 tensor, D = ", x.size(1));
  at::Tensor out = at::empty_like(x);
  const int64_t d = x.size(1);
  const float *in = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rms_normalize(in + t * d, w, static_cast<float>(eps), d, y + t * d);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloop, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(tokenloop, CPU, m) { m.impl("rms_norm", &rms_norm); }

AOTITorchError aoti_torch_cpu_rms_norm(AtenTensorHandle x, AtenTensorHandle weight, double eps, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(*ret0 = aoti_shim::output(rms_norm(aoti_shim::tensor(x), aoti_shim::tensor(weight), eps));)
}
