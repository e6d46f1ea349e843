// The sampler's exponential race (sampling/sampler.py): token i of a row races with the key p_i / q_i, q_i =
// -log(u_i) ~ Exp(1), and the largest key wins (the first of equal ones): a draw from p. u_i is the token's own
// uniform, (hash(seed, i) >> 8) * 2^-24 in [0, 1), where the seed is the row's for this step (drawn from its
// generator) and the hash a counter-based one: a token's q depends on its seed and id alone, so a row listed by its
// support and the same row whole race alike, and rows run in any order on any thread. (u = 0 makes q = inf, a key of
// 0 that never wins.) torch's exponential_ draws value after value from one generator, serially for each row; here a
// row's draws are a pass of integer mixing.
//
// Most tokens cannot win, and need no logarithm: -log(u) >= 1 - u, so p / q <= p / (1 - u), and a token whose bound
// is below the best key so far (with a margin far wider than the roundings of the log and the division) is passed
// over with the same result as its exact key would give.
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

// Chris Wellons' lowbias32: a bijection of 32-bit integers whose output bits each flip with about half of the
// input bits.
inline uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

inline __m256i mix8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0x846ca68bU)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// The two 32-bit keys a 64-bit seed gives: token i's hash is mix(mix(i ^ a) + b).
struct Keys {
  uint32_t a, b;
  explicit Keys(int64_t seed)
      : a(mix(static_cast<uint32_t>(seed))), b(mix(static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32) ^ a)) {}
};

constexpr float kUnit = 1.0f / 16777216.0f;  // 2^-24

inline float uniform(const Keys& k, int64_t i) {
  return static_cast<float>(mix(mix(static_cast<uint32_t>(i) ^ k.a) + k.b) >> 8) * kUnit;
}

// u for the 8 tokens i .. i + 7.
inline __m256 uniform8(const Keys& k, int64_t i) {
  const __m256i ids = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i h = mix8(_mm256_add_epi32(mix8(_mm256_xor_si256(ids, _mm256_set1_epi32(static_cast<int32_t>(k.a)))),
                                          _mm256_set1_epi32(static_cast<int32_t>(k.b))));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)), _mm256_set1_ps(kUnit));
}

// -log(u), 8 at a time: the one definition of q, for whole rows and listed tokens alike.
inline __m256 exponential8(__m256 u) {
  return _mm256_sub_ps(_mm256_setzero_ps(), at::vec::Vectorized<float>(u).log());
}

// The winner of one row of n probabilities (p > 0 races; 0, or NaN, does not). -1 where none races.
int64_t race_row(const float* p, int64_t n, const Keys& keys) {
  constexpr float kMargin = 1.0f + 1.0f / 65536.0f;
  float best = -1.0f;  // below every racing key (p / q >= 0)
  int64_t winner = -1;
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f), margin = _mm256_set1_ps(kMargin);
  alignas(32) float probs[8], q[8];
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t lanes = std::min<int64_t>(8, n - i);
    __m256 pv;
    if (lanes == 8) {
      pv = _mm256_loadu_ps(p + i);
    } else {
      std::fill(probs, probs + 8, 0.0f);
      std::copy(p + i, p + i + lanes, probs);
      pv = _mm256_load_ps(probs);
    }
    const __m256 u = uniform8(keys, i);
    // Racing lanes whose bound p (1 + margin) > best (1 - u) may win; NaN compares false, and so does not race.
    const __m256 racing = _mm256_cmp_ps(pv, zero, _CMP_GT_OQ);
    const __m256 open = _mm256_cmp_ps(_mm256_mul_ps(pv, margin), _mm256_mul_ps(_mm256_set1_ps(best), _mm256_sub_ps(one, u)),
                                      _CMP_GT_OQ);
    int mask = _mm256_movemask_ps(_mm256_and_ps(racing, open));
    if (mask == 0) continue;
    _mm256_store_ps(probs, pv);
    _mm256_store_ps(q, exponential8(u));
    for (; mask != 0; mask &= mask - 1) {
      const int lane = __builtin_ctz(mask);
      const float key = probs[lane] / q[lane];
      if (key > best) best = key, winner = i + lane;
    }
  }
  return winner;
}

