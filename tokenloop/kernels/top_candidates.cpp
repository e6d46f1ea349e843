// The sampler's distribution, for temperature, top-k and top-p sampling: each row's softmax at its temperature,
// p = exp(s - max s) / sum exp(s - max s) with s = x / t. softmax_normalizers finds each row's max and sum in two
// passes that write nothing; from them, scaled_softmax gives whole rows and top_candidates a row's k most likely
// tokens in the stable descending order of s (equal values: the lower index first, as a stable sort of the row puts
// them) with their probabilities. One definition of the floats for all three, each row on its own, in one fixed
// order whatever the threads or the other rows: a token's probability among the candidates is the same float as in
// the whole distribution. The division by the temperature, the softmax and the selection were each a pass writing
// or reading [rows, vocab] floats: most of a sampled step's sampling.
//
// The selection is one pass over the row against the k-th largest so far, instead of torch.topk's (whose order among
// ties is arbitrary) and the two argsorts that made it stable: a value enters only when it is not below the current
// k-th, so after the first few thousand of a row's logits nearly every one is rejected by one comparison. Values compare
// as floats, NaN above everything (as torch.sort ranks it); the order is a total one, so the result is one fixed
// list. A row holding a NaN has NaN probabilities (no token to sample). The greedy choice, argmax, is here too: the
// first largest value of a row, as torch's.
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <vector>

namespace {

// A value's place in the stable descending order as one integer, larger first: the float's bits made to order as
// unsigned integers (NaN above everything, -0 equal to +0, as the floats compare), then the lower index first among
// equal values. Comparing these is one instruction, where comparing floats with NaN and ties took several branches.
inline uint64_t order_key(float v, int64_t i) {
  uint32_t bits = 0xFFFFFFFFu;
  if (!std::isnan(v)) {
    v = v == 0.f ? 0.f : v;
    std::memcpy(&bits, &v, sizeof(bits));
    bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  }
  return static_cast<uint64_t>(bits) << 32 | (0xFFFFFFFFu - static_cast<uint32_t>(i));
}

inline int64_t key_index(uint64_t key) { return 0xFFFFFFFFu - static_cast<uint32_t>(key); }

// The value of a key (NaN for any NaN).
inline float key_value(uint64_t key) {
  const uint32_t ordered = static_cast<uint32_t>(key >> 32);
  if (ordered == 0xFFFFFFFFu) return NAN;
  const uint32_t bits = (ordered & 0x80000000u) ? (ordered & 0x7FFFFFFFu) : ~ordered;
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// A bar on x itself for a bar on s = x / t: every x below it has x / t below `bar` (IEEE division by t > 0 rounds
// monotonically), so a scan divides only the values that may enter. NaN where `bar` is (everything may enter), and
// -inf (no x is ruled out) where no such float turns up within a few below bar * t.
inline float bar_on_x(float bar, float t) {
  if (std::isnan(bar)) return NAN;
  float x = bar * t;
  for (int step = 0; step < 4; ++step, x = std::nextafter(x, -INFINITY))
    if (x / t < bar) return x;
  return -INFINITY;
}

// The k most likely of one row: the ids of its k largest s = x / t in the stable descending order, into index.
// Values that may belong go into a buffer; when it holds 2k, the k first in the order stay (nth_element) and the
// k-th of them becomes the bar to enter. A heap of the k kept did the same with a logarithmic step per entry, and
// entries are many at the wider selections (the 2,048 most likely of 3 rows of 262k logits: 2.9 ms, here 1.2).
void row_top(const float* x, int64_t vocab, float t, int64_t k, int64_t* index) {
  thread_local std::vector<uint64_t> kept;
  kept.clear();
  kept.reserve(2 * k + 8);
  float bar = -INFINITY;  // the k-th kept value once k are kept: nothing below it can enter (a NaN bar admits all)
  float x_bar = -INFINITY;  // bar_on_x(bar, t)
  auto compact = [&] {
    std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), std::greater<>());
    kept.resize(k);
    bar = key_value(kept[k - 1]);
    x_bar = bar_on_x(bar, t);
  };
  auto offer = [&](int64_t i, float s) {
    if (!(s < bar)) kept.push_back(order_key(s, i));
    if (static_cast<int64_t>(kept.size()) >= 2 * k) compact();
  };
  int64_t i = 0;
  // 8 at a time: a value below the bar (and not NaN) cannot enter; only the others are offered, and only vectors
  // with an x at or above x_bar are divided at all.
  const __m256 tv = _mm256_set1_ps(t);
  alignas(32) float s[8];
  for (; i + 8 <= vocab; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(xv, _mm256_set1_ps(x_bar), _CMP_NLT_UQ)) == 0) continue;
    const __m256 chunk = _mm256_div_ps(xv, tv);  // IEEE division, as the scalar one
    const int may_enter = _mm256_movemask_ps(_mm256_cmp_ps(chunk, _mm256_set1_ps(bar), _CMP_NLT_UQ));  // >= or NaN
    if (may_enter == 0) continue;
    _mm256_store_ps(s, chunk);
    for (int j = 0; j < 8; ++j)
      if (may_enter >> j & 1) offer(i + j, s[j]);
  }
  for (; i < vocab; ++i) offer(i, x[i] / t);
  if (static_cast<int64_t>(kept.size()) > k) compact();
  std::sort(kept.begin(), kept.end(), std::greater<>());
  for (int64_t j = 0; j < k; ++j) index[j] = key_index(kept[j]);
}

