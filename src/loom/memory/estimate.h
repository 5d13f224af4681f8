// The memory bill of training, before anything runs (docs/memory.md, docs/activation_memory.md).
//
// Two accountings:
// 1. The ZeRO paper's model states (Rajbhandari et al. 2020): w + g + K bytes per parameter
//    (mixed-precision Adam: 2 + 2 + 12), per rank over N data-parallel ranks:
//      stage 0: (w + g + K) P;  1: (w + g) P + K P / N;  2: w P + (g + K) P / N;  3: (w + g + K) P / N.
//    With P = 7.5e9 and N = 64: 120 / 31.4 / 16.6 / 1.9 GB.
// 2. What a Loom rank holds, by memory category, for a model, precision, optimizer, activation
//    checkpointing plan and parallel layout (dp x tp x pp x cp x ep, ZeRO over dp x cp):
//    - parameters: fp32 (+ their bf16 copy with precision.param = bf16) of the elements the rank
//      computes: its tensor-parallel slice (tp_local_config: heads, MLP width and vocabulary
//      divided, norms whole), of its pipeline stages' layers (pipeline_owned_ranges), less the
//      experts other expert-parallel ranks compute; ZeRO-3: the rank's shard of those;
//    - gradients: the same elements in fp32; ZeRO-2/3: the shard;
//    - optimizer state: its exact formula over the same elements (or the ZeRO shard);
//    - activations: the stores the rank keeps: one micro-batch's, or with pipeline parallelism
//      as many per model chunk as the schedule has micro-batches live on it (pipe_live_peak),
//      each block's fields as allocate_block_saved allocates them (block_saved_bytes: sequence
//      parallel shards the residual stream and norms over tp, context parallel keeps T / cp
//      positions and ring attention's log-sum-exp, Ulysses its gathered heads' probabilities,
//      FlashAttention the rows' log-sum-exp instead of the probabilities),
//      the recompute record, the model's ends on the first / last stage.
//    A real GPU rank holds this; Loom's CPU ranks also keep the whole model's flat buffers under
//    tp and pp (to stage checkpoints), untouched by the step: loom memory --measure runs data
//    parallel layouts only.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/core/memory.h"
#include "loom/arch/config.h"
#include "loom/optim/optimizer.h"
#include "loom/parallel/pipeline_schedule.h"
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
  int ranks = 1;                    // data-parallel ranks (ZeRO shards over ranks x cp)
  int tp = 1;                       // tensor-parallel ranks: each holds its slice
  bool sequence_parallel = false;   // with tp > 1
  int pp = 1;                       // pipeline stages (ranks)
  PipeScheduleKind schedule = PipeScheduleKind::one_f_one_b;  // with pp > 1: parallel.schedule
  int64_t micro = 1;                // micro-batches per step (train.grad_accum)
  int virtual_stages = 1;           // model chunks per pipeline rank
  int cp = 1;                       // context-parallel ranks
  bool ulysses = false;             // cp attention: ring (false) or Ulysses
  int ep = 1;                       // expert-parallel ranks
  // train.flash_attention: attention that keeps its rows' log-sum-exp (B, H, T) instead of the
  // probabilities (B, H, T, T) (FlashAttention, Dao et al. 2022; allocate_block_saved with
  // flash: with selective recomputation lse is kept too); false: the probabilities.
  bool flash_attention = false;
  bool offload_activations = false;  // train.offload_activations: checkpointed blocks' kept fields offloaded
  // The run may keep LoRA's frozen base in bf16 only (model/frozen_base.h keeps_bf16 decides the
  // rest): its objective allows it (ObjectiveLayout::compact_base) and the parameters are host memory.
  bool compact_base = true;
};

// w, g and K of accounting 1 for a run's precision and optimizer: w = 2 with precision.param =
// bf16 (else 4), g = 2 with precision.reduce = bf16 (else 4), K = the optimizer's state bytes per
// parameter + 4 for an fp32 master copy when the weights are 16-bit.
std::array<double, 3> zero_bytes_per_param(const MemoryPlan& plan);

// Model-state bytes of fine-tuning one model by each method (docs/finetune.md, `loom memory
// --methods`), for the LoRA settings in `model` (its peft.* keys; with peft.method = none, LoRA
// with the keys' values) and optimizer `optim`: fp32 weights, fp32 gradients of what trains and
// the optimizer's exact state over it.
//   full    every parameter trains:           weights 4P, gradients 4P, state K(P)
//   lora    the adapters (A parameters) train: weights 4P + 4A, gradients 4A, state K(A)
//   qlora   LoRA over a base whose block matrices are NF4 with double-quantized scales
//           (precision/nf4.h nf4_bytes per matrix, ~4.127 bits) and the rest (embeddings, head,
//           norms, biases) bf16: weights nf4 + 2 rest + 4A, gradients 4A, state K(A) -- the
//           paper's setting; Loom's QLoRA runs (peft.quantize_base) keep the rest fp32.
// adapter_file is what the method's checkpoint of the trained part holds (fp32).
struct FinetuneMemory {
  std::string method;
  int64_t trainable = 0;
  int64_t weights = 0, gradients = 0, optimizer = 0;
  int64_t adapter_file = 0;
  int64_t total() const { return weights + gradients + optimizer; }
};
std::vector<FinetuneMemory> finetune_memory(const ModelConfig& model, const OptimConfig& optim);

struct MemoryEstimate {
  std::array<int64_t, MEM_CATEGORY_COUNT> bytes{};  // per rank (ZeRO: rank 0, the largest shard)
  int64_t parameters = 0;                           // the model's parameter count (a tp slice's)
  int64_t rank_parameters = 0;                      // the elements this rank computes (before ZeRO)
  int pp_rank = 0;                                  // the pipeline rank estimated
  int64_t total() const;
};

// Accounting 2 for pipeline rank pp_rank, or (pp_rank < 0) the pipeline rank with the largest
// total.
MemoryEstimate estimate_memory(const MemoryPlan& plan, int pp_rank = -1);

// The activation stores (bytes of MEM_ACTIVATIONS) of pipeline rank pp_rank (0 without pp), as
// Transformer::allocate_store / PipelineRunner allocate them under the plan train.recompute
// names ("budget": at most the budget, estimated as the budget itself plus the model's ends).
int64_t activation_store_bytes(const MemoryPlan& plan, int pp_rank = 0);

}  // namespace loom
