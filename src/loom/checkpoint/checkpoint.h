// Training checkpoints: one directory per step under a checkpoints folder (usually
// runs/<name>/checkpoints/),
//   step_<NNNNNNNN>/model.safetensors      every parameter under its ParamLayout name, f32
//                   optimizer.safetensors  the optimizer's named state tensors (f32), e.g. AdamW's
//                                          "exp_avg", "exp_avg_sq" (P); metadata: optimizer name, step
//                   trainer.json           step, data/RNG state, resolved config text, extra
//                   manifest.json          size and XXH64 of each file above; written last
// A sharded checkpoint (data parallel ranks with ZeRO, each holding a shard of the flat state)
// has instead of the two safetensors files one per rank,
//                   shard_<r>_of_<N>.safetensors  elements [begin_r, end_r) of the flat
//                                          parameters ("params") and of each flat optimizer
//                                          tensor; shard 0 also the whole (non-flat) tensors
// and the manifest records "shards": N. Any number of ranks loads it (resharding): a rank reads
// the elements of its own range from whichever shards hold them, since every shard is a
// contiguous range of the same flat order.
// A checkpoint is valid iff its manifest exists and every listed file has the listed size and
// checksum. Saving writes step_<N>.tmp/, fsyncs every file and the folder, renames it to
// step_<N>/ and fsyncs the parent, so a crash leaves either the whole checkpoint or none.
// This layer takes plain values (tensors, config, json); it knows nothing of the trainer.
// P: total parameter count (ParamLayout::total).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/core/tensor.h"
#include "loom/arch/config.h"
#include "loom/precision/int_quant.h"

namespace loom {

// Parameters whose values live elsewhere and enter the flat buffer one parameter at a time
// (QLoRA's base read while loading: its block matrices exist only in NF4, model/frozen_base.h).
// Each is a whole parameter, named by the offset where it starts: covers(offset) says whether it
// is one of them, fill(offset) writes its values into the buffer before a save reads them,
// drop(offset) returns their memory after. A load skips them (the model holds them already).
// Empty: the buffer holds every value.
struct ParamPages {
  std::function<bool(int64_t offset)> covers;
  std::function<void(int64_t offset)> fill, drop;
  explicit operator bool() const { return static_cast<bool>(covers); }
};

// The model's live parameters. Save reads them; load copies into them (no reallocation).
struct ModelState {
  ModelConfig config;  // its ParamLayout (build_param_layout) says where each parameter lives
  Tensor params;       // (P) f32, host: the flat parameter buffer
  ParamPages pages = {};  // values entering params one parameter at a time (host params only)
};

// The optimizer's state, live: its name and named f32 tensors (Optimizer::state(); plain SGD
// has none). An empty name on load skips the optimizer (inference). On load the file must hold the same optimizer
// and exactly these tensors with these shapes.
struct OptimizerState {
  std::string name;
  std::vector<std::pair<std::string, Tensor>> tensors;
  // A ZeRO rank's state: its flat tensors (one value per parameter) hold only elements
  // [flat_begin, flat_begin + numel) of the P-element state. Loading then reads that range.
  int64_t flat_begin = 0;
};

// One rank's part of a sharded checkpoint.
struct ShardContents {
  int rank = 0, world = 1;
  int64_t begin = 0, end = 0;  // this rank's flat elements
  ModelConfig config;
  Tensor params;  // (end - begin) f32: its slice of the parameters
  std::string optimizer;
  int64_t optimizer_steps = 0;
  std::vector<std::pair<std::string, Tensor>> flat;   // (end - begin) f32 each
  std::vector<std::pair<std::string, Tensor>> whole;  // rank 0: state kept entire (e.g. FP8 amax histories)
};

struct CheckpointContents {
  int64_t step = 0;  // training steps completed; names the directory
  ModelState model;
  OptimizerState optimizer;
  int64_t optimizer_steps = 0;  // Optimizer::steps_taken(), for bias correction on resume
  nlohmann::json data_state;    // RNG / data-loader state, opaque to this layer
  std::string config_text;      // the resolved run config
  nlohmann::json extra;         // anything else the caller keeps, opaque
  // Files copied into the checkpoint and listed in its manifest, (name inside the step folder,
  // e.g. "tokenizer/vocab.bpe"; source path): what makes a checkpoint self-contained (its
  // tokenizer), so that a step folder moved elsewhere still evaluates and generates alone.
  std::vector<std::pair<std::string, std::string>> attached;
};

// What a load returns besides the tensors it filled.
struct LoadedCheckpoint {
  std::string path;  // the step directory
  int64_t step = 0;
  int64_t optimizer_steps = 0;  // pass to Optimizer::restore_steps_taken
  nlohmann::json data_state;
  std::string config_text;
  nlohmann::json extra;
};

struct CheckpointOptions {
  int keep_last = 3;  // valid checkpoints kept; older ones are deleted after a save completes
  // GPT-2 only: store the four Conv1D matrices per layer (attn.c_attn, attn.c_proj, mlp.c_fc,
  // mlp.c_proj .weight) as (in, out), as Hugging Face's GPT2LMHeadModel expects. Loom keeps
  // them (out, in); the file records the choice and load transposes back.
  bool hf_layout = true;
  // The backend whose tensors a save reads and a load fills. Tensors host code cannot read (a
  // GPU's) go through host copies, so a CPU and a GPU run write and read the same files. Null:
  // every tensor must be in host memory.
  Backend* backend = nullptr;
};

// One line per skipped checkpoint: "checkpoint <path> is corrupt (<reason>); falling back to <older>".
using CheckpointWarning = std::function<void(const std::string& line)>;

class CheckpointManager {
 public:
  // `dir` is the checkpoints folder itself (created on the first save).
  explicit CheckpointManager(std::string dir, CheckpointOptions options = {});

