#include "loom/infer/generate.h"

#include "loom/core/error.h"

namespace loom {

std::vector<int32_t> generate(Transformer& model, const std::vector<int32_t>& prompt, Sampler& sampler,
                              const GenerateOptions& options, const std::function<void(int32_t)>& on_token) {
  LOOM_CHECK(!prompt.empty(), "generate: the prompt must hold at least one token");
  const int64_t context = model.config().max_seq_len, vocab = model.config().vocab_size;
  LOOM_CHECK(static_cast<int64_t>(prompt.size()) <= context, "generate: prompt of ", prompt.size(),
             " tokens exceeds model.max_seq_len = ", context);
  DecodeState state = model.allocate_decode_state(1);
  for (int32_t token : prompt) model.forward_decode(state, {token});
  std::vector<int32_t> out;
  while (static_cast<int64_t>(out.size()) < options.max_new_tokens) {
    const int32_t next = sampler.sample(state.step.logits.data<float>(), vocab);
    out.push_back(next);
    if (on_token) on_token(next);
    if (next == options.stop_token || state.length >= context) break;
    model.forward_decode(state, {next});
  }
  return out;
}

}  // namespace loom
