#include "cli.h"

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loom/core/utf8.h"
#include "loom/arch/param_layout.h"
#include "loom/checkpoint/peft.h"
#include "loom/checkpoint/hf_model.h"
#include "loom/checkpoint/weights.h"
#include "loom/core/error.h"
#include "loom/core/file_io.h"
#include "loom/core/json_file.h"
#include "loom/core/philox.h"
#include "loom/data/bpe.h"
#include "loom/data/shard.h"
#include "loom/data/text_tokens.h"
#include "loom/data/tokenizer_files.h"
#include "loom/nn/lora.h"

namespace loom::cli {

namespace fs = std::filesystem;

#ifndef LOOM_SOURCE_DIR
#define LOOM_SOURCE_DIR "."
#endif

namespace {

std::string option_text(const Option& o) { return "--" + o.name + (o.value.empty() ? "" : " " + o.value); }

std::string accepted_options(const std::vector<Option>& options) {
  std::string list;
  for (const Option& o : options) list += option_text(o) + ", ";
  return list + "-h/--help";
}

}  // namespace

std::string options_help(const std::string& usage, const std::vector<Option>& options, const std::string& more) {
  size_t width = std::string("-h, --help").size();
  for (const Option& o : options) width = std::max(width, option_text(o).size());
  std::string text = usage + "\noptions:\n";
  auto row = [&](const std::string& name, const std::string& help) {
    text += "  " + name + std::string(width + 2 - name.size(), ' ') + help + "\n";
  };
  for (const Option& o : options) row(option_text(o), o.help);
  row("-h, --help", "print this help and exit");
  return text + more;
}

Args::Args(int argc, char** argv, const std::string& command, const std::string& usage, const std::vector<Option>& options,
           const std::string& more) {
  CLI::App app("loom " + command, "loom " + command);
  app.allow_extras();  // undeclared arguments are reported below, in one line naming them
  app.set_help_flag("-h,--help", "print this help and exit");
  std::vector<CLI::Option*> parsed;
  for (const Option& o : options) {
    const std::string flag = "--" + o.name;
    if (o.value.rfind('[', 0) == 0) {  // an optional value: --resume or --resume PATH
      parsed.push_back(app.add_option(flag, o.help)->type_name(o.value)->expected(0, 1)->multi_option_policy(
          CLI::MultiOptionPolicy::TakeAll));
      continue;
    }
    parsed.push_back(o.value.empty() ? app.add_flag(flag, o.help)->disable_flag_override()
                                     : app.add_option(flag, o.help)->type_name(o.value)->multi_option_policy(
                                           CLI::MultiOptionPolicy::TakeAll));
  }
  const std::string see = str_cat("see `loom ", command, " --help`");
  std::vector<std::string> reversed;  // CLI11 takes the arguments last first
  for (int i = argc - 1; i >= 0; --i) reversed.emplace_back(argv[i]);
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    throw HelpRequest{options_help(usage, options, more)};
  } catch (const CLI::ArgumentMismatch&) {
    // Either a flag was given a value (--resume=yes), or a value option came last without its
    // value (CLI11 takes the argument after an option as its value whatever it looks like).
    for (int i = 0; i < argc; ++i) {
      const std::string arg = argv[i];
      for (const Option& o : options) {
        if (o.value.empty() && arg.rfind("--" + o.name + "=", 0) == 0) {
          throw Error(str_cat("option --", o.name, " takes no value, got '", arg, "'"));
        }
      }
    }
    const std::string last = argc > 0 ? argv[argc - 1] : "";
    for (const Option& o : options) {
      if (!o.value.empty() && last == "--" + o.name) throw Error(str_cat("option --", o.name, " needs a value (", o.value, "); ", see));
    }
    throw Error(str_cat("bad option '", last, "'; accepted: ", accepted_options(options)));
  } catch (const CLI::ParseError& e) {
    throw Error(str_cat(e.what(), "; ", see));
  }
  const std::vector<std::string> extra = app.remaining();
  if (!extra.empty()) {
    const std::string& bad = extra.front();
    if (bad.rfind("-", 0) == 0) {
      throw Error(str_cat("unknown option '", bad.substr(0, bad.find('=')), "'; accepted: ", accepted_options(options)));
    }
    throw Error(str_cat("unexpected argument '", bad, "'; accepted: ", accepted_options(options)));
  }
  for (size_t i = 0; i < options.size(); ++i) {
    if (parsed[i]->count() == 0) continue;
    std::vector<std::string> results = options[i].value.empty() ? std::vector<std::string>(parsed[i]->count(), "true")
                                                                 : parsed[i]->results();
    if (results.empty()) results.emplace_back();  // an optional value left out
    values_[options[i].name] = std::move(results);
  }
}

