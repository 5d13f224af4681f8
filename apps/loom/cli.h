// Shared pieces of the `loom` subcommands: argument parsing, configuration loading, the run
// folder, checkpoint lookup and one-line status output.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/checkpoint/checkpoint.h"
#include "loom/data/tokenizer.h"
#include "loom/memory/estimate.h"
#include "loom/model/transformer.h"
#include "loom/data/prepare.h"
#include "loom/train/config.h"
#include "loom/infer/engine.h"
#include "loom/train/model_source.h"

namespace loom::cli {

// One option of a subcommand: --name VALUE (value: the placeholder shown in the help, e.g.
// "FILE"), with an empty value a bare --name flag, or with a value in brackets ("[PATH]") either
// (get() is "" when the value is left out).
struct Option {
  std::string name;   // without the leading "--"
  std::string value;  // "" for a flag
  std::string help;   // one line
};

// --device of the commands that run a model (eval, generate, serve): train/model_source.h
// inference_backend reads it.
extern const Option kDeviceOption;
extern const Option kF32WeightsOption;  // --f32-weights (train/model_source.h open_inference_model)
extern const Option kDraftOption;       // --draft (open_draft)
extern const Option kStepGraphsOption;  // --step-graphs (EngineConfig::step_graphs)
extern const Option kDraftPMinOption;   // --draft-p-min (open_draft)

// -h / --help on a subcommand's line: the help text, which main() prints to stdout (exit 0).
struct HelpRequest {
  std::string text;
};

// A subcommand's options, parsed by CLI11: --key value and --key=value, flags, repeatable
// options (every occurrence kept in order). Every option must be declared; an unknown one, a
// missing value or a positional argument is an Error of one line naming it and the accepted
// options. -h / --help anywhere throws HelpRequest with the help: `usage` (the command's usage
// and description), every option with its help, then `more` (e.g. train's config keys).
class Args {
 public:
  Args(int argc, char** argv, const std::string& command, const std::string& usage, const std::vector<Option>& options,
       const std::string& more = "");
  bool has(const std::string& name) const { return values_.count(name) != 0; }
  std::string get(const std::string& name, const std::string& fallback = "") const;  // the last occurrence
  const std::vector<std::string>& all(const std::string& name) const;  // repeatable options (--set)
  int64_t get_int(const std::string& name, int64_t fallback) const;
  double get_double(const std::string& name, double fallback) const;

 private:
  std::map<std::string, std::vector<std::string>> values_;
};

// --draft PATH: the draft model of speculative decoding (infer/draft_model.h), opened as the
// target is (its own dtype, on `backend`); --speculate defaults to 4 with one. nullptr without.
std::unique_ptr<Transformer> open_draft(const Args& args, Backend& backend, EngineConfig& engine);
// loom serve's engine from its flags (--max-batch, --kv-block, --kv-blocks, --prefill-chunk,
// --speculate, --kv-memory, --kv), as loom memory --serve reads them too.
EngineConfig serving_engine_config(const Args& args, int64_t head_dim);
// --temperature (or --greedy), --top-k, --top-p and --seed over `defaults`, checked
// (SamplingConfig::validate) before anything is loaded: generate's and bench generate's settings.
SamplingConfig sampling_from_args(const Args& args, SamplingConfig defaults);
// The engine's step workspace (GenerationEngine::workspace_bytes) for a banner.
std::string workspace_note(const GenerationEngine& engine);

// Commands with positional arguments (merge's PATHs, report's RUN_DIRs): the positional ones of
// argv are returned, the rest go into `rest` for Args. An argument starting with '-' is an option;
// `--name` of an option that takes a value (in `options`) takes the next argument with it.
std::vector<std::string> split_positionals(int argc, char** argv, const std::vector<Option>& options,
                                           std::vector<char*>& rest);

// The help of a command: `usage`, then "options:" with every option and its help, then `more`.
std::string options_help(const std::string& usage, const std::vector<Option>& options, const std::string& more = "");

// Every config key with its type, the code's default and its meaning, by section (train's help).
std::string config_keys_help();

// configs/default.toml, then --config FILE, then every --set, then validation.
LoomConfig load_config(const Args& args);
// model.vocab_size = 0 follows the dataset: its data.dir/meta.json's vocab_size (an error naming
// the file and the key when it cannot be read).
void vocab_from_data(LoomConfig& config);

// The run's tokenizer (data.tokenizer), checked against the model's vocabulary (model.vocab_size).
std::unique_ptr<Tokenizer> model_tokenizer(const LoomConfig& config);
// Calibration data (loom quantize, loom prune): the first `tokens` tokens of the text file at
// `path` (tokenized with the model's tokenizer) as sequences of seq_len tokens. The file is read
// and tokenized in pieces only until it has them (data/text_tokens.h), at most max_bytes of it.
// Errors name the file and --calib-tokens when the text is shorter, the limit when the first
// max_bytes hold fewer tokens (/dev/zero under a tokenizer that merges zeros), a folder.
inline constexpr uint64_t kCalibrationReadLimit = uint64_t{256} << 20;
std::vector<std::vector<int32_t>> calibration_sequences(const std::string& path, int64_t tokens, const LoomConfig& config,
                                                        int64_t seq_len, uint64_t max_bytes = kCalibrationReadLimit);
// A Loom checkpoint of weights only (no optimizer state) at <out>/checkpoints/step_00000000,
// the tokenizer attached, `extra` in its trainer.json; returns the step folder. A tokenizer folder
// without tokenizer files is recorded as none (data.tokenizer = "", a warning on stderr), which
// model_tokenizer refuses naming --tokenizer.
std::string save_weights_checkpoint(const std::string& out, const LoomConfig& config, const Tensor& params,
                                    const nlohmann::json& extra = nlohmann::json::object());
// Refuses an `out` that save_weights_checkpoint would mix into: one that exists and holds anything
// but checkpoints/step_00000000 (an earlier weights-only save, replaced), e.g. a training run whose
// newer steps eval would go on reading. loom merge, prune and convert --to loom call it before
// loading anything; save_weights_checkpoint calls it too.
void check_weights_out(const std::string& out);


// `bytes` with every invalid UTF-8 sequence replaced by U+FFFD, for display: a model may
// sample byte tokens that do not form characters.
std::string printable_utf8(const std::string& bytes);

bool stdout_is_terminal();
std::string format_duration(double seconds);  // "4m05s"

}  // namespace loom::cli