// The largest x of one row (NaN if any x is NaN). Dividing by t > 0 keeps the order (rounding is monotonic), so the
// largest s = x / t is this divided by t: one pass that writes nothing.
float row_max(const float* x, int64_t vocab) {
  __m256 largest = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= vocab; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    largest = _mm256_max_ps(largest, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, largest);
  float m = lanes[0];
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (int j = 1; j < 8; ++j) m = std::max(m, lanes[j]);
  for (; i < vocab; ++i) {
    any_nan |= std::isnan(x[i]);
    m = std::max(m, x[i]);
  }
  return any_nan ? NAN : m;
}

// The first index of row x's largest value, as torch.argmax picks it: the first NaN if it holds any (NaN ranks above
// every number), else the first value equal to the largest (-0 and +0 being equal). Two passes that write nothing:
// row_max, then a vector comparison to the first match.
int64_t row_argmax(const float* x, int64_t vocab) {
  const float m = row_max(x, vocab);
  const bool nan = std::isnan(m);
  const __m256 mv = _mm256_set1_ps(m);
  int64_t i = 0;
  for (; i + 8 <= vocab; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const int hits = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, mv, _CMP_EQ_OQ));
    if (hits != 0) return i + __builtin_ctz(hits);
  }
  for (; i < vocab; ++i)
    if (nan ? std::isnan(x[i]) : x[i] == m) return i;
  return 0;  // an empty row
}

// exp(v), PyTorch's fast vector exp (the one its softmax uses; below float's smallest normal it gives 0).
inline __m256 exp8(__m256 v) { return at::vec::Vectorized<float>(v).exp_u20(); }

// exp(x / t - m) of n values, 8 at a time (the last few padded with -inf, whose exp is 0): every value goes through
// the one vector division and exp, wherever it lies. Written to e (which may be x; nullptr: only summed); returns
// their sum, lane by lane, then the lanes in order. A row whose largest value is not finite (NaN, all -inf, +inf)
// has no distribution: NaN throughout.
float exp_scaled(const float* x, int64_t n, float t, float m, float* e) {
  if (!std::isfinite(m)) {
    if (e != nullptr) std::fill(e, e + n, NAN);
    return NAN;
  }
  const __m256 tv = _mm256_set1_ps(t), mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = exp8(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), tv), mv));
    if (e != nullptr) _mm256_storeu_ps(e + i, v);
    sum = _mm256_add_ps(sum, v);
  }
  if (i < n) {
    alignas(32) float tail[8];
    std::fill(tail, tail + 8, -INFINITY);
    std::copy(x + i, x + n, tail);
    const __m256 v = exp8(_mm256_sub_ps(_mm256_div_ps(_mm256_load_ps(tail), tv), mv));
    _mm256_store_ps(tail, v);
    if (e != nullptr) std::copy(tail, tail + (n - i), e + i);
    sum = _mm256_add_ps(sum, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  float total = 0.0f;
  for (int j = 0; j < 8; ++j) total += lanes[j];
  return total;
}

void check_rows(const at::Tensor& x, const at::Tensor& temperature) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous [R, V] float32 tensor");
  TORCH_CHECK(temperature.dim() == 1 && temperature.scalar_type() == at::kFloat && temperature.is_contiguous() &&
                  temperature.size(0) == x.size(0),
              "temperature must be a contiguous [R] float32 tensor");
}

void check_selection(const at::Tensor& x, const at::Tensor& largest, const at::Tensor& total, const at::Tensor& rows) {
  for (const at::Tensor* n : {&largest, &total})
    TORCH_CHECK(n->dim() == 1 && n->scalar_type() == at::kFloat && n->is_contiguous() && n->size(0) == x.size(0),
                "largest and total must be softmax_normalizers' [R] float32 tensors");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(), "rows must be a contiguous [R'] int64 tensor");
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < rows.size(0); ++j)
    TORCH_CHECK(row[j] >= 0 && row[j] < x.size(0), "rows must be in [0, ", x.size(0), "), got ", row[j]);
}

