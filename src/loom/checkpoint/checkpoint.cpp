// Atomic training checkpoints (the layout in checkpoint.h): the model and optimizer files of an
// unsharded save, written and checked and read back, and the CheckpointManager that names, lists,
// loads, verifies and prunes step folders. A folder's manifest and commit are in
// checkpoint_folder.cpp, sharded saves in checkpoint_shards.cpp, quantized model folders in
// quantized_model.cpp.
#include "loom/checkpoint/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <iomanip>
#include <optional>
#include <set>
#include <sstream>
#include <utility>

#include "loom/checkpoint/checkpoint_internal.h"
#include "loom/checkpoint/model_config_json.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/core/error.h"
#include "loom/core/file_io.h"
#include "loom/core/json_file.h"
#include "loom/arch/param_layout.h"
#include "loom/core/memory.h"

namespace loom {

namespace fs = std::filesystem;
using namespace ckpt;

namespace {

// ---- step directory names ----

constexpr const char* kStepPrefix = "step_";

// The step of "step_<digits>" (with `suffix` after the digits), or -1 for any other name.
int64_t parse_step_name(const std::string& name, const std::string& suffix) {
  const std::string prefix = kStepPrefix;
  if (name.size() <= prefix.size() + suffix.size() || name.compare(0, prefix.size(), prefix) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return -1;
  }
  const std::string digits = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.size() > 18 || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return -1;
  }
  return std::stoll(digits);
}

// ---- Hugging Face GPT-2 layout ----

// GPT-2's Conv1D weights, which Hugging Face stores (in, out): h.<i>.attn.c_attn.weight, ...
bool file_transposes(const ParamSpec& spec, bool hf_layout) { return hf_layout && is_gpt2_conv1d_weight(spec.name); }

Shape file_shape(const ParamSpec& spec, bool hf_layout) {
  return file_transposes(spec, hf_layout) ? Shape{spec.shape[1], spec.shape[0]} : spec.shape;
}

// ---- writing ----

std::map<std::string, std::string> model_file_metadata(const ModelState& model, bool hf_layout) {
  // "format": "pt" is what transformers' from_pretrained requires of a safetensors file.
  return {{"format", "pt"},
          {"arch", std::string(arch_name(model.config.arch))},
          {"model_config", model_config_json(model.config).dump()},
          {"hf_layout", hf_layout ? "true" : "false"}};
}

// A parameter as the file stores it: its view of params, or (a GPT-2 Conv1D weight in Hugging Face
// layout) an (in, out) copy in `alloc`.
Tensor file_tensor(const ModelState& model, const ParamSpec& spec, bool hf_layout, Allocator& alloc) {
  const Tensor view = model.params.view(spec.offset, spec.shape);
  if (!file_transposes(spec, hf_layout)) return view;
  Tensor t = Tensor::empty(alloc, file_shape(spec, hf_layout), DTYPE_F32, MEM_WORKSPACE);
  transpose_into(view.data<float>(), t.data<float>(), spec.shape[0], spec.shape[1]);
  return t;
}

// With ParamPages: one parameter at a time, each paged in (fill) before it is written and out
// (drop) after, so the file can be larger than the memory the values would take at once.
void write_model_file_paged(const std::string& path, const ModelState& model, const ParamLayout& layout, bool hf_layout) {
  std::vector<SafetensorsWriter::Entry> entries;
  for (const ParamSpec& spec : layout.params) entries.push_back({spec.name, "F32", file_shape(spec, hf_layout)});
  SafetensorsWriter writer(path, entries, model_file_metadata(model, hf_layout));
  CpuAllocator transposed_alloc;  // a Conv1D weight's (in, out) copy, freed once written
  for (const ParamSpec& spec : layout.params) {
    const bool paged = model.pages.covers(spec.offset);
    if (paged) model.pages.fill(spec.offset);
    const Tensor t = file_tensor(model, spec, hf_layout, transposed_alloc);
    writer.write(spec.name, t.data<float>(), t.nbytes());
    if (paged) model.pages.drop(spec.offset);
  }
  writer.close();
}

void write_model_file(const std::string& path, const ModelState& model, const ParamLayout& layout, bool hf_layout) {
  if (model.pages) {
    write_model_file_paged(path, model, layout, hf_layout);
    return;
  }
  CpuAllocator transposed_alloc;  // the (in, out) copies of Conv1D weights, freed when written
  std::vector<std::pair<std::string, Tensor>> tensors;
  tensors.reserve(layout.params.size());
  for (const ParamSpec& spec : layout.params) tensors.emplace_back(spec.name, file_tensor(model, spec, hf_layout, transposed_alloc));
  write_safetensors(path, tensors, model_file_metadata(model, hf_layout));
}

void write_optimizer_file(const std::string& path, const CheckpointContents& c) {
  write_safetensors(path, c.optimizer.tensors,
                    {{"format", "pt"}, {"optimizer", c.optimizer.name}, {"step", std::to_string(c.optimizer_steps)}});
}

// ---- reading ----

bool metadata_flag(const SafetensorsFile& file, const std::string& path, const std::string& key) {
  const std::string& v = file.metadata_value(key);
  LOOM_CHECK(v == "true" || v == "false", path, ": metadata '", key, "' is '", v, "', expected true or false");
  return v == "true";
}

// Checks that `file` holds exactly the model's parameters with the model's shapes (transposed
// where the file says hf_layout), before anything is copied.
void check_model_file(const SafetensorsFile& file, const std::string& path, const ModelConfig& config,
                      const ParamLayout& layout, bool hf_layout) {
  const std::string& arch = file.metadata_value("arch");
  LOOM_CHECK(arch == arch_name(config.arch), path, ": checkpoint arch is '", arch, "', the model is '",
             arch_name(config.arch), "'");
  std::set<std::string> expected;
  for (const ParamSpec& spec : layout.params) {
    expected.insert(spec.name);
    const Shape shape = file_shape(spec, hf_layout);
    LOOM_CHECK(file.has(spec.name), path, ": no tensor '", spec.name, "', the model expects f32", shape_str(shape),
               " (checkpoint model_config ", file.metadata_value("model_config"), ")");
    LOOM_CHECK(file.dtype(spec.name) == DTYPE_F32 && file.shape(spec.name) == shape, path, ": tensor '", spec.name,
               "' is ", dtype_name(file.dtype(spec.name)), shape_str(file.shape(spec.name)), ", the model expects f32",
               shape_str(shape), " (checkpoint model_config ", file.metadata_value("model_config"), ")");
  }
  for (const std::string& name : file.names()) {
    LOOM_CHECK(expected.count(name) != 0, path, ": tensor '", name, "' is not a parameter of this model (checkpoint ",
               "model_config ", file.metadata_value("model_config"), ")");
  }
}

void copy_model_file(const SafetensorsFile& file, const ModelState& model, const ParamLayout& layout, bool hf_layout) {
  CpuAllocator transposed_alloc;
  for (const ParamSpec& spec : layout.params) {
    if (model.pages && model.pages.covers(spec.offset)) continue;  // the model holds it already
    const Tensor dst = model.params.view(spec.offset, spec.shape);
    if (!file_transposes(spec, hf_layout)) {
      file.copy_into(spec.name, dst);
      continue;
    }
    const Tensor stored = file.tensor(spec.name, transposed_alloc, MEM_WORKSPACE);  // (in, out)
    transpose_into(stored.data<float>(), dst.data<float>(), spec.shape[1], spec.shape[0]);
  }
}

void check_optimizer_file(const SafetensorsFile& file, const std::string& path, const OptimizerState& optimizer) {
  const std::string saved = file.metadata().count("optimizer") != 0 ? file.metadata_value("optimizer") : "adamw";
  LOOM_CHECK(saved == optimizer.name, path, ": holds the state of optimizer '", saved, "', the run uses '", optimizer.name,
             "' (set optim.name = \"", saved, "\" to resume it)");
  for (const auto& [name, t] : optimizer.tensors) {
    LOOM_CHECK(file.has(name), path, ": no tensor '", name, "', the ", optimizer.name, " optimizer expects ", t.describe());
    const bool slice = file.shape(name).size() == 1 && optimizer.flat_begin + t.numel() <= file.shape(name)[0] &&
                       t.ndim() == 1;  // a ZeRO rank's range of a flat state tensor
    LOOM_CHECK(file.dtype(name) == t.dtype() && (file.shape(name) == t.shape() || slice), path, ": tensor '", name,
               "' is ", dtype_name(file.dtype(name)), shape_str(file.shape(name)), ", the ", optimizer.name,
               " optimizer expects ", t.describe(), optimizer.flat_begin > 0 ? " at a flat offset" : "");
  }
}

// Copies a checked optimizer file's tensors: whole, or this rank's range of a flat one.
void copy_optimizer_file(const SafetensorsFile& file, const OptimizerState& optimizer) {
  for (const auto& [name, t] : optimizer.tensors) {
    if (file.shape(name) == t.shape()) {
      file.copy_into(name, t);
    } else {
      file.copy_range_into(name, optimizer.flat_begin, t);
    }
  }
}

int64_t manifest_shards(const std::string& dir) {
  const std::string path = (fs::path(dir) / kManifestFile).string();
  const nlohmann::json manifest = read_json_file(path);
  LOOM_CHECK(manifest.is_object(), path, ": not a Loom checkpoint manifest (expected a JSON object)");
  const nlohmann::json shards = manifest.value("shards", nlohmann::json(0));
  LOOM_CHECK(shards.is_number_integer() && shards.get<int64_t>() >= 0 && shards.get<int64_t>() <= (1 << 20), path,
             ": shards = ", shards.dump(), ", expected a count of ranks");
  return shards.get<int64_t>();
}

// Loads a checkpoint whose manifest has been checked.
LoadedCheckpoint load_verified(const std::string& dir, const ModelState& model, const OptimizerState& optimizer) {
  LOOM_CHECK(!is_quantized_model(dir), dir, " is a quantized model (loom quantize): it loads for eval, generate and "
             "serve, not as fp32 weights or to resume training");
  const ParamLayout layout = build_param_layout(model.config);
  check_flat_f32(model.params, layout.total, dir, "model params");
  if (const int64_t shards = manifest_shards(dir); shards > 0) return load_sharded(dir, shards, model, optimizer);
  const bool load_optimizer = !optimizer.name.empty();

  const std::string model_path = (fs::path(dir) / kModelFile).string();
  const SafetensorsFile model_file = SafetensorsFile::read(model_path);
  const bool hf_layout = metadata_flag(model_file, model_path, "hf_layout");
  check_model_file(model_file, model_path, model.config, layout, hf_layout);
  LoadedCheckpoint loaded = read_trainer_file(dir);

  std::optional<SafetensorsFile> optimizer_file;
  if (load_optimizer) {
    const std::string optimizer_path = (fs::path(dir) / kOptimizerFile).string();
    optimizer_file = SafetensorsFile::read(optimizer_path);
    check_optimizer_file(*optimizer_file, optimizer_path, optimizer);
    loaded.optimizer_steps = parse_int(optimizer_file->metadata_value("step"), optimizer_path, "step");
  }

  // Everything fits: only now overwrite the caller's tensors.
  copy_model_file(model_file, model, layout, hf_layout);
  if (optimizer_file) copy_optimizer_file(*optimizer_file, optimizer);
  return loaded;
}

}  // namespace