std::vector<std::string> split_positionals(int argc, char** argv, const std::vector<Option>& options,
                                           std::vector<char*>& rest) {
  std::vector<std::string> positionals;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind('-', 0) != 0) {
      positionals.push_back(arg);
      continue;
    }
    rest.push_back(argv[i]);
    const bool takes_value = std::any_of(options.begin(), options.end(), [&](const Option& o) {
      return !o.value.empty() && o.value.front() != '[' && arg == "--" + o.name;
    });
    if (takes_value && i + 1 < argc) rest.push_back(argv[++i]);
  }
  return positionals;
}

std::string Args::get(const std::string& name, const std::string& fallback) const {
  const auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second.back();
}

const std::vector<std::string>& Args::all(const std::string& name) const {
  static const std::vector<std::string> kNone;
  const auto it = values_.find(name);
  return it == values_.end() ? kNone : it->second;
}

int64_t Args::get_int(const std::string& name, int64_t fallback) const {
  if (!has(name)) return fallback;
  const std::string v = get(name);
  try {
    size_t used = 0;
    const int64_t out = std::stoll(v, &used);
    if (used == v.size()) return out;
  } catch (const std::exception&) {
  }
  throw Error(str_cat("option --", name, " expects an integer, got '", v, "'"));
}

double Args::get_double(const std::string& name, double fallback) const {
  if (!has(name)) return fallback;
  const std::string v = get(name);
  try {
    size_t used = 0;
    const double out = std::stod(v, &used);
    if (used == v.size()) return out;
  } catch (const std::exception&) {
  }
  throw Error(str_cat("option --", name, " expects a number, got '", v, "'"));
}

std::string config_keys_help() {
  const std::vector<ConfigKey> rows = config_schema();
  size_t key_width = 0, type_width = 0;
  for (const ConfigKey& r : rows) key_width = std::max(key_width, r.key.size()), type_width = std::max(type_width, r.type.size());
  constexpr size_t kDefaultWidth = 12;  // longer defaults push their meaning right
  constexpr size_t kLineWidth = 120;
  std::string text =
      "\nconfig keys (--set section.key=value, or [section] key = value in a --config file), with\n"
      "their type, the code's default and their meaning; configs/default.toml is applied on top of\n"
      "these defaults before FILE and --set (`loom config` prints the resolved values; docs/config.md):\n";
  std::string section = "-";
  for (const ConfigKey& r : rows) {
    const std::string sec = config_key_section(r.key);
    if (sec != section) text += "\n" + (sec.empty() ? std::string("(top level)") : "[" + sec + "]") + "\n";
    section = sec;
    const std::string value = r.default_value.size() < kDefaultWidth
                                  ? r.default_value + std::string(kDefaultWidth - r.default_value.size(), ' ')
                                  : r.default_value + "  ";
    std::string line = "  " + r.key + std::string(key_width + 2 - r.key.size(), ' ') + r.type +
                       std::string(type_width + 2 - r.type.size(), ' ') + value;
    // The meaning word-wrapped to kLineWidth columns, continuation lines under its first word.
    const size_t indent = 2 + key_width + 2 + type_width + 2 + kDefaultWidth;
    size_t column = line.size();
    std::istringstream words(r.meaning);
    bool first = true;
    for (std::string word; words >> word; first = false) {
      if (!first && column + 1 + word.size() > kLineWidth) {
        line += "\n" + std::string(indent, ' ');
        column = indent;
      } else if (!first) {
        line += ' ';
        ++column;
      }
      line += word;
      column += word.size();
    }
    text += line + "\n";
  }
  return text;
}

