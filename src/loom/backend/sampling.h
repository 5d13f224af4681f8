// Backend::sample_rows' operands and the host reference of the sampling rule (sampling_rule.h):
// the candidates of a row in the rule's order with their weights, which the CPU backend draws
// from and the host sampler (infer/sampler.h) also uses for speculative decoding's verification.
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "loom/backend/sampling_rule.h"
#include "loom/core/tensor.h"

namespace loom {

// sample_rows' operands: logits f32 (n, V) with 1 <= V < kMaxSampleVocab, one RowSampling a row
// (temperature >= 0, top_k >= 0, top_p in (0, 1]), penalties inside (n, V) with at most one entry
// per (row, token), out i32 (n); throws naming sample_rows.
void check_sample_rows(const Tensor& logits, const std::vector<RowSampling>& rows,
                       const std::vector<SamplePenalty>& penalties, const Tensor& out);

// logits (rows of `vocab`) minus each penalty's amount, in place: sample_rows' first step.
void apply_penalties(float* logits, int64_t vocab, const std::vector<SamplePenalty>& penalties);

// The rule's uniform u of a row's draw (Philox4x32-10 word 0 at (draw lo, draw hi, 1, 0)).
double sample_uniform(uint64_t seed, uint64_t draw);

// One row's candidates under the rule: build() orders the tokens (a full radix sort, or a partial
// sort for a top_k below V) and finds the kept prefix; order[i] = (p, token), weight(i) its
// integer weight (as a double, exact), keep and total the kept count and weight sum.
class SampleCandidates {
 public:
  void build(const float* logits, int64_t vocab, float temperature, int64_t top_k, float top_p);
  // The first kept index whose inclusive prefix sum of weights exceeds x (0 when none does).
  size_t find(double x) const;
  double weight(size_t i) const { return static_cast<double>(sampling::weight(order[i].first)); }

  std::vector<std::pair<float, int32_t>> order;  // (p, token) by p descending, ties by token
  size_t keep = 0;
  double total = 0.0;

 private:
  std::vector<std::pair<float, int32_t>> sorting_;  // the radix sort's other buffer
};

// The rule's token for one row of logits (the CPU backend's sample_rows, row by row).
int32_t sample_row(const float* logits, int64_t vocab, const RowSampling& row, SampleCandidates& scratch);

// The first largest logit, NaN ignored (0 when every logit is NaN): the rule's greedy token.
int32_t greedy_token(const float* logits, int64_t vocab);

}  // namespace loom