// probs [B, V] float32, seeds [B] int64 -> each row's winner [B] int64 (-1 for a row with nothing to race).
at::Tensor exponential_race(const at::Tensor& probs, const at::Tensor& seeds) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.is_contiguous(), "exponential_race: probs must be a contiguous float32 [B, V]");
  TORCH_CHECK(seeds.dim() == 1 && seeds.scalar_type() == at::kLong && seeds.size(0) == probs.size(0), "exponential_race: seeds must be int64 [B]");
  TORCH_CHECK(probs.size(1) < (int64_t{1} << 31), "exponential_race: a row of 2^31 tokens or more");
  const int64_t rows = probs.size(0), vocab = probs.size(1);
  at::Tensor winners = at::empty({rows}, seeds.options());
  const float* p = probs.data_ptr<float>();
  const int64_t* s = seeds.data_ptr<int64_t>();
  int64_t* w = winners.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) w[r] = race_row(p + r * vocab, vocab, Keys(s[r]));
  });
  return winners;
}

// Whether each row of probs [B, V] has a token to race (p > 0), from its first such token on.
at::Tensor racing_rows(const at::Tensor& probs) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.is_contiguous(), "racing_rows: probs must be a contiguous float32 [B, V]");
  const int64_t rows = probs.size(0), vocab = probs.size(1);
  at::Tensor any = at::empty({rows}, probs.options().dtype(at::kBool));
  const float* p = probs.data_ptr<float>();
  bool* out = any.data_ptr<bool>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = p + r * vocab;
    out[r] = std::any_of(row, row + vocab, [](float v) { return v > 0.0f; });
  }
  return any;
}

// The q of listed tokens: seeds [R] int64, rows [N] and ids [N] int64 -> q [N] float32, token ids[n] of row rows[n].
at::Tensor race_exponentials(const at::Tensor& seeds, const at::Tensor& rows, const at::Tensor& ids) {
  TORCH_CHECK(seeds.dim() == 1 && seeds.scalar_type() == at::kLong, "race_exponentials: seeds must be int64 [R]");
  TORCH_CHECK(rows.dim() == 1 && ids.dim() == 1 && rows.size(0) == ids.size(0) && rows.scalar_type() == at::kLong && ids.scalar_type() == at::kLong,
              "race_exponentials: rows and ids must be int64 [N]");
  const at::Tensor sd = seeds.contiguous(), r = rows.contiguous(), t = ids.contiguous();
  const int64_t n = t.size(0), num_seeds = sd.size(0);
  at::Tensor q = at::empty({n}, sd.options().dtype(at::kFloat));
  const int64_t* s = sd.data_ptr<int64_t>();
  const int64_t* rp = r.data_ptr<int64_t>();
  const int64_t* tp = t.data_ptr<int64_t>();
  float* out = q.data_ptr<float>();
  alignas(32) float u[8];
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t lanes = std::min<int64_t>(8, n - i);
    std::fill(u, u + 8, 1.0f);  // lanes past the end: q = 0, not stored
    for (int64_t j = 0; j < lanes; ++j) {
      const int64_t e = i + j;
      TORCH_CHECK(rp[e] >= 0 && rp[e] < num_seeds, "race_exponentials: a row without a seed");
      u[j] = uniform(Keys(s[rp[e]]), tp[e]);
    }
    alignas(32) float qv[8];
    _mm256_store_ps(qv, exponential8(_mm256_load_ps(u)));
    std::copy(qv, qv + lanes, out + i);
  }
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloop, m) {
  m.def("exponential_race(Tensor probs, Tensor seeds) -> Tensor");
  m.def("race_exponentials(Tensor seeds, Tensor rows, Tensor ids) -> Tensor");
  m.def("racing_rows(Tensor probs) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloop, CPU, m) {
  m.impl("exponential_race", &exponential_race);
  m.impl("race_exponentials", &race_exponentials);
  m.impl("racing_rows", &racing_rows);
}
