// The one owner of a run's parallel layout (torchtitan's ParallelDims, in Loom's terms).
//
// From the config and the world of ranks it decides, once and before anything is allocated:
//   - the mesh: axes pp x dp x ep x cp x tp (an enum, outermost first; tensor-parallel ranks
//     adjacent, pipeline stages farthest apart) and one communicator per axis;
//   - whether the combination of parallelisms, model features, precision, optimizer and device
//     runs at all: one compatibility table (layout.cpp, kRules), each row a refusal naming the
//     keys, or a note that a key has no effect;
//   - the groups the trainer reduces over (data parallel, and data x context parallel).
// The parallelisms are then applied to the model as passes in one written order
// (train/parallelize.h), and the state is gathered for checkpoints by train/state_gather.h.
#pragma once
#include <array>
#include <memory>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/comm/communicator.h"
#include "loom/comm/device_mesh.h"
#include "loom/train/config.h"

namespace loom {

// The mesh axes, outermost first. dp here is the data-parallel part outside expert parallelism:
// the data-parallel group is dp x ep (experts are split over ep of the data-parallel ranks).
enum class Axis { pp, dp, ep, cp, tp };
constexpr int kAxisCount = 5;
const char* axis_name(Axis axis);

// The facts the compatibility table reads: the resolved sizes and every feature a rule names.
struct LayoutFacts {
  int world = 1;  // 0: unknown (rules about the resolved data-parallel size are skipped)
  std::array<int, kAxisCount> size{1, 1, 1, 1, 1};
  int data_parallel = 1;  // dp x ep ranks (0 when the world is unknown)
  const LoomConfig* config = nullptr;
  BackendCapabilities backend;
  std::string backend_name;
  int of(Axis a) const { return size[static_cast<size_t>(a)]; }
};

// The facts of `config` on `world` ranks (0: not known yet, e.g. `loom memory`) on a backend.
LayoutFacts layout_facts(const LoomConfig& config, int world, const BackendCapabilities& backend,
                         const std::string& backend_name);

// Every row of the table: throws the first refusal (one line naming the keys and their values),
// returns the notes of keys that have no effect in this layout.
std::vector<std::string> check_layout(const LayoutFacts& facts);

// The mesh of a run and one communicator per axis of more than one rank.
class ParallelLayout {
 public:
  // Checks the table (throwing before anything is allocated) and splits `world` into the axes
  // (on a CUDA device, a communicator over it that routes device tensors to NCCL).
  ParallelLayout(const LoomConfig& config, Communicator& world, Backend& backend);

  int size(Axis axis) const { return facts_.of(axis); }
  // The axis' communicator; nullptr when the axis has one rank.
  Communicator* group(Axis axis) const { return groups_[static_cast<size_t>(axis)].get(); }
  Communicator& world() const { return world_; }
  const DeviceMesh& mesh() const { return mesh_; }
  const std::vector<std::string>& notes() const { return notes_; }

  // The ranks that split each batch (dp x ep): the loader's rank slice and tokens/s count them.
  Communicator& batch_group() const { return *batch_; }
  // The ranks gradients are averaged over: dp x ep, and cp (its ranks hold other positions).
  Communicator& reduce_group() const { return *reduce_; }
  // Pipeline and expert parallel ranks update their own parts of the flat buffers; this group
  // (pp x ep) puts the parts together for checkpoints and sampling. nullptr without either.
  Communicator* owners_group() const { return owners_.get(); }
  // Every communicator of the run, each once, with its name ("world", "tp", "dp", "dp+cp",
  // "owners", "device", ...): the byte ledgers a job's traffic is the sum of, and what a trace
  // is attached to.
  std::vector<std::pair<const char*, Communicator*>> communicators() const;

  // One line: the mesh and how the batch is split.
  std::string describe(int64_t batch_size, int64_t grad_accum, int64_t seq_len) const;

 private:
  Communicator& world_;
  LayoutFacts facts_;
  DeviceMesh mesh_;
  std::vector<std::string> notes_;
  std::array<std::unique_ptr<Communicator>, kAxisCount> groups_;
  std::unique_ptr<Communicator> dp_group_, reduce_group_, owners_, device_;
  Communicator* batch_ = nullptr;
  Communicator* reduce_ = nullptr;
};

}  // namespace loom
