// The Loom side of tests/gguf_test.py: what llama.cpp's run of an exported GGUF is compared
// with. usage: loom_gguf_probe WEIGHTS TOKENIZER TOKENS PROMPTS_JSON TEXT_FILE
// WEIGHTS is a Loom step folder or a Hugging Face folder (checkpoint/weights.h); PROMPTS_JSON a
// JSON array of strings. Prints one JSON object: per prompt its token ids (plain: special tokens
// are text), its ids with special tokens parsed (tokens_special), Loom's greedy continuation of
// TOKENS tokens (infer/generate.h, temperature 0, stopping at end of text) and the
// log-probabilities of the next token after the prompt, each continuation token's margin over
// the runner-up (continuation_margins); for the text, its first
// min(max_seq_len + 1, n) tokens and the mean next-token loss over them from position 0.
#include <algorithm>
#include <cmath>
#include <functional>
#include <cstdio>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "loom/backend/backend.h"
#include "loom/checkpoint/weights.h"
#include "loom/core/error.h"
#include "loom/data/tokenizer.h"
#include "loom/infer/generate.h"
#include "loom/model/transformer.h"

namespace {

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  LOOM_CHECK(in, path, ": cannot open");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// log softmax of every position's logits for `ids` fed from position 0: [position][token].
std::vector<std::vector<double>> log_probs(loom::Transformer& model, const std::vector<int32_t>& ids) {
  const auto T = static_cast<int64_t>(ids.size());
  loom::ActivationStore store = model.allocate_store(1, T);
  std::copy(ids.begin(), ids.end(), store.tokens.data<int32_t>());
  model.forward(store, /*compute_loss=*/false);
  const int64_t V = store.logits.shape()[2];
  std::vector<std::vector<double>> out(static_cast<size_t>(T), std::vector<double>(static_cast<size_t>(V)));
  for (int64_t t = 0; t < T; ++t) {
    const float* row = store.logits.data<float>() + t * V;
    double max = row[0], sum = 0.0;
    for (int64_t v = 0; v < V; ++v) max = std::max(max, static_cast<double>(row[v]));
    for (int64_t v = 0; v < V; ++v) sum += std::exp(row[v] - max);
    for (int64_t v = 0; v < V; ++v) out[t][v] = row[v] - max - std::log(sum);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: loom_gguf_probe WEIGHTS TOKENIZER TOKENS PROMPTS_JSON TEXT_FILE\n");
    return 2;
  }
  try {
    const std::string weights = argv[1];
    const loom::ModelConfig config = loom::weights_model_config(weights);
    auto backend = loom::make_cpu_backend();
    loom::Transformer model(*backend, config);
    loom::load_weights_from(weights, loom::ModelState{config, model.params()});
    const auto tokenizer = loom::load_tokenizer(argv[2]);
    nlohmann::json out = {{"prompts", nlohmann::json::array()}};
    for (const std::string& line : nlohmann::json::parse(read_all(argv[4])).get<std::vector<std::string>>()) {
      const std::vector<int32_t> ids = tokenizer->encode(line);
      const std::vector<int32_t> special = tokenizer->encode(line, loom::EncodeOptions{.parse_special_tokens = true});
      loom::SamplingConfig greedy;
      greedy.temperature = 0.0f;
      loom::GenerateOptions options;
      options.max_new_tokens = std::stoll(argv[3]);
      options.stop_token = tokenizer->eot_token();
      const std::vector<int32_t> continuation = loom::generate(model, ids, greedy, options);
      // Each continuation token's margin: its log-probability less the runner-up's (a near-tie,
      // where llama.cpp's rounding may pick the other, has a margin within the test's tolerance).
      std::vector<int32_t> fed = ids;
      fed.insert(fed.end(), continuation.begin(), continuation.end());
      fed.resize(std::min(fed.size(), static_cast<size_t>(config.max_seq_len)));
      const auto fed_lp = log_probs(model, fed);
      std::vector<double> margins;
      for (size_t k = 0; k < continuation.size() && ids.size() - 1 + k < fed_lp.size(); ++k) {
        std::vector<double> row = fed_lp[ids.size() - 1 + k];
        std::partial_sort(row.begin(), row.begin() + 2, row.end(), std::greater<>());
        margins.push_back(row[0] - row[1]);
      }
      out["prompts"].push_back({{"prompt", line}, {"tokens", ids}, {"tokens_special", special}, {"continuation", continuation},
                                {"continuation_margins", margins}, {"next_logprobs", log_probs(model, ids).back()}});
    }
    std::vector<int32_t> text = tokenizer->encode(read_all(argv[5]));
    text.resize(std::min<size_t>(text.size(), static_cast<size_t>(config.max_seq_len) + 1));
    const std::vector<int32_t> inputs(text.begin(), text.end() - 1);
    const auto lp = log_probs(model, inputs);
    double nll = 0.0;
    for (size_t t = 0; t < inputs.size(); ++t) nll -= lp[t][static_cast<size_t>(text[t + 1])];
    out["text_tokens"] = text;
    out["mean_nll"] = nll / static_cast<double>(inputs.size());
    std::printf("%s\n", out.dump().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom_gguf_probe: error: %s\n", e.what());
    return 1;
  }
}