LoomConfig load_config(const Args& args) {
  LoomConfig config;
  std::string base = "configs/default.toml";
  if (!fs::exists(base)) base = std::string(LOOM_SOURCE_DIR) + "/configs/default.toml";
  if (fs::exists(base)) apply_config_file(config, base);
  if (args.has("config")) {
    const std::string path = args.get("config");
    LOOM_CHECK(fs::exists(path), path, ": config file not found");  // (apply_config_file refuses a directory or device)
    apply_config_file(config, path);
  }
  for (const std::string& set : args.all("set")) apply_overrides(config, set);
  return config;
}

void vocab_from_data(LoomConfig& config) {
  if (config.model.vocab_size != 0) return;
  const std::string meta = config.data.dir + "/meta.json";
  std::ifstream in(meta);
  LOOM_CHECK(in.good(), "model.vocab_size = 0 follows the dataset, but ", meta, " cannot be read: set model.vocab_size");
  config.model.vocab_size = nlohmann::json::parse(in).at("vocab_size").get<int64_t>();
}

std::string run_dir(const LoomConfig& config) { return (fs::path(config.run.dir) / config.run.name).string(); }

MemoryPlan memory_plan(const LoomConfig& config, int ranks) {
  MemoryPlan plan;
  plan.model = config.model;
  plan.batch = config.train.batch_size, plan.seq_len = config.train.seq_len;
  plan.recompute = config.train.recompute, plan.recompute_budget_mb = config.train.recompute_budget_mb;
  plan.optim = config.train.optim, plan.precision = config.train.precision;
  plan.zero_stage = static_cast<int>(config.parallel.zero_stage);
  plan.tp = static_cast<int>(config.parallel.tp), plan.sequence_parallel = config.parallel.sequence_parallel;
  plan.pp = static_cast<int>(config.parallel.pp), plan.schedule = config.parallel.schedule;
  plan.micro = config.train.grad_accum, plan.virtual_stages = static_cast<int>(config.parallel.virtual_stages);
  plan.cp = static_cast<int>(config.parallel.cp), plan.ulysses = config.parallel.cp_attention == CpAttention::ulysses;
  plan.ep = static_cast<int>(config.parallel.ep);
  plan.offload_activations = config.train.offload_activations;
  plan.flash_attention = config.train.flash_attention;
  plan.ranks = ranks;
  return plan;
}

std::string resolve_checkpoint(const std::string& path) {
  LOOM_CHECK(fs::exists(path), path, ": no such checkpoint, run or checkpoints folder");
  if (fs::exists(fs::path(path) / "manifest.json")) return path;
  const std::string dir = fs::exists(fs::path(path) / "checkpoints") ? (fs::path(path) / "checkpoints").string() : path;
  CheckpointManager manager(dir);
  for (const std::string& step_dir : manager.list()) {
    const std::string problem = checkpoint_problem(step_dir);
    if (problem.empty()) return step_dir;
    std::cerr << "loom: checkpoint " << step_dir << " is corrupt (" << problem << "); trying an older one\n";
  }
  throw Error(str_cat(path, ": no valid checkpoint found"));
}

LoomConfig checkpoint_config(const std::string& step_dir) {
  const std::string trainer_json = (fs::path(step_dir) / "trainer.json").string();
  const nlohmann::json json = read_json_file(trainer_json);
  LoomConfig config;
  if (json.contains("config_text") && json["config_text"].is_string()) {
    apply_config_text(config, json["config_text"].get<std::string>(), trainer_json + " (config_text)");
  }
  config.model = checkpoint_model_config(step_dir);
  // A self-contained checkpoint carries its tokenizer: used wherever the step folder now is.
  if (fs::is_directory(fs::path(step_dir) / "tokenizer")) config.data.tokenizer = (fs::path(step_dir) / "tokenizer").string();
  return config;
}

