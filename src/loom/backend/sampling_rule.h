// The sampling rule: how a token is drawn from a row of logits, the same function on the host
// (backend/sampling.h's reference, the CPU backend, infer/sampler.h) and on the GPU
// (cuda_sample.cu), so a seeded draw gives the same token on either. Temperature, top-k (Fan et
// al. 2018) and nucleus / top-p (Holtzman et al. 2020), defined with exact arithmetic so that the
// order of a sum never changes the token:
//
//   m      = the largest logit (NaN logits ignored)
//   p(v)   = exp((logit[v] - m) / T) by math::fast_exp (the kernels' own exp, bitwise the same
//            on both sides when neither contracts: sampling.cpp and cuda_sample.cu are compiled
//            without contraction); greedy (T = 0): 1 for the largest logit, 0 elsewhere; a NaN
//            logit 0.
//   order  = tokens by p descending, ties by token id ascending (a total order).
//   w(v)   = floor(p(v) 2^32), an integer weight (p <= 1, so w <= 2^32 and a vocabulary below
//            2^21 sums below 2^53: every partial sum is exact in double). A token under 2^-32 of
//            the most likely one weighs nothing.
//   keep   = the first top_k of the order (all when top_k is 0 or >= V); with top_p < 1, the
//            shortest prefix of those whose weight sum reaches top_p x their sum (a double product),
//            at least one token.
//   draw   = u x (the kept weights' sum) with u = philox_uniform of Philox4x32-10 word 0 at
//            counter (draw lo, draw hi, 1, 0), key (seed lo, seed hi); greedy: 0.
//   token  = the first kept token whose inclusive prefix sum of weights exceeds the draw (the
//            first of the order when no weight is positive: every logit NaN or -inf).
#pragma once
#include <cstdint>
#include <cstring>

#include "loom/backend/scalar_math.h"  // math::fast_exp, LOOM_HOST_DEVICE

namespace loom {

// One row's settings, as Backend::sample_rows reads them (a plain struct: the CUDA backend copies
// a table of them to the device).
struct RowSampling {
  float temperature = 0.0f;  // 0: greedy
  float top_p = 1.0f;        // in (0, 1]
  int64_t top_k = 0;         // 0: no limit
  uint64_t seed = 0;
  uint64_t draw = 0;         // the Philox counter of the row's draw
};

// OpenAI's presence and frequency penalties of one row's token, applied before the rule:
// logit[token] -= amount, amount = presence + frequency x (times the token was drawn), computed
// in float by the host sampler (infer/sampler.h). One entry per (row, token).
struct SamplePenalty {
  int32_t row = 0;
  int32_t token = 0;
  float amount = 0.0f;
};

// The largest vocabulary the rule's double sums stay exact for.
inline constexpr int64_t kMaxSampleVocab = int64_t{1} << 21;

namespace sampling {

LOOM_HOST_DEVICE float probability(float logit, float max_logit, float temperature) {
  if (!(logit == logit)) return 0.0f;  // NaN
  if (temperature == 0.0f) return logit == max_logit ? 1.0f : 0.0f;
  const float x = (logit - max_logit) / temperature;
  if (!(x == x)) return 0.0f;  // -inf - -inf: every logit -inf
  return math::fast_exp(x);
}

LOOM_HOST_DEVICE uint64_t weight(float p) { return static_cast<uint64_t>(p * 4294967296.0f); }

// Sorting key of p >= 0: ascending keys are descending probabilities (bits 0 .. 30 order them;
// bit 31 is always set).
LOOM_HOST_DEVICE uint32_t order_key(float p) {
  uint32_t bits = 0;
  std::memcpy(&bits, &p, sizeof bits);
  return ~bits;
}

// The larger of a and b, a NaN b ignored (fmaxf's rule, spelled out so both sides agree).
LOOM_HOST_DEVICE float max_ignoring_nan(float a, float b) { return b > a || !(a == a) ? b : a; }

}  // namespace sampling
}  // namespace loom
