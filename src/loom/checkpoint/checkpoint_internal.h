// What the checkpoint layer's files share, not for callers (the layer's interface is checkpoint.h):
// checkpoint.cpp (atomic saves and loads, CheckpointManager), checkpoint_folder.cpp (a step
// folder's trainer.json, manifest, commit and validation), checkpoint_shards.cpp (sharded saves
// and loads) and quantized_model.cpp (quantized model folders).
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/checkpoint/checkpoint.h"
#include "loom/checkpoint/param_reader.h"
#include "loom/core/error.h"
#include "loom/core/tensor.h"

namespace loom::ckpt {

inline constexpr const char* kModelFile = "model.safetensors";
inline constexpr const char* kOptimizerFile = "optimizer.safetensors";
inline constexpr const char* kTrainerFile = "trainer.json";
inline constexpr const char* kManifestFile = "manifest.json";
inline constexpr const char* kTmpSuffix = ".tmp";
inline constexpr const char* kQuantizedKind = "quantized";

// Throws naming `where` and `what` unless t is f32(numel) in host memory.
void check_flat_f32(const Tensor& t, int64_t numel, const std::string& where, const char* what);

// "shard_00001_of_00004.safetensors"
std::string shard_file_name(int rank, int world);

// Completes a folder whose data files are already in tmp_dir: trainer.json, the attached files
// and the manifest (last: its presence says every other file is complete), fsync, then tmp_dir
// renamed over final_dir (an existing one removed) and the parent fsynced. On failure tmp_dir is
// removed. What saves and quantized folders share.
void commit_folder(const std::filesystem::path& tmp_dir, const std::filesystem::path& final_dir,
                   const CheckpointContents& contents, int64_t shards, const std::string& kind);

// A safetensors metadata value that must be an integer; throws naming the file and the key.
int64_t parse_int(const std::string& text, const std::string& path, const std::string& key);

// trainer.json of the step folder `dir`: everything a load returns besides the tensors.
LoadedCheckpoint read_trainer_file(const std::string& dir);

// Loads a sharded checkpoint (its manifest checked; n_shards from it) into any number of ranks:
// checks every shard before it overwrites the caller's tensors (checkpoint_shards.cpp).
LoadedCheckpoint load_sharded(const std::string& dir, int64_t n_shards, const ModelState& model,
                              const OptimizerState& optimizer);

// An unsharded checkpoint's parameters one at a time (weights.h open_param_reader; its
// manifest and model file checked first); null for a sharded one.
std::unique_ptr<ParamReader> checkpoint_param_reader(const std::string& dir, const ModelConfig& config);

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

}  // namespace loom::ckpt
