// Next-token sampling: greedy, temperature, top-k (Fan et al. 2018) and nucleus/top-p
// (Holtzman et al. 2020). Draws come from Philox(seed, draw index), so a seeded generation is
// reproducible on any machine.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

namespace loom {

struct SamplingConfig {
  float temperature = 1.0f;  // 0 = greedy (argmax)
  int64_t top_k = 0;         // 0 = no limit
  float top_p = 1.0f;        // 1 = no limit
  uint64_t seed = 1337;

  void validate() const;  // throws naming the key (sample.temperature, ...)
};

class Sampler {
 public:
  explicit Sampler(SamplingConfig config);
  // Picks a token from logits (vocab values): softmax(logits / temperature) restricted to the
  // top_k most likely tokens and then to the smallest prefix with probability >= top_p.
  int32_t sample(const float* logits, int64_t vocab);

 private:
  SamplingConfig config_;
  uint64_t draws_ = 0;
  std::vector<std::pair<float, int32_t>> candidates_;  // (probability, token), reused
};

}  // namespace loom
