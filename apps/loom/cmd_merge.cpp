// loom merge: average, task arithmetic, TIES or DARE over checkpoints of one model
// (compress/prune_merge.h, docs/compression.md), written as a Loom checkpoint.
#include <cmath>
#include <cstdio>
#include <sstream>

#include "cli.h"
#include "commands.h"
#include "loom/compress/prune_merge.h"
#include "loom/checkpoint/model_config_json.h"
#include "loom/core/error.h"
#include "loom/core/file_io.h"
#include "loom/data/tokenizer_files.h"

namespace loom::cli {

namespace {
const char* kHelp =
    "usage: loom merge --method average|task-arithmetic|ties|dare --out DIR [--base PATH]\n"
    "                  [--weights W1,W2,...] [--density D] [--seed N] PATH PATH ...\n"
    "\n"
    "Merges checkpoints of one model (equal model configs and tokenizers; each PATH a Loom\n"
    "checkpoint or run folder, or a Hugging Face folder). average: sum w_i theta_i / sum w_i;\n"
    "task-arithmetic: base + sum w_i (theta_i - base); ties: TIES-merging of the task vectors\n"
    "(trimmed to the top --density of each tensor, default 0.5; elected signs; the agreeing mean);\n"
    "dare: each task vector's elements kept with probability --density and scaled by 1 / density\n"
    "(Philox, --seed), then task arithmetic. --weights defaults to 1 for each model. The result is\n"
    "a Loom checkpoint DIR/checkpoints/step_00000000 with the first model's config and tokenizer.\n";

std::vector<double> parse_weights(const std::string& text) {
  std::vector<double> w;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    double value = 0.0;
    try {
      size_t used = 0;
      value = std::stod(item, &used);
      LOOM_CHECK(used == item.size(), "");
    } catch (...) {
      throw Error(str_cat("--weights '", text, "': '", item, "' is not a number"));
    }
    // stod reads "nan" and "inf": a weight of either makes every merged value NaN.
    LOOM_CHECK(std::isfinite(value), "--weights '", text, "': '", item, "' is not a finite number");
    w.push_back(value);
  }
  return w;
}

// The first model config key whose values differ ("" when equal).
std::string config_difference(const ModelConfig& a, const ModelConfig& b) {
  const nlohmann::json ja = model_config_json(a), jb = model_config_json(b);
  for (const auto& [key, value] : ja.items()) {
    if (!jb.contains(key) || jb[key] != value) return str_cat("model.", key, " = ", value.dump(), " against ", jb.value(key, nlohmann::json()).dump());
  }
  return ja == jb ? "" : "a key only one of them has";
}

// The tokenizer's files as bytes (named kinds: the kind's name).
std::string tokenizer_identity(const std::string& tokenizer) {
  std::string id;
  const std::vector<std::string> files = tokenizer_files(tokenizer);
  if (files.empty()) return tokenizer;
  for (const std::string& f : files) id += read_text_file(f);
  return id;
}
}  // namespace

int merge_main(int argc, char** argv) {
  const std::vector<Option> options = {
      {"method", "METHOD", "average | task-arithmetic | ties | dare (required)"},
      {"out", "DIR", "the run folder to write (required)"},
      {"base", "PATH", "the model the others were fine-tuned from (task-arithmetic, ties, dare)"},
      {"weights", "W1,W2,...", "one weight per model (default 1 each)"},
      {"density", "D", "ties, dare: the fraction of each task vector kept (default 0.5)"},
      {"seed", "N", "dare: the dropping's Philox seed (default 0)"}};
  std::vector<char*> rest;
  const std::vector<std::string> paths = split_positionals(argc, argv, options, rest);  // the PATHs
  const Args args(static_cast<int>(rest.size()), rest.data(), "merge", kHelp, options);
  LOOM_CHECK(args.has("method"), "loom merge needs --method average|task-arithmetic|ties|dare");
  LOOM_CHECK(args.has("out"), "loom merge needs --out DIR");
  LOOM_CHECK(!paths.empty(), "loom merge needs the checkpoints to merge as arguments: loom merge --method M --out DIR PATH PATH ...");
  MergeOptions o;
  o.method = parse_merge_method(args.get("method"));
  if (args.has("weights")) o.weights = parse_weights(args.get("weights"));
  LOOM_CHECK(o.weights.empty() || o.weights.size() == paths.size(), "--weights has ", o.weights.size(), " values for ",
             paths.size(), " models");
  o.density = args.get_double("density", 0.5);
  o.seed = static_cast<uint64_t>(args.get_int("seed", 0));
  LOOM_CHECK(o.method == MergeMethod::average || args.has("base"), "--method ", args.get("method"), " needs --base PATH");
  LOOM_CHECK(o.method != MergeMethod::average || !args.has("base"), "--method average uses no --base");
  check_weights_out(args.get("out"));

  auto backend = make_cpu_backend();
  std::vector<std::string> all = paths;
  if (args.has("base")) all.push_back(args.get("base"));
  std::vector<ModelSource> sources;
  for (const std::string& p : all) sources.push_back(model_source(p));
  const LoomConfig& first = sources[0].config;
  const std::string first_tokenizer = tokenizer_identity(first.data.tokenizer);
  for (const ModelSource& s : sources) {
    LOOM_CHECK(!s.quantized, s.path, " is quantized: merge the checkpoints it was made from");
    const std::string difference = config_difference(s.config.model, first.model);
    LOOM_CHECK(difference.empty(), s.path, ": its model config differs from ", sources[0].path, "'s (", difference,
               "): only models of one shape merge");
    LOOM_CHECK(tokenizer_identity(s.config.data.tokenizer) == first_tokenizer, s.path, ": its tokenizer (",
               s.config.data.tokenizer, ") differs from ", sources[0].path, "'s (", first.data.tokenizer, ")");
  }
  Transformer model(*backend, first.model);
  std::vector<std::vector<float>> weights;
  std::vector<float> base;
  for (size_t i = 0; i < sources.size(); ++i) {
    load_weights(sources[i], model.params());
    std::vector<float> v(model.params().data<float>(), model.params().data<float>() + model.params().numel());
    if (args.has("base") && i + 1 == sources.size()) base = std::move(v);
    else weights.push_back(std::move(v));
  }
  std::vector<float> merged;
  merge_models(weights, base, model.layout(), o, merged);
  backend->write(model.params(), merged.data());
  nlohmann::json inputs = nlohmann::json::array();
  for (size_t i = 0; i < paths.size(); ++i) inputs.push_back(sources[i].path);
  const nlohmann::json extra = {{"merge", {{"method", args.get("method")}, {"models", inputs},
                                           {"base", args.has("base") ? sources.back().path : ""},
                                           {"weights", o.weights}, {"density", o.density}}}};
  const std::string path = save_weights_checkpoint(args.get("out"), first, model.params(), extra);
  std::printf("wrote %s: %s of %zu models%s\n", path.c_str(), args.get("method").c_str(), paths.size(),
              args.has("base") ? str_cat(" onto ", sources.back().path).c_str() : "");
  return 0;
}

}  // namespace loom::cli