namespace {

class CheckpointParamReader final : public BufferedParamReader {
 public:
  CheckpointParamReader(const std::string& dir, const ModelConfig& config)
      : BufferedParamReader(config, (fs::path(dir) / kModelFile).string()), file_(SafetensorsFile::read(path())),
        hf_layout_(metadata_flag(file_, path(), "hf_layout")) {
    check_model_file(file_, path(), config, layout(), hf_layout_);
  }

 private:
  void fill(const ParamSpec& spec, const Tensor& dst) override {
    if (!file_transposes(spec, hf_layout_)) {
      file_.copy_into(spec.name, dst);
      return;
    }
    CpuAllocator host;
    const Tensor stored = file_.tensor(spec.name, host, MEM_WORKSPACE);  // (in, out)
    transpose_into(stored.data<float>(), dst.data<float>(), spec.shape[1], spec.shape[0]);
  }
  SafetensorsFile file_;
  bool hf_layout_;
};

}  // namespace

std::unique_ptr<ParamReader> ckpt::checkpoint_param_reader(const std::string& dir, const ModelConfig& config) {
  const std::string problem = checkpoint_problem(dir);
  LOOM_CHECK(problem.empty(), "checkpoint ", dir, " is corrupt (", problem, ")");
  LOOM_CHECK(!is_quantized_model(dir), dir, " is a quantized model (loom quantize): it loads for eval, generate and "
             "serve, not as fp32 weights");
  if (manifest_shards(dir) > 0) return nullptr;
  return std::make_unique<CheckpointParamReader>(dir, config);
}

