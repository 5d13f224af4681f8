#include "loom/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <utility>

#include "loom/checkpoint/model_config_json.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/core/error.h"
#include "loom/core/file_io.h"
#include "loom/core/json_file.h"
#include "loom/arch/param_layout.h"
#include "loom/core/memory.h"

namespace loom {

namespace fs = std::filesystem;

namespace {

constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kTrainerFile = "trainer.json";
constexpr const char* kManifestFile = "manifest.json";
constexpr const char* kManifestFormat = "loom-checkpoint";
constexpr int64_t kManifestVersion = 1;
constexpr const char* kStepPrefix = "step_";
constexpr const char* kTmpSuffix = ".tmp";
constexpr const char* kQuantizedKind = "quantized";

// ---- step directory names ----

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

// ---- checks on the caller's tensors ----

void check_flat_f32(const Tensor& t, int64_t numel, const std::string& where, const char* what) {
  LOOM_CHECK(t.defined(), where, ": ", what, " is undefined, expected f32(", numel, ") in host memory");
  LOOM_CHECK(t.dtype() == DTYPE_F32 && t.numel() == numel && t.device() == DEVICE_CPU, where, ": ", what, " is ",
             t.describe(), (t.device() == DEVICE_CPU ? "" : " on a device"), ", expected f32(", numel,
             ") in host memory");
}

// ---- writing ----

void write_model_file(const std::string& path, const ModelState& model, const ParamLayout& layout, bool hf_layout) {
  CpuAllocator transposed_alloc;  // the (in, out) copies of Conv1D weights, freed when written
  std::vector<std::pair<std::string, Tensor>> tensors;
  tensors.reserve(layout.params.size());
  for (const ParamSpec& spec : layout.params) {
    Tensor view = model.params.view(spec.offset, spec.shape);
    if (file_transposes(spec, hf_layout)) {
      Tensor t = Tensor::empty(transposed_alloc, file_shape(spec, hf_layout), DTYPE_F32, MEM_WORKSPACE);
      transpose_into(view.data<float>(), t.data<float>(), spec.shape[0], spec.shape[1]);
      view = t;
    }
    tensors.emplace_back(spec.name, view);
  }
  // "format": "pt" is what transformers' from_pretrained requires of a safetensors file.
  write_safetensors(path, tensors,
                    {{"format", "pt"},
                     {"arch", std::string(arch_name(model.config.arch))},
                     {"model_config", model_config_json(model.config).dump()},
                     {"hf_layout", hf_layout ? "true" : "false"}});
}

void write_optimizer_file(const std::string& path, const CheckpointContents& c) {
  write_safetensors(path, c.optimizer.tensors,
                    {{"format", "pt"}, {"optimizer", c.optimizer.name}, {"step", std::to_string(c.optimizer_steps)}});
}

nlohmann::json trainer_json(const CheckpointContents& c) {
  return {{"step", c.step}, {"data_state", c.data_state}, {"config_text", c.config_text}, {"extra", c.extra}};
}

// "shard_00001_of_00004.safetensors"
std::string shard_file_name(int rank, int world) {
  std::ostringstream out;
  out << "shard_" << std::setw(5) << std::setfill('0') << rank << "_of_" << std::setw(5) << std::setfill('0') << world
      << ".safetensors";
  return out.str();
}

// A relative path inside a checkpoint: "model.safetensors", "tokenizer/vocab.bpe"; no empty,
// "." or ".." component, not absolute.
bool is_inside_name(const std::string& name) {
  if (name.empty() || name.front() == '/') return false;
  size_t begin = 0;
  while (begin <= name.size()) {
    const size_t end = std::min(name.find('/', begin), name.size());
    const std::string part = name.substr(begin, end - begin);
    if (part.empty() || part == "." || part == "..") return false;
    begin = end + 1;
  }
  return true;
}

// Copies each attached file into dir/<name>, synced.
void copy_attached(const fs::path& dir, const std::vector<std::pair<std::string, std::string>>& attached) {
  for (const auto& [name, source] : attached) {
    LOOM_CHECK(is_inside_name(name), "checkpoint: attached file name '", name, "' is not a path inside the checkpoint");
    const std::string bytes = read_text_file(source, kDefaultReadLimit, "the limit of a file attached to a checkpoint");
    fs::create_directories((dir / name).parent_path());
    write_text_synced((dir / name).string(), bytes);
    fsync_directory((dir / name).parent_path().string());
  }
}

// The files a checkpoint must hold besides the manifest: unsharded (shards = 0) or N shards; a
// quantized model folder (kind "quantized") has no optimizer state.
std::vector<std::string> required_files(int64_t shards, const std::string& kind = "") {
  if (kind == kQuantizedKind) return {kModelFile, kTrainerFile};
  if (shards == 0) return {kModelFile, kOptimizerFile, kTrainerFile};
  std::vector<std::string> files{kTrainerFile};
  for (int64_t r = 0; r < shards; ++r) files.push_back(shard_file_name(static_cast<int>(r), static_cast<int>(shards)));
  return files;
}

nlohmann::json manifest_json(const fs::path& dir, int64_t step, int64_t shards,
                             const std::vector<std::pair<std::string, std::string>>& attached, const std::string& kind = "") {
  std::vector<std::string> names = required_files(shards, kind);
  for (const auto& [name, source] : attached) names.push_back(name);
  nlohmann::json files = nlohmann::json::object();
  for (const std::string& name : names) {
    const FileDigest d = digest_file((dir / name).string());
    files[name] = {{"bytes", d.bytes}, {"xxh64", hex64(d.xxh64)}};
  }
  nlohmann::json m = {{"format", kManifestFormat}, {"version", kManifestVersion}, {"step", step}, {"files", files}};
  if (shards > 0) m["shards"] = shards;
  if (!kind.empty()) m["kind"] = kind;
  return m;
}

// Completes a folder whose data files are already in tmp_dir: trainer.json, the attached files
// and the manifest (last: its presence says every other file is complete), fsync, then tmp_dir
// renamed over final_dir (an existing one removed) and the parent fsynced. On failure tmp_dir is
// removed. What saves and quantized folders share.
void commit_folder(const fs::path& tmp_dir, const fs::path& final_dir, const CheckpointContents& contents, int64_t shards,
                   const std::string& kind) {
  std::error_code ec;
  try {
    write_text_synced((tmp_dir / kTrainerFile).string(), trainer_json(contents).dump(2));
    copy_attached(tmp_dir, contents.attached);
    write_text_synced((tmp_dir / kManifestFile).string(),
                      manifest_json(tmp_dir, contents.step, shards, contents.attached, kind).dump(2));
    fsync_directory(tmp_dir.string());
    if (fs::exists(final_dir, ec)) remove_tree(final_dir);  // an older save of the same step, e.g. before a fall-back
    fs::rename(tmp_dir, final_dir, ec);
    LOOM_CHECK(!ec, final_dir.string(), ": rename from ", tmp_dir.string(), " failed: ", ec.message());
    fsync_directory(final_dir.parent_path().empty() ? "." : final_dir.parent_path().string());
  } catch (...) {
    fs::remove_all(tmp_dir, ec);
    throw;
  }
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

int64_t parse_int(const std::string& text, const std::string& path, const std::string& key) {
  try {
    size_t used = 0;
    const int64_t v = std::stoll(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  throw Error(str_cat(path, ": metadata '", key, "' is '", text, "', expected an integer"));
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

// ---- sharded checkpoints ----

struct ShardFile {
  std::string path;
  SafetensorsFile file;
  int64_t begin = 0, end = 0;
};

// Reads and checks every shard: the same model layout, contiguous ranges tiling [0, P), the
// same optimizer; `flat` gets the names of the flat state tensors.
std::vector<ShardFile> read_shards(const std::string& dir, int64_t shards, const ModelConfig& config,
                                   const ParamLayout& layout, std::set<std::string>& flat) {
  std::vector<ShardFile> out;
  int64_t next = 0;
  for (int64_t r = 0; r < shards; ++r) {
    const std::string path = (fs::path(dir) / shard_file_name(static_cast<int>(r), static_cast<int>(shards))).string();
    ShardFile s{path, SafetensorsFile::read(path)};
    const std::string saved_config = s.file.metadata_value("model_config");
    const ParamLayout saved = build_param_layout(model_config_from_json(saved_config, path));
    bool same = saved.total == layout.total && saved.params.size() == layout.params.size() &&
                s.file.metadata_value("arch") == arch_name(config.arch);
    for (size_t i = 0; same && i < saved.params.size(); ++i) {
      same = saved.params[i].name == layout.params[i].name && saved.params[i].shape == layout.params[i].shape;
    }
    LOOM_CHECK(same, path, ": the checkpoint's model (", s.file.metadata_value("arch"), " ", saved_config,
               ") does not have this model's parameters (", arch_name(config.arch), ", ", layout.total, " elements)");
    s.begin = parse_int(s.file.metadata_value("begin"), path, "begin");
    s.end = parse_int(s.file.metadata_value("end"), path, "end");
    LOOM_CHECK(s.begin == next && s.end >= s.begin && s.end <= layout.total, path, ": holds elements [", s.begin, ", ",
               s.end, "), expected a range starting at ", next, " within [0, ", layout.total, ")");
    next = s.end;
    LOOM_CHECK(s.file.has("params") && s.file.shape("params") == Shape{s.end - s.begin} &&
                   s.file.dtype("params") == DTYPE_F32,
               path, ": expected tensor 'params' f32(", s.end - s.begin, ")");
    std::set<std::string> names;
    std::istringstream list(s.file.metadata_value("flat"));
    for (std::string name; std::getline(list, name, ',');) {
      if (!name.empty()) names.insert(name);
    }
    LOOM_CHECK(r == 0 || names == flat, path, ": its flat optimizer tensors differ from shard 0's");
    flat = names;
    out.push_back(std::move(s));
  }
  LOOM_CHECK(next == layout.total, dir, ": the shards cover [0, ", next, "), the model has ", layout.total, " elements");
  return out;
}

// Fills elements [first, first + dst.numel()) of a flat tensor from the shards holding them.
void copy_from_shards(const std::vector<ShardFile>& shards, const std::string& name, int64_t first, const Tensor& dst) {
  const int64_t last = first + dst.numel();
  for (const ShardFile& s : shards) {
    const int64_t lo = std::max(first, s.begin), hi = std::min(last, s.end);
    if (lo < hi) s.file.copy_range_into(name, lo - s.begin, dst.view(lo - first, {hi - lo}));
  }
}

LoadedCheckpoint read_trainer_file(const std::string& dir) {
  const std::string trainer_path = (fs::path(dir) / kTrainerFile).string();
  const nlohmann::json trainer = read_json_file(trainer_path);
  LoadedCheckpoint loaded;
  loaded.path = dir;
  try {
    // nlohmann casts a float such as 1e300 to the integer, undefined beyond its range.
    LOOM_CHECK(trainer.at("step").is_number_integer(), trainer_path, ": step is ", trainer.at("step").dump(),
               ", expected an integer");
    loaded.step = trainer.at("step").get<int64_t>();
    loaded.data_state = trainer.at("data_state");
    loaded.config_text = trainer.at("config_text").get<std::string>();
    loaded.extra = trainer.at("extra");
  } catch (const nlohmann::json::exception& e) {
    throw Error(str_cat(trainer_path, ": expected step, data_state, config_text and extra (", e.what(), ")"));
  }
  return loaded;
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

LoadedCheckpoint load_sharded(const std::string& dir, int64_t n_shards, const ModelState& model,
                              const OptimizerState& optimizer) {
  const ParamLayout layout = build_param_layout(model.config);
  std::set<std::string> flat;
  const std::vector<ShardFile> shards = read_shards(dir, n_shards, model.config, layout, flat);
  LoadedCheckpoint loaded = read_trainer_file(dir);
  if (!optimizer.name.empty()) {
    const SafetensorsFile& first = shards[0].file;
    const std::string& saved = first.metadata_value("optimizer");
    LOOM_CHECK(saved == optimizer.name, shards[0].path, ": holds the state of optimizer '", saved, "', the run uses '",
               optimizer.name, "' (set optim.name = \"", saved, "\" to resume it)");
    for (const auto& [name, t] : optimizer.tensors) {
      if (flat.count(name) != 0) {
        LOOM_CHECK(t.dtype() == DTYPE_F32 && optimizer.flat_begin + t.numel() <= layout.total, dir, ": optimizer tensor '",
                   name, "' ", t.describe(), " at flat offset ", optimizer.flat_begin, " exceeds the ", layout.total,
                   " parameters");
      } else {
        LOOM_CHECK(first.has(name) && first.dtype(name) == t.dtype() && shape_numel(first.shape(name)) == t.numel(),
                   shards[0].path, ": expected tensor '", name, "' ", t.describe(), " for the ", optimizer.name, " optimizer");
      }
    }
    loaded.optimizer_steps = parse_int(first.metadata_value("step"), shards[0].path, "step");
  }
  // Everything fits: only now overwrite the caller's tensors.
  copy_from_shards(shards, "params", 0, model.params);
  if (!optimizer.name.empty()) {
    for (const auto& [name, t] : optimizer.tensors) {
      if (flat.count(name) != 0) {
        copy_from_shards(shards, name, optimizer.flat_begin, t);
      } else {
        shards[0].file.copy_into(name, t);
      }
    }
  }
  return loaded;
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

bool is_quantized_model(const std::string& path) {
  std::error_code ec;
  const fs::path manifest = fs::path(path) / kManifestFile;
  if (!fs::is_regular_file(manifest, ec)) return false;
  const nlohmann::json m = read_json_file(manifest.string());
  return m.is_object() && m.value("kind", nlohmann::json()) == kQuantizedKind;
}

void write_quantized_model(const std::string& dir, const QuantizedModelContents& c) {
  const fs::path final_dir(dir), tmp_dir(dir + kTmpSuffix);
  std::error_code ec;
  LOOM_CHECK(!fs::exists(final_dir, ec) || is_quantized_model(dir), dir, ": exists and is not a quantized model; "
             "choose another --out (nothing was written)");
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir);
  try {
    CpuAllocator host;
    std::vector<std::pair<std::string, Tensor>> tensors;
    const ParamLayout layout = build_param_layout(c.model.config);
    for (const ParamSpec& spec : layout.params) {
      if (c.weights.count(spec.name) == 0 || c.also_f32.count(spec.name) != 0) {
        tensors.emplace_back(spec.name, c.model.params.view(spec.offset, spec.shape));
      }
    }
    auto host_tensor = [&](const Shape& shape, DType dtype, const void* data) {
      Tensor t = Tensor::empty(host, shape, dtype, MEM_WORKSPACE);
      std::memcpy(t.raw_data(), data, t.nbytes());
      return t;
    };
    for (const auto& [name, q] : c.weights) {
      const IntWeightSpec& s = q.spec;
      tensors.emplace_back(name + ".qweight", host_tensor({s.rows, int_row_bytes(s.bits, s.cols)}, DTYPE_U8, q.codes.data()));
      tensors.emplace_back(name + ".scales", host_tensor({s.rows, s.cols / s.group}, DTYPE_F32, q.scales.data()));
      tensors.emplace_back(name + ".zeros", host_tensor({s.rows, s.cols / s.group}, DTYPE_U8, q.zeros.data()));
      if (!q.input_scale.empty()) tensors.emplace_back(name + ".input_scale", host_tensor({s.cols}, DTYPE_F32, q.input_scale.data()));
    }
    write_safetensors((tmp_dir / kModelFile).string(), tensors,
                      {{"format", "pt"},
                       {"arch", std::string(arch_name(c.model.config.arch))},
                       {"model_config", model_config_json(c.model.config).dump()},
                       {"hf_layout", "false"},
                       {"quantization", c.quantization.dump()}});
    CheckpointContents trainer;
    trainer.config_text = c.config_text;
    trainer.extra = {{"quantization", c.quantization}};
    trainer.attached = c.attached;
    commit_folder(tmp_dir, final_dir, trainer, 0, kQuantizedKind);
  } catch (...) {
    fs::remove_all(tmp_dir, ec);
    throw;
  }
}

nlohmann::json read_quantized_model(const std::string& dir, const ModelState& model, std::map<std::string, IntWeight>& weights) {
  const std::string problem = checkpoint_problem(dir);
  LOOM_CHECK(problem.empty(), dir, ": ", problem);
  LOOM_CHECK(is_quantized_model(dir), dir, ": not a quantized model (its manifest has no kind \"quantized\")");
  const ParamLayout layout = build_param_layout(model.config);
  check_flat_f32(model.params, layout.total, dir, "model params");
  const std::string path = (fs::path(dir) / kModelFile).string();
  const SafetensorsFile file = SafetensorsFile::read(path);
  nlohmann::json quantization;
  try {
    quantization = nlohmann::json::parse(file.metadata_value("quantization"));
  } catch (const nlohmann::json::exception& e) {
    throw Error(str_cat(path, ": metadata quantization is not JSON (", e.what(), ")"));
  }
  const int bits = quantization.value("bits", 0);
  const bool act_int8 = quantization.value("activations", std::string("f32")) == "int8";
  auto expect = [&](const std::string& name, DType dtype, const Shape& shape) {
    LOOM_CHECK(file.has(name), path, ": missing tensor ", name);
    LOOM_CHECK(file.dtype(name) == dtype && file.shape(name) == shape, path, ": tensor ", name, " is ",
               file.stored_dtype(name), shape_str(file.shape(name)), ", expected ", dtype_name(dtype), shape_str(shape));
  };
  std::map<std::string, IntWeight> loaded;
  for (const ParamSpec& spec : layout.params) {
    if (file.has(spec.name) || !file.has(spec.name + ".qweight")) expect(spec.name, DTYPE_F32, spec.shape);
    if (!file.has(spec.name + ".qweight")) continue;
    LOOM_CHECK(spec.shape.size() == 2, path, ": ", spec.name, " is quantized but is not a matrix");
    const int64_t rows = spec.shape[0], cols = spec.shape[1];
    LOOM_CHECK(file.has(spec.name + ".scales"), path, ": missing tensor ", spec.name, ".scales");
    const Shape& scale_shape = file.shape(spec.name + ".scales");
    LOOM_CHECK(scale_shape.size() == 2 && scale_shape[1] > 0 && cols % scale_shape[1] == 0, path, ": tensor ", spec.name,
               ".scales has shape ", shape_str(scale_shape), ", expected (", rows, ", a divisor of ", cols, ")");
    IntWeight q;
    q.spec = int_weight_spec(bits, cols / scale_shape[1], rows, cols, act_int8, path + " (" + spec.name + ")");
    expect(spec.name + ".qweight", DTYPE_U8, {rows, int_row_bytes(bits, cols)});
    expect(spec.name + ".scales", DTYPE_F32, {rows, cols / q.spec.group});
    expect(spec.name + ".zeros", DTYPE_U8, {rows, cols / q.spec.group});
    CpuAllocator host;
    auto read = [&](const std::string& name, auto& vec) {
      const Tensor t = file.tensor(name, host, MEM_WORKSPACE);
      vec.resize(static_cast<size_t>(t.numel()));
      std::memcpy(vec.data(), t.raw_data(), t.nbytes());
    };
    read(spec.name + ".qweight", q.codes);
    read(spec.name + ".scales", q.scales);
    read(spec.name + ".zeros", q.zeros);
    if (file.has(spec.name + ".input_scale")) {
      expect(spec.name + ".input_scale", DTYPE_F32, {cols});
      read(spec.name + ".input_scale", q.input_scale);
    }
    loaded.emplace(spec.name, std::move(q));
  }
  // Everything fits: only now fill the caller's tensors.
  for (const ParamSpec& spec : layout.params) {
    if (file.has(spec.name)) file.copy_into(spec.name, model.params.view(spec.offset, spec.shape));
  }
  weights = std::move(loaded);
  return quantization;
}

std::string checkpoint_dir_name(int64_t step) {
  std::ostringstream out;
  out << kStepPrefix << std::setw(8) << std::setfill('0') << step;
  return out.str();
}

std::string checkpoint_problem(const std::string& path) {
  const fs::path dir(path);
  const fs::path manifest_path = dir / kManifestFile;
  std::error_code ec;
  if (!fs::is_regular_file(manifest_path, ec)) return str_cat(kManifestFile, " is missing");
  nlohmann::json manifest;
  try {
    manifest = read_json_file(manifest_path.string());
  } catch (const Error&) {
    return str_cat(kManifestFile, " is not valid JSON");
  }
  try {
    if (manifest.at("format").get<std::string>() != kManifestFormat || !manifest.at("files").is_object()) {
      return str_cat(kManifestFile, " is not a Loom checkpoint manifest");
    }
    if (!manifest.at("version").is_number_integer() || manifest.at("version").get<int64_t>() != kManifestVersion) {
      return str_cat(kManifestFile, " has version ", manifest.at("version").dump(), ", expected ", kManifestVersion);
    }
  } catch (const nlohmann::json::exception&) {
    return str_cat(kManifestFile, " is not a Loom checkpoint manifest");
  }
  const nlohmann::json& files = manifest["files"];
  const nlohmann::json shards = manifest.value("shards", nlohmann::json(0));
  if (!shards.is_number_integer() || shards.get<int64_t>() < 0 || shards.get<int64_t>() > (1 << 20)) {
    return str_cat(kManifestFile, " has shards = ", shards.dump(), ", expected a count of ranks");
  }
  const nlohmann::json kind = manifest.value("kind", nlohmann::json(""));
  if (!kind.is_string() || (kind.get<std::string>() != "" && kind.get<std::string>() != kQuantizedKind)) {
    return str_cat(kManifestFile, " has kind ", kind.dump(), ", expected none or \"quantized\"");
  }
  for (const std::string& name : required_files(shards.get<int64_t>(), kind.get<std::string>())) {
    if (!files.contains(name)) return str_cat(kManifestFile, " does not list ", name);
  }
  for (const auto& [name, entry] : files.items()) {
    if (!is_inside_name(name)) {
      return str_cat(kManifestFile, " lists '", name, "', expected a file name inside the checkpoint");
    }
    if (!entry.is_object() || !entry.contains("bytes") || !entry["bytes"].is_number_unsigned() ||
        !entry.contains("xxh64") || !entry["xxh64"].is_string()) {
      return str_cat(kManifestFile, " entry for ", name, " needs bytes and xxh64");
    }
    const fs::path file = dir / name;
    if (!fs::is_regular_file(file, ec)) return str_cat(name, " is missing");
    const uint64_t expected_bytes = entry["bytes"].get<uint64_t>();
    const uint64_t bytes = fs::file_size(file, ec);
    if (ec) return str_cat(name, " cannot be read (", ec.message(), ")");
    if (bytes != expected_bytes) return str_cat(name, " has ", bytes, " bytes, the manifest says ", expected_bytes);
    FileDigest digest;
    try {
      digest = digest_file(file.string());
    } catch (const Error& e) {
      return e.what();
    }
    const std::string& expected_hash = entry["xxh64"].get_ref<const std::string&>();
    if (hex64(digest.xxh64) != expected_hash) {
      return str_cat(name, " has XXH64 ", hex64(digest.xxh64), ", the manifest says ", expected_hash);
    }
  }
  return "";
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

namespace {

// Host copies of a run's tensors that host code cannot read: `twin` gives the tensor itself when
// it is host-accessible, else a host tensor of its shape (filled from it when `read`).
class HostStaging {
 public:
  explicit HostStaging(Backend* backend) : backend_(backend) {}
  Tensor twin(const Tensor& t, bool read) {
    if (!t.defined() || t.host_accessible()) return t;
    LOOM_CHECK(backend_ != nullptr, "checkpoint: tensor ", t.describe(), " is in device memory but no backend was "
               "given to read it (CheckpointOptions::backend)");
    Tensor h = Tensor::empty(host_, t.shape(), t.dtype(), MEM_WORKSPACE);
    if (read) backend_->read(t, h.raw_data());
    pairs_.emplace_back(t, h);
    return h;
  }
  void write_back() {
    for (const auto& [device, h] : pairs_) backend_->write(device, h.raw_data());
  }

 private:
  Backend* backend_;
  CpuAllocator host_;
  std::vector<std::pair<Tensor, Tensor>> pairs_;  // (device tensor, its host copy)
};

}  // namespace

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

void CheckpointManager::begin_sharded(int64_t step) {
  const fs::path final_dir = fs::path(dir_) / checkpoint_dir_name(step);
  LOOM_CHECK(step >= 0, final_dir.string(), ": checkpoint step must be >= 0, got ", step);
  std::error_code ec;
  const bool created = fs::create_directories(dir_, ec);
  LOOM_CHECK(!ec, dir_, ": cannot create the checkpoints folder: ", ec.message());
  if (created) fsync_directory(fs::absolute(dir_).parent_path().string());
  remove_stale_tmp_dirs();
  const fs::path tmp_dir = fs::path(final_dir.string() + kTmpSuffix);
  fs::create_directory(tmp_dir, ec);
  LOOM_CHECK(!ec, tmp_dir.string(), ": cannot create: ", ec.message());
}

void CheckpointManager::write_shard(int64_t step, const ShardContents& shard) const {
  const fs::path tmp_dir = fs::path((fs::path(dir_) / checkpoint_dir_name(step)).string() + kTmpSuffix);
  const std::string path = (tmp_dir / shard_file_name(shard.rank, shard.world)).string();
  const int64_t n = shard.end - shard.begin;
  // A GPU's tensors: read into host copies first, as save() does (a ZeRO checkpoint from device
  // memory was refused here until the CUDA simulator ran one).
  HostStaging staging(options_.backend);
  const Tensor params = staging.twin(shard.params, true);
  check_flat_f32(params, n, path, "params");
  std::vector<std::pair<std::string, Tensor>> tensors{{"params", params}};
  std::string flat;
  for (const auto& [name, device] : shard.flat) {
    LOOM_CHECK(name != "params" && name.find(',') == std::string::npos, path, ": optimizer tensor name '", name,
               "' is reserved or holds a comma");
    const Tensor t = staging.twin(device, true);
    check_flat_f32(t, n, path, name.c_str());
    tensors.emplace_back(name, t);
    flat += (flat.empty() ? "" : ",") + name;
  }
  if (shard.rank == 0) {
    for (const auto& [name, t] : shard.whole) tensors.emplace_back(name, staging.twin(t, true));
  }
  write_safetensors(path, tensors,
                    {{"format", "pt"},
                     {"arch", std::string(arch_name(shard.config.arch))},
                     {"model_config", model_config_json(shard.config).dump()},
                     {"rank", std::to_string(shard.rank)},
                     {"world", std::to_string(shard.world)},
                     {"begin", std::to_string(shard.begin)},
                     {"end", std::to_string(shard.end)},
                     {"flat", flat},
                     {"optimizer", shard.optimizer},
                     {"step", std::to_string(shard.optimizer_steps)}});
}

std::string CheckpointManager::commit_sharded(const CheckpointContents& contents, int world) {
  LOOM_CHECK(world >= 1, dir_, ": a sharded checkpoint needs at least one shard, got ", world);
  return commit(contents, world);
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