// Each row's argmax of x [R, V] (float32, contiguous): [R] int64, torch.argmax(x, -1)'s indices. torch's compares one
// value at a time, a few percent of a greedy decode step over a vocabulary of 50k to 262k.
at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0,
              "x must be a contiguous [R, V] float32 tensor, V > 0");
  const int64_t rows = x.size(0), vocab = x.size(1);
  at::Tensor index = at::empty({rows}, x.options().dtype(at::kLong));
  const float* in = x.data_ptr<float>();
  int64_t* out = index.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = row_argmax(in + r * vocab, vocab);
  });
  return index;
}

// Per row of x [R, V] (float32, contiguous) at its temperature [R] (> 0): the largest x / t and the sum of
// exp(x / t - that), the softmax's normaliser [R] each.
std::tuple<at::Tensor, at::Tensor> softmax_normalizers(const at::Tensor& x, const at::Tensor& temperature) {
  check_rows(x, temperature);
  const int64_t rows = x.size(0), vocab = x.size(1);
  at::Tensor largest = at::empty({rows}, x.options()), total = at::empty({rows}, x.options());
  const float* in = x.data_ptr<float>();
  const float* t = temperature.data_ptr<float>();
  float* m = largest.data_ptr<float>();
  float* z = total.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      m[r] = row_max(in + r * vocab, vocab) / t[r];
      z[r] = exp_scaled(in + r * vocab, vocab, t[r], m[r], nullptr);
    }
  });
  return {largest, total};
}

// The rows `rows` [R'] (int64) of x, their softmax [R', V]: exp(x / t - largest) / total (softmax_normalizers').
at::Tensor scaled_softmax(const at::Tensor& x, const at::Tensor& temperature, const at::Tensor& largest,
                          const at::Tensor& total, const at::Tensor& rows) {
  check_rows(x, temperature);
  check_selection(x, largest, total, rows);
  const int64_t vocab = x.size(1), count = rows.size(0);
  at::Tensor out = at::empty({count, vocab}, x.options());
  const float* in = x.data_ptr<float>();
  const float *t = temperature.data_ptr<float>(), *m = largest.data_ptr<float>(), *z = total.data_ptr<float>();
  const int64_t* row = rows.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t r = row[j];
      float* p = o + j * vocab;
      exp_scaled(in + r * vocab, vocab, t[r], m[r], p);
      const __m256 zv = _mm256_set1_ps(z[r]);
      int64_t i = 0;
      for (; i + 8 <= vocab; i += 8) _mm256_storeu_ps(p + i, _mm256_div_ps(_mm256_loadu_ps(p + i), zv));
      for (; i < vocab; ++i) p[i] = p[i] / z[r];
    }
  });
  return out;
}

// The rows `rows` of x: each one's k most likely tokens (1 <= k <= V) in the stable descending order of x / t,
// their probabilities [R', k] (scaled_softmax's floats) and their ids [R', k] int64.
std::tuple<at::Tensor, at::Tensor> top_candidates(const at::Tensor& x, const at::Tensor& temperature,
                                                  const at::Tensor& largest, const at::Tensor& total,
                                                  const at::Tensor& rows, int64_t k) {
  check_rows(x, temperature);
  check_selection(x, largest, total, rows);
  const int64_t vocab = x.size(1), count = rows.size(0);
  TORCH_CHECK(k >= 1 && k <= vocab, "k must be in [1, ", vocab, "], got ", k);
  at::Tensor probs = at::empty({count, k}, x.options());
  at::Tensor index = at::empty({count, k}, x.options().dtype(at::kLong));
  const float* in = x.data_ptr<float>();
  const float *t = temperature.data_ptr<float>(), *m = largest.data_ptr<float>(), *z = total.data_ptr<float>();
  const int64_t* row = rows.data_ptr<int64_t>();
  float* p = probs.data_ptr<float>();
  int64_t* id = index.data_ptr<int64_t>();
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t r = row[j];
      float* row_p = p + j * k;
      int64_t* row_id = id + j * k;
      row_top(in + r * vocab, vocab, t[r], k, row_id);
      for (int64_t c = 0; c < k; ++c) row_p[c] = in[r * vocab + row_id[c]];
      exp_scaled(row_p, k, t[r], m[r], row_p);
      for (int64_t c = 0; c < k; ++c) row_p[c] = row_p[c] / z[r];
    }
  });
  return {probs, index};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloop, m) {
  m.def("argmax(Tensor x) -> Tensor");
  m.def("softmax_normalizers(Tensor x, Tensor temperature) -> (Tensor, Tensor)");
  m.def("scaled_softmax(Tensor x, Tensor temperature, Tensor largest, Tensor total, Tensor rows) -> Tensor");
  m.def(
      "top_candidates(Tensor x, Tensor temperature, Tensor largest, Tensor total, Tensor rows, int k) -> (Tensor, "
      "Tensor)");
}

TORCH_LIBRARY_IMPL(tokenloop, CPU, m) {
  m.impl("argmax", &argmax);
  m.impl("softmax_normalizers", &softmax_normalizers);
  m.impl("scaled_softmax", &scaled_softmax);
  m.impl("top_candidates", &top_candidates);
}
