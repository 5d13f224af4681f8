// Activation checkpointing (recomputation) per block (Chen et al. 2016, "Training Deep Nets with
// Sublinear Memory Cost"; Korthikanti et al. 2022, selective recomputation, arXiv 2205.05198).
// Each block keeps, between its forward and its backward:
//   none:      everything its backward reads (nn/block.h BlockSaved);
//   selective: the residual stream and the GEMM outputs (input, qkv, attn, mid, fc); the norms'
//              outputs and statistics, the attention probabilities and the MLP activation are
//              recomputed from them just before the block's backward (cheap element-wise work and
//              the attention core, no weight GEMM). With FlashAttention (train.flash_attention)
//              the attention's lse (B,H,T) is kept as well: it is small and the attention core
//              is then not recomputed (its backward needs only qkv, attn and lse);
//   full:      its input only; the whole block forward runs again before its backward.
// Recomputation writes into one shared full record (one layer's activations), so the peak is the
// kept bytes of every layer plus one layer's full record. It runs the same ops on the same
// inputs: gradients are bitwise those without recomputation (tests/test_recompute.cpp).
// Plans: "none", "full", "selective", "every:K" (full on every K-th block, the others none), and
// "budget": the per-layer choice that fits a byte budget with the least measured recompute time
// (a multiple-choice knapsack, exact by dynamic programming over bytes in 1/4096ths of the budget,
// each layer's bytes rounded up so that the plan never exceeds it).
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/arch/config.h"
#include "loom/nn/block.h"  // RecomputePolicy: which fields a block's saved record keeps

namespace loom {

std::string_view recompute_name(RecomputePolicy p);

// The activation bytes one block keeps for a micro-batch of (batch, seq_len) under each policy
// (no model parallelism), exactly what allocate_block_saved allocates for the run's choices:
// with FlashAttention (choices.flash, train.flash_attention) lse instead of the probabilities,
// the bf16-saved inputs of bf16 linear layers (choose_precision) in 2 bytes.
int64_t block_kept_bytes(const ModelConfig& config, int64_t batch, int64_t seq_len, RecomputePolicy policy,
                         const PlanChoices& choices = {});

// What a plan costs: per layer the kept bytes and the recompute seconds of each policy.
struct RecomputeCosts {
  std::vector<std::array<int64_t, RECOMPUTE_COUNT>> bytes;    // [layer][policy]
  std::vector<std::array<double, RECOMPUTE_COUNT>> seconds;   // [layer][policy] (none: 0)
  int64_t scratch_bytes = 0;  // the shared full record, needed when any layer recomputes
};

// A fixed plan from its name ("none", "full", "selective", "every:K"); throws naming train.recompute.
std::vector<RecomputePolicy> recompute_plan(const std::string& name, int64_t n_layer);

// The least-recompute-time plan whose kept bytes (+ the shared record when used) fit `budget`;
// throws when even full recomputation of every layer does not fit.
std::vector<RecomputePolicy> budget_recompute_plan(const RecomputeCosts& costs, int64_t budget);

// Kept bytes and recompute seconds of a plan.
int64_t plan_bytes(const RecomputeCosts& costs, const std::vector<RecomputePolicy>& plan);
double plan_seconds(const RecomputeCosts& costs, const std::vector<RecomputePolicy>& plan);

}  // namespace loom
