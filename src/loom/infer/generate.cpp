#include "loom/infer/generate.h"

#include <algorithm>

#include "loom/core/error.h"
#include "loom/infer/engine.h"

namespace loom {

std::vector<int32_t> generate(Transformer& model, const std::vector<int32_t>& prompt, const SamplingConfig& sampling,
                              const GenerateOptions& options, const std::function<void(int32_t)>& on_token) {
  LOOM_CHECK(!prompt.empty(), "generate: the prompt must hold at least one token");
  const int64_t context = model.config().max_seq_len;
  LOOM_CHECK(static_cast<int64_t>(prompt.size()) <= context, "generate: prompt of ", prompt.size(),
             " tokens exceeds model.max_seq_len = ", context);
  if (options.max_new_tokens <= 0) return {};
  EngineConfig config;
  config.max_batch = 1;
  GenerationEngine engine(model, config);
  if (on_token) engine.set_on_token([&](int64_t, int32_t token) { on_token(token); });
  GenerationRequest request;
  request.prompt = prompt;
  request.sampling = sampling;
  // The context bounds the output as it did the old single-sequence path: generation stops there.
  request.max_new_tokens = options.max_new_tokens;
  if (options.stop_token >= 0) request.stop_tokens = {options.stop_token};
  engine.submit(std::move(request));
  return engine.run().front().tokens;
}

}  // namespace loom
