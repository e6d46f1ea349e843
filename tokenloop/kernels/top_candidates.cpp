// Each row's k largest values in the stable descending order (equal values: the lower index first, as a stable
// sort of the row puts them), for top-k and top-p sampling: one pass over the row against the k-th largest so
// far, instead of torch.topk's selection (whose order among ties is arbitrary) and the two argsorts that made it
// stable. A value enters only when it beats the current k-th, so after the first few hundred of a row's
// 49,152 logits nearly every one is rejected by one comparison.
//
// Values compare as floats, NaN above everything (as torch.topk ranks it); the order is a total one, so the result
// is one fixed list whatever the threads.
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <tuple>
#include <vector>

namespace {

// Candidate (value, index): `a` before `b` in the stable descending order.
struct Candidate {
  float value;
  int64_t index;
};

inline bool before(const Candidate& a, const Candidate& b) {
  const bool a_nan = std::isnan(a.value), b_nan = std::isnan(b.value);
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && a.value != b.value) return a.value > b.value;
  return a.index < b.index;
}

void row_top(const float* x, int64_t vocab, int64_t k, float* values, int64_t* index) {
  // A heap whose top is the last of the k kept (the one a newcomer must beat).
  std::vector<Candidate> heap;
  heap.reserve(k);
  auto offer = [&](int64_t i) {
    const Candidate c{x[i], i};
    if (static_cast<int64_t>(heap.size()) < k) {
      heap.push_back(c);
      std::push_heap(heap.begin(), heap.end(), before);
    } else if (before(c, heap.front())) {
      std::pop_heap(heap.begin(), heap.end(), before);
      heap.back() = c;
      std::push_heap(heap.begin(), heap.end(), before);
    }
  };
  int64_t i = 0;
  for (; i < std::min(k, vocab); ++i) offer(i);
  // Then 8 at a time: a value below the k-th kept (and not NaN) cannot enter; only the others are offered.
  for (; i + 8 <= vocab; i += 8) {
    const __m256 threshold = _mm256_set1_ps(heap.front().value);
    const __m256 chunk = _mm256_loadu_ps(x + i);
    const int may_enter = _mm256_movemask_ps(_mm256_cmp_ps(chunk, threshold, _CMP_NLT_UQ));  // >= or NaN
    if (may_enter == 0) continue;
    for (int j = 0; j < 8; ++j)
      if (may_enter >> j & 1) offer(i + j);
  }
  for (; i < vocab; ++i) offer(i);
  std::sort_heap(heap.begin(), heap.end(), before);
  for (int64_t j = 0; j < k; ++j) {
    values[j] = heap[j].value;
    index[j] = heap[j].index;
  }
}

// x [R, V] float32 contiguous, 1 <= k <= V: values [R, k] and their indices [R, k] int64, each row in the stable
// descending order.
std::tuple<at::Tensor, at::Tensor> top_candidates(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous [R, V] float32 tensor");
  const int64_t rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK(k >= 1 && k <= vocab, "k must be in [1, ", vocab, "], got ", k);
  at::Tensor values = at::empty({rows, k}, x.options());
  at::Tensor index = at::empty({rows, k}, x.options().dtype(at::kLong));
  const float* in = x.data_ptr<float>();
  float* v = values.data_ptr<float>();
  int64_t* i = index.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row_top(in + r * vocab, vocab, k, v + r * k, i + r * k);
  });
  return {values, index};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloop, m) { m.def("top_candidates(Tensor x, int k) -> (Tensor, Tensor)"); }

TORCH_LIBRARY_IMPL(tokenloop, CPU, m) { m.impl("top_candidates", &top_candidates); }
