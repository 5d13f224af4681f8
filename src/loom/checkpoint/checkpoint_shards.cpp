// Sharded checkpoints (the layout in checkpoint.h): the three phases of a sharded save
// (CheckpointManager::begin_sharded, write_shard, commit_sharded) and the load, which checks that
// the shards tile the model's flat order and then reads any rank's range from whichever shards
// hold it (resharding).
#include "loom/checkpoint/checkpoint_internal.h"

#include <algorithm>
#include <set>
#include <sstream>

#include "loom/arch/param_layout.h"
#include "loom/checkpoint/model_config_json.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/core/file_io.h"

namespace loom {

namespace fs = std::filesystem;
using namespace ckpt;

namespace ckpt {

namespace {

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
    // The block and expert counts first: the saved layout is built only for a config that could
    // match, so a file saying 4096 blocks costs no list of their names.
    const ModelConfig saved_model = model_config_from_json(saved_config, path);
    bool same = saved_model.n_layer == config.n_layer && saved_model.moe_experts == config.moe_experts &&
                s.file.metadata_value("arch") == arch_name(config.arch);
    ParamLayout saved;
    try {
      if (same) saved = build_param_layout(saved_model);
    } catch (const Error& e) {
      throw Error(str_cat(path, ": metadata 'model_config' describes no model (", e.what(), ")"));
    }
    same = same && saved.total == layout.total && saved.params.size() == layout.params.size();
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

}  // namespace

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

}  // namespace ckpt

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

}  // namespace loom