std::string checkpoint_dir_name(int64_t step) {
  std::ostringstream out;
  out << kStepPrefix << std::setw(8) << std::setfill('0') << step;
  return out.str();
}

ModelConfig checkpoint_model_config(const std::string& path) {
  if (const int64_t shards = manifest_shards(path); shards > 0) {
    const std::string shard_path = (fs::path(path) / shard_file_name(0, static_cast<int>(shards))).string();
    return model_config_from_json(SafetensorsFile::read(shard_path).metadata_value("model_config"), shard_path);
  }
  const std::string model_path = (fs::path(path) / kModelFile).string();
  const SafetensorsFile file = SafetensorsFile::read(model_path);
  return model_config_from_json(file.metadata_value("model_config"), model_path);
}

CheckpointManager::CheckpointManager(std::string dir, CheckpointOptions options)
    : dir_(std::move(dir)), options_(options) {
  LOOM_CHECK(options_.keep_last >= 1, dir_, ": checkpoint keep_last must be >= 1, got ", options_.keep_last);
}

std::string CheckpointManager::save(const CheckpointContents& device_contents) {
  HostStaging staging(options_.backend);  // a GPU's tensors: read into host copies first
  CheckpointContents contents = device_contents;
  contents.model.params = staging.twin(device_contents.model.params, true);
  for (auto& [name, t] : contents.optimizer.tensors) t = staging.twin(t, true);
  const fs::path final_dir = fs::path(dir_) / checkpoint_dir_name(contents.step);
  const ParamLayout layout = build_param_layout(contents.model.config);
  check_flat_f32(contents.model.params, layout.total, final_dir.string(), "model params");
  LOOM_CHECK(!contents.optimizer.name.empty(), final_dir.string(),
             ": a training checkpoint needs the optimizer's name (its state may be empty, as plain SGD's)");
  for (const auto& [name, t] : contents.optimizer.tensors) {
    LOOM_CHECK(t.defined() && t.dtype() == DTYPE_F32, final_dir.string(), ": optimizer tensor '", name, "' must be f32");
  }
  begin_sharded(contents.step);
  const fs::path tmp_dir = fs::path(final_dir.string() + kTmpSuffix);
  try {
    const bool hf_layout = options_.hf_layout && contents.model.config.arch == ARCH_GPT2;
    write_model_file((tmp_dir / kModelFile).string(), contents.model, layout, hf_layout);
    write_optimizer_file((tmp_dir / kOptimizerFile).string(), contents);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp_dir, ec);
    throw;
  }
  return commit(contents, 0);
}