ModelSource model_source(const std::string& path, const std::string& adapter) {
  ModelSource source;
  if (is_hf_model_dir(path)) {
    source.path = path;
    source.hf = true;
    source.config.model = hf_model_config(path);
    source.config.data.tokenizer = fs::absolute(path).string();
    source.config.run.name = fs::path(path).filename().string();
  } else {
    source.path = resolve_checkpoint(path);
    source.config = checkpoint_config(source.path);
    source.quantized = is_quantized_model(source.path);
  }
  if (!adapter.empty()) {
    LOOM_CHECK(!source.config.model.lora(), path, " already has LoRA adapters (peft.method = lora): merge them first "
               "(loom convert --to hf) to apply another");
    source.adapter = adapter;
    source.config.model = peft_adapter_config(adapter, source.config.model);
  }
  return source;
}

namespace {
// Weights that hold inf or NaN evaluate to "loss nan" and sample garbage: refused by name.
void check_finite_weights(const ModelSource& source, const Tensor& params) {
  const float* w = params.data<float>();
  for (const ParamSpec& p : build_param_layout(source.config.model).params) {
    if (p.offset + p.numel > params.numel()) continue;  // (a quantized model's packed weights are not here)
    for (int64_t i = 0; i < p.numel; ++i) {
      LOOM_CHECK(std::isfinite(w[p.offset + i]), source.path, ": weight ", p.name, " holds ", w[p.offset + i],
                 " at element ", i, " (a diverged or corrupted model); refusing to use non-finite weights");
    }
  }
}
}  // namespace

void load_weights(const ModelSource& source, const Tensor& params) {
  if (source.adapter.empty()) {
    load_weights_from(source.path, ModelState{source.config.model, params});
    check_finite_weights(source, params);
    return;
  }
  // The base is the layout's first lora_begin elements (the same offsets as without adapters).
  const ModelConfig& c = source.config.model;
  load_weights_from(source.path, ModelState{lora_base_config(c), params.view(0, {lora_begin(c, build_param_layout(c))})});
  load_peft_adapter(source.adapter, ModelState{c, params});
  check_finite_weights(source, params);
}

void load_model(const ModelSource& source, Transformer& model) {
  if (!source.quantized) {
    load_weights(source, model.params());
    return;
  }
  LOOM_CHECK(source.adapter.empty(), source.path, " is a quantized model: apply --adapter to the checkpoint it was made from");
  std::map<std::string, IntWeight> weights;
  read_quantized_model(source.path, ModelState{source.config.model, model.params()}, weights);
  model.set_int_weights(std::move(weights));
}

std::vector<std::vector<int32_t>> calibration_sequences(const std::string& path, int64_t tokens, const LoomConfig& config,
                                                        int64_t seq_len, uint64_t max_bytes) {
  LOOM_CHECK(tokens >= seq_len, "--calib-tokens ", tokens, " is less than one calibration sequence of ", seq_len, " tokens");
  // Only the first `tokens` tokens are used: the text is read and tokenized until it has them.
  TextTokensOptions options;
  options.max_tokens = tokens;
  options.max_bytes = max_bytes;
  options.what = "--calib";
  options.limit = byte_limit_text(max_bytes) + " for a calibration text";
  options.encode.add_special_tokens = true;
  const TextTokens text = read_text_tokens(path, *model_tokenizer(config), options);
  const std::vector<int32_t>& ids = text.ids;
  LOOM_CHECK(static_cast<int64_t>(ids.size()) >= tokens, path, ": ", ids.size(), " tokens, fewer than --calib-tokens ",
             tokens, ": give a longer calibration text or a smaller --calib-tokens");
  std::vector<std::vector<int32_t>> sequences;
  for (int64_t first = 0; first + seq_len <= tokens; first += seq_len) {
    sequences.emplace_back(ids.begin() + first, ids.begin() + first + seq_len);
  }
  return sequences;
}