  // Writes step_<contents.step>/ atomically (replacing one with the same step), deleting stale
  // .tmp folders first and, once the new checkpoint is complete, every checkpoint at or below
  // its step but the newest keep_last valid ones. Returns its path.
  std::string save(const CheckpointContents& contents);

  // A sharded save, in three phases with a barrier between them (the caller's; this layer
  // knows nothing of ranks): rank 0 begin_sharded(step) makes a fresh step_<N>.tmp/; every
  // rank write_shard(step, its shard); rank 0 commit_sharded(contents, world) writes
  // trainer.json and the manifest over every file, renames the folder and prunes, as save()
  // does (contents.model.params and contents.optimizer are not used). Returns the path.
  void begin_sharded(int64_t step);
  void write_shard(int64_t step, const ShardContents& shard) const;
  std::string commit_sharded(const CheckpointContents& contents, int world);

  // The newest valid checkpoint, loaded into `model` (and `optimizer` when defined); invalid
  // ones are skipped and reported through `warn`. nullopt when there is none. A valid
  // checkpoint that does not fit the model is an error, not a fall-back.
  std::optional<LoadedCheckpoint> load_latest(const ModelState& model, const OptimizerState& optimizer,
                                              const CheckpointWarning& warn);
  // The checkpoint at `path` (a step directory), after checking its manifest. Errors name the
  // file and, for tensors, the tensor and both shapes; nothing is copied unless all of it fits.
  LoadedCheckpoint load(const std::string& path, const ModelState& model, const OptimizerState& optimizer);

  // Step directories (valid or not), newest first; .tmp folders are not listed.
  std::vector<std::string> list() const;
  const std::string& dir() const { return dir_; }

 private:
  bool is_valid_cached(const std::string& path);
  // load_verified through host copies of any tensor host code cannot read (options_.backend).
  LoadedCheckpoint load_staged(const std::string& path, const ModelState& model, const OptimizerState& optimizer);
  // trainer.json and the manifest into step_<N>.tmp/, then the atomic rename and pruning.
  std::string commit(const CheckpointContents& contents, int shards);
  void remove_stale_tmp_dirs() const;
  void prune(int64_t saved_step);