std::string CheckpointManager::commit(const CheckpointContents& contents, int shards) {
  const fs::path final_dir = fs::path(dir_) / checkpoint_dir_name(contents.step);
  verified_.erase(final_dir.string());  // an older save of the same step is replaced
  commit_folder(fs::path(final_dir.string() + kTmpSuffix), final_dir, contents, shards, "");
  verified_.insert(final_dir.string());
  prune(contents.step);
  return final_dir.string();
}

std::optional<LoadedCheckpoint> CheckpointManager::load_latest(const ModelState& model, const OptimizerState& optimizer,
                                                               const CheckpointWarning& warn) {
  const std::vector<std::string> dirs = list();
  for (size_t i = 0; i < dirs.size(); ++i) {
    const std::string problem = checkpoint_problem(dirs[i]);
    if (problem.empty()) {
      verified_.insert(dirs[i]);
      return load_staged(dirs[i], model, optimizer);
    }
    const std::string older = i + 1 < dirs.size() ? dirs[i + 1] : std::string("no checkpoint");
    warn(str_cat("checkpoint ", dirs[i], " is corrupt (", problem, "); falling back to ", older));
  }
  return std::nullopt;
}

LoadedCheckpoint CheckpointManager::load(const std::string& path, const ModelState& model,
                                         const OptimizerState& optimizer) {
  const std::string problem = checkpoint_problem(path);
  LOOM_CHECK(problem.empty(), "checkpoint ", path, " is corrupt (", problem, ")");
  verified_.insert(path);
  return load_staged(path, model, optimizer);
}

