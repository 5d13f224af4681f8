// Autoregressive generation with the model's KV cache: the prompt is fed position by
// position, then each sampled token is fed back until max_new_tokens, a stop token, or the
// model's context (max_seq_len) is reached.
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
std::vector<int32_t> generate(Transformer& model, const std::vector<int32_t>& prompt, Sampler& sampler,
                              const GenerateOptions& options,
                              const std::function<void(int32_t)>& on_token = nullptr);

}  // namespace loom
