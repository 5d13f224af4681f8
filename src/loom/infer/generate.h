// Autoregressive generation of one prompt: the generation engine (infer/engine.h) with one row
// and a paged KV cache. The prompt is prefilled, then each sampled token is fed back until
// max_new_tokens, the stop token, or the model's context (max_seq_len) is reached.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "loom/infer/sampler.h"
#include "loom/model/transformer.h"

namespace loom {

struct GenerateOptions {
  int64_t max_new_tokens = 100;
  int32_t stop_token = -1;  // < 0: none
};

// Returns the new tokens (not the prompt). on_token, if set, sees each token as it is drawn.
std::vector<int32_t> generate(Transformer& model, const std::vector<int32_t>& prompt, const SamplingConfig& sampling,
                              const GenerateOptions& options,
                              const std::function<void(int32_t)>& on_token = nullptr);

}  // namespace loom
