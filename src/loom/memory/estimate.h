// The memory bill of training, before anything runs (REFERENCE.md §6-7, §10).
//
// Two accountings:
// 1. The ZeRO paper's model states (Rajbhandari et al. 2020): w + g + K bytes per parameter
//    (mixed-precision Adam: 2 + 2 + 12), per rank over N data-parallel ranks:
//      stage 0: (w + g + K) P;  1: (w + g) P + K P / N;  2: w P + (g + K) P / N;  3: (w + g + K) P / N.
//    With P = 7.5e9 and N = 64: 120 / 31.4 / 16.6 / 1.9 GB.
// 2. What a Loom rank holds, by memory category, for a model, precision, optimizer, activation
//    checkpointing plan and data-parallel layout: fp32 flat parameters (+ their bf16 copy with
//    precision.param = bf16) and gradients, the optimizer's state (its exact formula, sharded by
//    ZeRO), and one micro-batch's activation store (each block's kept fields, the shared
//    recompute record, the model's ends, MoE routing and expert buffers). ZeRO-2/3 count the
//    resident shard of the gradients (and parameters), as the OS sees them. Tensor parallelism
//    (without sequence parallelism) is the same bill for the rank's slice of the model
//    (tp_local_config: heads, MLP width and vocabulary divided, norms whole). Other model-parallel
//    layouts (sp, pp, cp, ep) are not estimated yet (refused naming the key).
#pragma once
#include <array>
#include <cstdint>
#include <string>

#include "loom/core/memory.h"
#include "loom/model/config.h"
#include "loom/optim/optimizer.h"
#include "loom/precision/policy.h"

namespace loom {

// Bytes per rank of stages 0..3 (accounting 1).
std::array<double, 4> zero_model_state_bytes(double params, int ranks, double weight_bytes, double grad_bytes,
                                             double optimizer_bytes);

// What the estimate needs of a run's configuration (loom memory fills it from the config).
struct MemoryPlan {
  ModelConfig model;
  int64_t batch = 1, seq_len = 1;   // one micro-batch
  std::string recompute = "none";   // train.recompute
  double recompute_budget_mb = 0;
  OptimConfig optim;
  PrecisionConfig precision;
  int zero_stage = 0;
  int ranks = 1;                    // data-parallel ranks
  int tp = 1;                       // tensor-parallel ranks (not sequence parallel): each holds its slice
};

// w, g and K of accounting 1 for a run's precision and optimizer: w = 2 with precision.param =
// bf16 (else 4), g = 2 with precision.reduce = bf16 (else 4), K = the optimizer's state bytes per
// parameter + 4 for an fp32 master copy when the weights are 16-bit.
std::array<double, 3> zero_bytes_per_param(const MemoryPlan& plan);

struct MemoryEstimate {
  std::array<int64_t, MEM_CATEGORY_COUNT> bytes{};  // per rank (rank 0: the largest ZeRO shard)
  int64_t parameters = 0;                           // the model's parameter count
  int64_t total() const;
};

// Accounting 2.
MemoryEstimate estimate_memory(const MemoryPlan& plan);

// One micro-batch's activation store (bytes of MEM_ACTIVATIONS), as Transformer::allocate_store
// allocates it under the plan train.recompute names ("budget": at most the budget, estimated as
// the budget itself plus the model's ends).
int64_t activation_store_bytes(const MemoryPlan& plan);

}  // namespace loom