void check_weights_out(const std::string& out) {
  std::error_code ec;
  const fs::path dir(out);
  if (!fs::exists(dir, ec)) return;
  LOOM_CHECK(fs::is_directory(dir, ec), out, ": exists and is not a folder; choose another --out (nothing was written)");
  std::string other;  // the first entry that a weights-only save does not write
  for (const fs::directory_entry& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name != "checkpoints" || !entry.is_directory(ec)) {
      other = name;
      break;
    }
    for (const fs::directory_entry& step : fs::directory_iterator(entry.path(), ec)) {
      const std::string s = step.path().filename().string();
      if (s != "step_00000000" && s != "step_00000000.tmp") {
        other = "checkpoints/" + s;
        break;
      }
    }
    if (!other.empty()) break;
  }
  LOOM_CHECK(!ec, out, ": cannot list the folder: ", ec.message());
  LOOM_CHECK(other.empty(), out, ": exists and is not a weights-only checkpoint folder (it holds ", other,
             "; a training run?); choose another --out (nothing was written)");
}

std::string save_weights_checkpoint(const std::string& out, const LoomConfig& config, const Tensor& params,
                                    const nlohmann::json& extra) {
  check_weights_out(out);
  CheckpointContents contents;
  contents.model = ModelState{config.model, params};
  contents.optimizer.name = "none";  // weights only: no optimizer state
  contents.attached = tokenizer_attachments(config.data.tokenizer);
  LoomConfig recorded = config;
  if (contents.attached.empty() && !config.data.tokenizer.empty() && config.data.tokenizer != "byte") {
    // A folder without tokenizer files (a Hugging Face folder saved without them): its path would
    // make the checkpoint depend on a folder that has no tokenizer and may move. Recorded as none.
    recorded.data.tokenizer.clear();
    std::fprintf(stderr, "loom: warning: %s holds no tokenizer files: the checkpoint records no tokenizer (eval, "
                 "generate and serve need one: loom convert --to loom --tokenizer KIND_OR_DIR)\n",
                 config.data.tokenizer.c_str());
  }
  contents.config_text = config_to_toml(recorded);
  contents.extra = extra;
  return CheckpointManager((fs::path(out) / "checkpoints").string()).save(contents);
}

std::string resolve_weights(const std::string& path) { return is_hf_model_dir(path) ? path : resolve_checkpoint(path); }

std::vector<std::string> default_corpus_documents() {
  const fs::path dir = "/usr/share/games/fortunes";
  LOOM_CHECK(fs::is_directory(dir), dir.string(), ": the default corpus is missing; run scripts/setup (Debian package 'fortunes')");
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.is_regular_file() && !entry.path().has_extension()) files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  std::vector<std::string> documents;
  for (const fs::path& file : files) {
    std::ifstream in(file);
    std::string line, current;
    while (std::getline(in, line)) {
      if (line == "%") {
        if (!current.empty()) documents.push_back(std::move(current));
        current.clear();
      } else {
        current += line + "\n";
      }
    }
    if (!current.empty()) documents.push_back(std::move(current));
  }
  LOOM_CHECK(!documents.empty(), dir.string(), ": no fortune files found");
  // The files are sorted by topic; shuffle the fortunes (a fixed Philox-keyed Fisher-Yates) so
  // the validation split, the tail of the stream, samples every topic like the training split.
  for (size_t i = documents.size() - 1; i > 0; --i) {
    const PhiloxCounter r = philox4x32_10({static_cast<uint32_t>(i), 0, 0, 0}, {0x464f5254u, 0x554e4553u});
    std::swap(documents[i], documents[static_cast<size_t>(r[0] % (i + 1))]);
  }
  return documents;
}

std::vector<std::string> text_file_documents(const std::string& path, uint64_t max_bytes) {
  std::string text = read_text_file(path, max_bytes, "--max-input-mb");
  LOOM_CHECK(!text.empty(), path, ": input text is empty");
  return {std::move(text)};
}