  std::string dir_;
  CheckpointOptions options_;
  // Step directories whose checksums matched in this process (written by save, or verified by
  // a load). Pruning trusts them instead of re-reading every kept checkpoint on every save;
  // loads always verify.
  std::set<std::string> verified_;
};

// "" when the checkpoint at `path` is valid, else why not (one phrase naming the file).
std::string checkpoint_problem(const std::string& path);

// The model config recorded in a checkpoint, to build the model before loading it.
ModelConfig checkpoint_model_config(const std::string& path);

// "step_00001234"
std::string checkpoint_dir_name(int64_t step);

// A quantized model folder (loom quantize --out, docs/compression.md): a step folder without
// optimizer state whose manifest has "kind": "quantized",
//   model.safetensors  every parameter that is not quantized (F32, Loom's (out, in) layout; a
//                      bf16 source's token embedding as BF16), and each quantized weight NAME as
//                      NAME.qweight, .scales (F32 or F16), .zeros (absent for symmetric groups)
//                      and the optional .input_scale (precision/int_quant.h); metadata
//                      "quantization": the method, bits, group, scales, symmetric and activation
//                      format as JSON, besides arch and model_config
//   trainer.json       the source's config text; extra.quantization
//   tokenizer/...      the attached tokenizer files
// written into <dir>.tmp and renamed into place (an existing folder is replaced only if it is a
// quantized model itself).
//
// The folder's layout, fixed before any tensor is made (QuantizedModelWriter writes it tensor by
// tensor as streaming quantization makes them).
struct QuantizedModelPlan {
  struct Weight {
    IntWeightSpec spec;
    bool input_scale = false;
  };
  ModelConfig model;
  std::map<std::string, Weight> quantized;     // by parameter name
  IntStorage storage;                          // f16 scales, symmetric groups
  std::map<std::string, DType> plain_dtype;    // a plain parameter's dtype: F32 unless named (BF16)
  std::set<std::string> also_plain;            // quantized parameters also written plain (a tied head's embedding)
  nlohmann::json quantization;                 // {"method", "bits", "group", "activations", ...}
  DType plain_type(const std::string& name) const {
    const auto it = plain_dtype.find(name);
    return it == plain_dtype.end() ? DTYPE_F32 : it->second;
  }
};

class QuantizedModelWriter {
 public:
  // Creates <dir>.tmp and model.safetensors' header; an existing `dir` must be a quantized model
  // (it is replaced at commit).
  QuantizedModelWriter(std::string dir, QuantizedModelPlan plan);
  ~QuantizedModelWriter();  // not committed: <dir>.tmp removed
  QuantizedModelWriter(const QuantizedModelWriter&) = delete;
  QuantizedModelWriter& operator=(const QuantizedModelWriter&) = delete;
  // The plain parameters write_plain expects, in layout order.
  std::vector<std::string> plain_params() const;
  // A plain parameter: a host tensor of its shape in the planned dtype.
  void write_plain(const std::string& name, const Tensor& host);
  // A quantized weight, as planned (spec, storage, input scale).
  void write_weight(const std::string& name, const IntWeight& q);
  // Checks every tensor was written, writes trainer.json (config_text, extra.quantization) and
  // the attachments, and commits the folder.
  void commit(const std::string& config_text, const std::vector<std::pair<std::string, std::string>>& attached);
  uint64_t model_file_bytes() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// A whole quantized model in memory, written at once (through QuantizedModelWriter).
struct QuantizedModelContents {
  ModelState model;  // every parameter; the quantized ones' elements are not written
  std::map<std::string, IntWeight> weights;
  // Quantized parameters whose f32 values are written too: a tied head's, the embedding that
  // still looks tokens up.
  std::set<std::string> also_f32;
  nlohmann::json quantization;  // {"method", "bits", "group", "activations", ...}
  std::string config_text;
  std::vector<std::pair<std::string, std::string>> attached;
};
void write_quantized_model(const std::string& dir, const QuantizedModelContents& contents);
bool is_quantized_model(const std::string& path);
// Checks the manifest and every tensor, then fills model.params' f32 parameters (every one the
// file holds plain, BF16 ones widened) and `weights` (F16 scales widened, a symmetric format's
// zero points filled in); the plain parameters named in `bf16` that the file holds as BF16 go
// into those host bf16 tensors instead (used in place, train/model_source.h). Returns the
// quantization metadata. Errors name the file and the tensor.
nlohmann::json read_quantized_model(const std::string& dir, const ModelState& model, std::map<std::string, IntWeight>& weights,
                                    const std::map<std::string, Tensor>& bf16 = {});
// The parameters the folder stores plain as BF16.
std::vector<std::string> quantized_model_bf16_params(const std::string& dir);

}  // namespace loom
