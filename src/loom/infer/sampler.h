// Next-token sampling: greedy, temperature, top-k (Fan et al. 2018) and nucleus/top-p
// (Holtzman et al. 2020), after OpenAI's presence and frequency penalties. The rule is the
// backend's (backend/sampling_rule.h: integer weights, exact sums) and draws come from
// Philox(seed, draw index), so a seeded generation is reproducible on any machine and on any
// backend that draws it (Backend::sample_rows).
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "loom/backend/sampling.h"

namespace loom {

struct SamplingConfig {
  float temperature = 1.0f;  // 0 = greedy (argmax)
  int64_t top_k = 0;         // 0 = no limit
  float top_p = 1.0f;        // 1 = no limit
  uint64_t seed = 1337;
  // OpenAI's penalties over the tokens this sampler drew so far (vLLM's reading: the output, not
  // the prompt): logit[t] -= presence * (count[t] > 0) + frequency * count[t]. In [-2, 2].
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;

  void validate() const;  // throws naming the key (sample.temperature, ...)
};

class Sampler {
 public:
  explicit Sampler(SamplingConfig config);
  // Picks a token from logits (vocab values): softmax(logits / temperature) restricted to the
  // top_k most likely tokens and then to the smallest prefix with probability >= top_p. With a
  // penalty, the logits are first penalised (in a copy) by the counts of the tokens drawn so far.
  int32_t sample(const float* logits, int64_t vocab);
  // Speculative decoding's verification of a draft token proposed with certainty (prompt lookup:
  // q = one-hot at `draft`), Leviathan et al. 2023: with p the distribution sample() draws from,
  // the draft is kept with probability p(draft); otherwise a token is drawn from p without the
  // draft, renormalised. The result is distributed as sample()'s (it returns the draft when kept,
  // another token when not). Greedy: the argmax, kept when it is the draft.
  int32_t verify(const float* logits, int64_t vocab, int32_t draft);
  // The same for a draft drawn from a distribution q (vocab values; a draft model's, see
  // propose), Leviathan et al. 2023, Algorithm 1: the draft is kept with probability
  // min(1, p(draft) / q(draft)); otherwise a token is drawn from max(0, p - q), renormalised.
  // The result is distributed as sample()'s whatever q is. Greedy: the argmax.
  int32_t verify(const float* logits, int64_t vocab, int32_t draft, const float* q);
  // A draft model's proposal: a token drawn as sample() would draw it (penalties aside), and the
  // distribution it was drawn from written to q (vocab values, 0 outside the candidates kept by
  // top_k / top_p). Greedy: the argmax, q left as it is (verify does not read it).
  int32_t propose(const float* logits, int64_t vocab, float* q);
  // Greedy without penalties: the token is the logits' first argmax and the sampler keeps no
  // state, so a backend may pick it (Backend::argmax_rows) without the host seeing the logits.
  bool plain_greedy() const {
    return config_.temperature == 0.0f && !penalised_draws();
  }
  // A backend may draw the token sample() would (Backend::sample_rows under row() and the row's
  // penalties()), and took() counts the draw and the token as sample() does.
  // Whether OpenAI's penalties apply (the sampler then remembers the tokens it drew).
  bool penalised_draws() const { return config_.presence_penalty != 0.0f || config_.frequency_penalty != 0.0f; }
  RowSampling row() const { return {config_.temperature, config_.top_p, config_.top_k, config_.seed, draws_}; }
  // The penalties of the next draw, one per distinct token drawn so far, for the step's row `row`.
  void penalties(int32_t row, std::vector<SamplePenalty>& out) const;
  int32_t took(int32_t token) {
    if (penalised_draws()) drawn_.push_back(token);
    if (config_.temperature > 0.0f) ++draws_;
    return token;
  }

 private:
  int32_t pick(const float* logits, int64_t vocab, int32_t draft = -1);
  const float* penalised(const float* logits, int64_t vocab);  // logits, or their penalised copy
  double uniform();  // the next Philox draw in [0, 1)

  SamplingConfig config_;
  uint64_t draws_ = 0;
  std::vector<int32_t> drawn_;     // the tokens drawn so far (penalties only)
  std::vector<float> penalised_;   // the penalised logits, reused
  SampleCandidates candidates_;    // the rule's order and kept prefix, reused
  std::vector<double> residual_;   // verify's max(0, p - q) over the kept candidates
};

}  // namespace loom