std::unique_ptr<Tokenizer> prepare_tokenizer(const std::string& spec, const std::vector<std::string>& documents,
                                             const std::string& out_dir) {
  if (spec.rfind("bpe:", 0) != 0) return load_tokenizer(spec);
  int64_t vocab = 0;
  try {
    vocab = std::stoll(spec.substr(4));
  } catch (const std::exception&) {
  }
  LOOM_CHECK(vocab > 257, "data.tokenizer '", spec, "': expected bpe:N with N > 257 tokens");
  std::string text;
  for (const std::string& doc : documents) text += doc;
  const std::string dir = (fs::path(out_dir) / "tokenizer").string();
  const BpeTrainResult result = train_bpe(text, vocab, dir);
  std::printf("trained a byte-level BPE of %lld tokens on the corpus: %s\n", static_cast<long long>(result.vocab_size),
              dir.c_str());
  return load_tokenizer(dir);
}

void prepare_dataset(const std::vector<std::string>& documents, const Tokenizer& tokenizer, const std::string& out_dir,
                     double val_fraction) {
  std::vector<int32_t> tokens;
  int64_t bytes = 0;
  for (const std::string& doc : documents) {
    const std::vector<int32_t> ids = tokenizer.encode(doc);
    tokens.insert(tokens.end(), ids.begin(), ids.end());
    tokens.push_back(tokenizer.eot_token());
    bytes += static_cast<int64_t>(doc.size());
  }
  write_dataset(out_dir, tokens, static_cast<uint64_t>(tokenizer.vocab_size()), tokenizer.name(), val_fraction,
                uint64_t{1} << 22);
  // Unigram entropy of the training split: the loss of the best context-free predictor, the bar
  // a model must get well under to show it learned anything beyond token frequencies.
  const size_t n_train = tokens.size() - static_cast<size_t>(std::floor(static_cast<double>(tokens.size()) * val_fraction));
  std::vector<int64_t> counts(static_cast<size_t>(tokenizer.vocab_size()), 0);
  for (size_t i = 0; i < n_train; ++i) ++counts[static_cast<size_t>(tokens[i])];
  double entropy = 0.0;
  for (int64_t c : counts) {
    if (c > 0) entropy -= static_cast<double>(c) / n_train * std::log(static_cast<double>(c) / n_train);
  }
  nlohmann::json stats = {{"documents", documents.size()},
                          {"bytes", bytes},
                          {"tokens", tokens.size()},
                          {"train_tokens", n_train},
                          {"val_tokens", tokens.size() - n_train},
                          {"unigram_entropy_nats", entropy},
                          {"tokenizer", tokenizer.name()}};
  write_file_atomic((fs::path(out_dir) / "stats.json").string(), stats.dump(2) + "\n");
  std::printf("prepared %s: %zu documents, %lld bytes -> %zu tokens (%zu train, %zu val), tokenizer %s, unigram entropy %.3f nats/token\n",
              out_dir.c_str(), documents.size(), static_cast<long long>(bytes), tokens.size(), n_train, tokens.size() - n_train,
              tokenizer.name().c_str(), entropy);
}

std::string printable_utf8(const std::string& bytes) { return valid_utf8(bytes); }

std::unique_ptr<Tokenizer> model_tokenizer(const LoomConfig& config) {
  // (save_weights_checkpoint records none for a Hugging Face folder without tokenizer files)
  LOOM_CHECK(!config.data.tokenizer.empty(), "the model records no tokenizer (it was made from a Hugging Face folder "
             "without tokenizer files): give it one with loom convert --to loom --tokenizer KIND_OR_DIR");
  auto tokenizer = load_tokenizer(config.data.tokenizer);
  LOOM_CHECK(tokenizer->vocab_size() == config.model.vocab_size, "tokenizer ", tokenizer->name(), " has ",
             tokenizer->vocab_size(), " tokens but the model ", config.model.vocab_size);
  return tokenizer;
}

bool stdout_is_terminal() { return ::isatty(STDOUT_FILENO) == 1; }

std::string format_duration(double seconds) {
  const int64_t s = static_cast<int64_t>(std::llround(std::max(0.0, seconds)));
  char buffer[32];
  if (s >= 3600) std::snprintf(buffer, sizeof buffer, "%lldh%02lldm", static_cast<long long>(s / 3600), static_cast<long long>(s / 60 % 60));
  else std::snprintf(buffer, sizeof buffer, "%lldm%02llds", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  return buffer;
}

}  // namespace loom::cli
