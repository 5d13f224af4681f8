// Model and optimizer state between a layout's ranks and the one-process checkpoint.
//
// A checkpoint always holds the state a single process would (checkpoint/checkpoint.h), so it
// resumes on any layout. Each dimension that cuts the state is undone, innermost first:
//   ZeRO's shard      -> its domain        (all-gather over the ZeRO group)
//   a rank's domain   -> the flat buffer   (pipeline stages and experts: summed over pp x ep,
//                                            each element counted by exactly one owner)
//   a tensor slice    -> the whole model   (summed over tp)
// ZeRO alone writes a sharded checkpoint instead: each rank its own shard file.
// A load runs the same steps backwards.
#pragma once
#include <functional>
#include <future>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loom/checkpoint/checkpoint.h"
#include "loom/core/range_set.h"
#include "loom/core/trace.h"
#include "loom/train/parallelize.h"

namespace loom {

class TrainingState {
 public:
  // `dir`: the run's checkpoints folder. `config_text`: the resolved config written with each.
  TrainingState(Backend& backend, const LoomConfig& config, const ParallelLayout& layout, TrainingModel& parts,
                const std::string& dir, std::string config_text);

  // Every rank calls it; rank 0 writes. Returns the checkpoint's path (a note on other ranks).
  // async (train.async_checkpoint): rank 0 copies the state into a host snapshot and a
  // background thread writes it while training goes on; a save still in flight is waited for
  // first, so at most one is, and each is complete and durable before the next begins. A
  // sharded (ZeRO) checkpoint, whose ranks write together, is always written in the step.
  std::string save(const nlohmann::json& data_state, bool async = false);
  // Waits for the save in flight, if any: rethrows its error; returns its path ("" if none).
  std::string wait_for_save();
  // Whether a save pages the model's QLoRA base in one matrix at a time (ModelState::pages), so
  // the caller need not materialize it (and a save is synchronous).
  bool pages_base() const { return static_cast<bool>(model_state_.pages); }
  ~TrainingState();
  // train.trace: an async save's write is an event on the writer's thread (tid 1). Not owned.
  void set_tracer(Tracer* tracer) { tracer_ = tracer; }
  // The newest valid checkpoint (or the step folder `path`) into every rank's state (corrupt
  // ones reported through warn); nullopt when there is none. The caller restores its data
  // loader from the result (a rollback does not: the batches since are skipped).
  std::optional<LoadedCheckpoint> resume(const CheckpointWarning& warn, const std::string& path = "");
  // Makes the whole model's parameters present on this rank (after training, to sample) and
  // returns the model that holds them.
  Transformer& gather_for_sampling();

 private:
  void owners_whole_params();
  void owners_state_whole(const Tensor& owned, const Tensor& full);
  void owners_state_owned(const Tensor& full, const Tensor& owned);
  void tp_whole(const Tensor& local, const Tensor& whole);
  void tp_local(const Tensor& whole, const Tensor& local);
  void tp_state_whole(const Tensor& local, const Tensor& whole);
  void tp_state_local(const Tensor& whole, const Tensor& local);
  CheckpointContents contents();
  std::string save_sharded(const nlohmann::json& data_state);

  Backend& backend_;
  const LoomConfig& config_;
  const ParallelLayout& layout_;
  TrainingModel& parts_;
  std::string config_text_;
  CheckpointManager checkpoints_;
  ZeroSharding* zero_ = nullptr;
  bool partial_ = false;  // pipeline or expert parallel: ranks update parts of the flat buffers
  bool staged_ = false;   // the state is put together whole before a save (else ZeRO writes shards)
  RangeSet counted_;      // the flat elements this rank contributes to the owners group's sum
  ModelState model_state_;
  OptimizerState optimizer_state_;
  std::vector<std::pair<std::string, Tensor>> flat_state_;  // the optimizer's own tensors (ZeRO: shards)
  Tensor fp8_;  // FP8 delayed scaling's amax histories (resume bitwise)
  std::vector<std::pair<Tensor, Tensor>> zero_state_;  // ZeRO under tp / pp: (this rank's shard, its domain)
  std::vector<std::pair<Tensor, Tensor>> pp_state_;    // pipeline / experts: (this rank's domain's state, flat)
  std::vector<std::pair<Tensor, Tensor>> tp_state_;    // tensor parallel: (this slice's state, whole)
  nlohmann::json data_state_;
  CpuAllocator snapshot_host_;  // async saves: the host snapshot (declared before what it holds)
  std::vector<Tensor> snapshot_;  // the model's parameters, then each optimizer tensor
  std::future<std::string> in_flight_;
  Tracer* tracer_ = nullptr;
};

}  // namespace loom
