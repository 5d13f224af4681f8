#include "loom/infer/sampler.h"

#include <algorithm>
#include <cmath>

#include "loom/core/error.h"

namespace loom {

void SamplingConfig::validate() const {
  LOOM_CHECK(temperature >= 0.0f, "sample.temperature must be >= 0 (0 = greedy), got ", temperature);
  LOOM_CHECK(top_k >= 0, "sample.top_k must be >= 0 (0 = no limit), got ", top_k);
  LOOM_CHECK(top_p > 0.0f && top_p <= 1.0f, "sample.top_p must be in (0, 1], got ", top_p);
  LOOM_CHECK(presence_penalty >= -2.0f && presence_penalty <= 2.0f, "presence_penalty must be in [-2, 2], got ",
             presence_penalty);
  LOOM_CHECK(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f, "frequency_penalty must be in [-2, 2], got ",
             frequency_penalty);
}

Sampler::Sampler(SamplingConfig config) : config_(config) { config_.validate(); }

int32_t Sampler::sample(const float* logits, int64_t vocab) {
  if (!penalised_draws()) return pick(logits, vocab);
  const int32_t token = pick(penalised(logits, vocab), vocab);
  drawn_.push_back(token);
  return token;
}

int32_t Sampler::verify(const float* logits, int64_t vocab, int32_t draft) {
  const bool penalties = penalised_draws();
  const int32_t token = pick(penalties ? penalised(logits, vocab) : logits, vocab, draft);
  if (penalties) drawn_.push_back(token);
  return token;
}

double Sampler::uniform() { return sample_uniform(config_.seed, draws_++); }

void Sampler::penalties(int32_t row, std::vector<SamplePenalty>& out) const {
  if (!penalised_draws()) return;
  std::vector<int32_t> sorted = drawn_;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size();) {
    size_t j = i;
    while (j < sorted.size() && sorted[j] == sorted[i]) ++j;
    out.push_back({row, sorted[i], config_.presence_penalty + config_.frequency_penalty * static_cast<float>(j - i)});
    i = j;
  }
}

const float* Sampler::penalised(const float* logits, int64_t vocab) {
  penalised_.assign(logits, logits + vocab);
  std::vector<SamplePenalty> amounts;
  penalties(0, amounts);
  apply_penalties(penalised_.data(), vocab, amounts);
  return penalised_.data();
}

// draft >= 0 (verify): the draft is kept with probability p(draft); otherwise the draw is over
// the other candidates, renormalised. Without a draft: the rule's token (sample_row's).
int32_t Sampler::pick(const float* logits, int64_t vocab, int32_t draft) {
  if (config_.temperature == 0.0f) return greedy_token(logits, vocab);
  SampleCandidates& c = candidates_;
  c.build(logits, vocab, config_.temperature, config_.top_k, config_.top_p);
  if (draft < 0) return c.order[c.find(uniform() * c.total)].second;
  double excluded = 0.0;  // the draft's weight among the candidates kept
  for (size_t i = 0; i < c.keep; ++i) excluded += c.order[i].second == draft ? c.weight(i) : 0.0;
  if (uniform() * c.total < excluded) return draft;
  if (excluded >= c.total) return draft;  // the draft is the only candidate
  const double target = uniform() * (c.total - excluded);
  double cumulative = 0.0;
  int32_t last = -1;
  for (size_t i = 0; i < c.keep; ++i) {
    if (c.order[i].second == draft) continue;
    cumulative += c.weight(i);
    last = c.order[i].second;
    if (target < cumulative) return last;
  }
  return last;
}

int32_t Sampler::propose(const float* logits, int64_t vocab, float* q) {
  if (config_.temperature == 0.0f) return greedy_token(logits, vocab);
  SampleCandidates& c = candidates_;
  c.build(logits, vocab, config_.temperature, config_.top_k, config_.top_p);
  std::fill(q, q + vocab, 0.0f);
  for (size_t i = 0; i < c.keep && c.total > 0.0; ++i) q[c.order[i].second] = static_cast<float>(c.weight(i) / c.total);
  return c.order[c.find(uniform() * c.total)].second;
}

int32_t Sampler::verify(const float* logits, int64_t vocab, int32_t draft, const float* q) {
  if (q == nullptr) return verify(logits, vocab, draft);
  const bool penalties = penalised_draws();
  const float* z = penalties ? penalised(logits, vocab) : logits;
  int32_t token = 0;
  if (config_.temperature == 0.0f) {
    token = greedy_token(z, vocab);
  } else {
    SampleCandidates& c = candidates_;
    c.build(z, vocab, config_.temperature, config_.top_k, config_.top_p);
    double p_draft = 0.0;
    for (size_t i = 0; i < c.keep; ++i) p_draft += c.order[i].second == draft ? c.weight(i) / c.total : 0.0;
    if (uniform() * static_cast<double>(q[draft]) < p_draft) {
      token = draft;
    } else {  // rejected: the residual max(0, p - q) over the kept candidates (q > p elsewhere weighs nothing)
      residual_.resize(c.keep);
      double residual = 0.0;
      for (size_t i = 0; i < c.keep; ++i) {
        residual_[i] = std::max(0.0, c.weight(i) / c.total - static_cast<double>(q[c.order[i].second]));
        residual += residual_[i];
      }
      token = draft;  // p == q to rounding: the draft was p's draw
      if (residual > 0.0) {
        const double target = uniform() * residual;
        double cumulative = 0.0;
        token = c.order[c.keep - 1].second;
        for (size_t i = 0; i < c.keep; ++i) {
          cumulative += residual_[i];
          if (target < cumulative) {
            token = c.order[i].second;
            break;
          }
        }
      }
    }
  }
  if (penalties) drawn_.push_back(token);
  return token;
}

}  // namespace loom