LoadedCheckpoint CheckpointManager::load_staged(const std::string& path, const ModelState& model,
                                                const OptimizerState& optimizer) {
  HostStaging staging(options_.backend);
  ModelState m = model;
  m.params = staging.twin(model.params, false);
  OptimizerState o = optimizer;
  for (auto& [name, t] : o.tensors) t = staging.twin(t, false);
  LoadedCheckpoint loaded = load_verified(path, m, o);  // throws before anything is written back
  staging.write_back();
  return loaded;
}

std::vector<std::string> CheckpointManager::list() const {
  std::vector<std::pair<int64_t, std::string>> steps;
  std::error_code ec;
  if (!fs::is_directory(dir_, ec)) return {};
  for (const fs::directory_entry& entry : fs::directory_iterator(dir_, ec)) {
    const int64_t step = parse_step_name(entry.path().filename().string(), "");
    if (step >= 0 && entry.is_directory(ec)) steps.emplace_back(step, entry.path().string());
  }
  LOOM_CHECK(!ec, dir_, ": cannot list the checkpoints folder: ", ec.message());
  std::sort(steps.begin(), steps.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::string> out;
  for (auto& [step, path] : steps) out.push_back(std::move(path));
  return out;
}

bool CheckpointManager::is_valid_cached(const std::string& path) {
  if (verified_.count(path) != 0) return true;
  if (!checkpoint_problem(path).empty()) return false;
  verified_.insert(path);
  return true;
}

// Folders a crashed save left behind; only a saving process creates them.
void CheckpointManager::remove_stale_tmp_dirs() const {
  std::error_code ec;
  std::vector<fs::path> stale;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir_, ec)) {
    if (parse_step_name(entry.path().filename().string(), kTmpSuffix) >= 0) stale.push_back(entry.path());
  }
  LOOM_CHECK(!ec, dir_, ": cannot list the checkpoints folder: ", ec.message());
  for (const fs::path& p : stale) remove_tree(p);
}

// Keeps the newest keep_last valid checkpoints at or below the step just saved and deletes the
// other ones there (older or invalid). Higher steps belong to a run that was rewound to an
// earlier checkpoint; they are left for the user to judge.
void CheckpointManager::prune(int64_t saved_step) {
  int kept = 0;
  for (const std::string& path : list()) {
    if (parse_step_name(fs::path(path).filename().string(), "") > saved_step) continue;
    if (kept < options_.keep_last && is_valid_cached(path)) {
      ++kept;
      continue;
    }
    verified_.erase(path);
    remove_tree(path);
  }
}

}  // namespace loom
