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

const Option kDeviceOption = {"device", "cpu|cuda",
                              "the backend the model runs on (default: the checkpoint's run config's device; cpu for a "
                              "Hugging Face folder)"};
const Option kF32WeightsOption = {"f32-weights", "",
                                  "widen a Hugging Face folder's bf16 linear weights to f32 (default: used in place, "
                                  "half the memory)"};

const Option kStepGraphsOption = {"step-graphs", "",
                                  "each decoding step as one CUDA graph (with the KV cache in the device's memory: the same "
                                  "tokens, fewer launches)"};
const Option kDraftOption = {"draft", "PATH",
                             "a smaller model with the same tokenizer (checkpoint or Hugging Face folder) proposes --speculate "
                             "tokens (default 4 with it) that the model verifies in one forward: the same greedy tokens, sampled "
                             "ones distributed the same (needs --kv fp32)"};

const Option kDraftPMinOption = {"draft-p-min", "P",
                                 "--draft: a request stops drafting once the draft gave its pick a probability below P "
                                 "(default 0: always K drafts; llama.cpp stops below 0.75 or 0.9, by version)"};

std::unique_ptr<Transformer> open_draft(const Args& args, Backend& backend, EngineConfig& engine) {
  if (!args.has("draft")) return nullptr;
  if (engine.speculate == 0 && !args.has("speculate")) engine.speculate = 4;
  engine.draft_p_min = args.get_double("draft-p-min", engine.draft_p_min);
  engine.validate();
  const ModelSource source = model_source(args.get("draft"), "");
  return open_inference_model(source, backend, args.has("f32-weights"));
}

SamplingConfig sampling_from_args(const Args& args, SamplingConfig s) {
  s.temperature = args.has("greedy") ? 0.0f : static_cast<float>(args.get_double("temperature", s.temperature));
  s.top_k = args.get_int("top-k", s.top_k);
  s.top_p = static_cast<float>(args.get_double("top-p", s.top_p));
  s.seed = static_cast<uint64_t>(args.get_int("seed", static_cast<int64_t>(s.seed)));
  s.validate();
  return s;
}

EngineConfig serving_engine_config(const Args& args, int64_t head_dim) {
  EngineConfig ec;
  ec.max_batch = args.get_int("max-batch", 16);
  LOOM_CHECK(ec.max_batch >= 1, "--max-batch must be >= 1, got ", ec.max_batch);
  ec.block_size = args.get_int("kv-block", 16);
  ec.num_blocks = args.get_int("kv-blocks", 0);
  ec.prefill_chunk = args.get_int("prefill-chunk", ec.prefill_chunk);
  ec.speculate = args.get_int("speculate", 0);
  ec.step_graphs = args.has("step-graphs");
  if (args.has("kv-memory")) ec.kv_memory = parse_bytes(args.get("kv-memory"), "--kv-memory");
  apply_kv_preset(ec, args.get("kv", "fp32"), head_dim);
  return ec;
}

std::string workspace_note(const GenerationEngine& engine) {
  const int64_t bytes = engine.workspace_bytes();
  return bytes > 0 ? format_bytes(static_cast<size_t>(bytes)) : "grows with the prompt (--prefill-chunk 0)";
}

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
