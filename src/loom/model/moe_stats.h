// A mixture-of-experts model's routing statistics over a step (Transformer::moe_end_step): each
// MoE block's counters (MlpLayer::MoeStats, accumulated by its forwards) summed over a group of
// ranks, turned into one MoeLayerStats per layer, and the auxiliary-loss-free bias update.
// In model/, not nn/moe: the counters are the MLP sub-layer's (nn/mlp.h, above nn/moe.h) and
// the gathering walks every block.
#pragma once
#include <cstdint>
#include <vector>

#include "loom/arch/config.h"
#include "loom/backend/backend.h"
#include "loom/comm/communicator.h"
#include "loom/nn/block.h"

namespace loom {

// One MoE layer's routing over a step (summed over the group moe_end_step was given).
struct MoeLayerStats {
  int64_t layer = 0;
  std::vector<double> load;   // [expert] token assignments (before capacity)
  int64_t tokens = 0, dropped = 0;
  int64_t dispatched = 0;     // expert parallel: rows sent to another rank's experts (one way)
  double max_violation = 0;   // max load / mean load - 1
  double entropy = 0;         // mean router entropy (nats)
  double aux = 0, seq_aux = 0, z = 0;  // the auxiliary losses, mean over micro-batches and ranks' sums
};

class MoeStepStats {
 public:
  // Once per step after the update: the blocks' counters summed over `group` (nullptr: this
  // process) into stats() (the layers that saw tokens), the routing bias update when
  // model.moe_bias_gamma > 0 (through bias_host, MoeScratch's), the counters reset.
  void end_step(Backend& backend, const ModelConfig& config, std::vector<Block>& blocks, Communicator* group,
                std::vector<float>& bias_host);
  const std::vector<MoeLayerStats>& stats() const { return stats_; }

 private:
  Tensor sums_;                     // (MoE layers x (E + 8)) f64: the group's reduction
  std::vector<double> sums_host_;   // its host copy
  std::vector<MoeLayerStats> stats_;
  std::vector<int64_t> layers_;     // the MoE blocks' layers (sums_' rows)
};

}  // namespace loom
