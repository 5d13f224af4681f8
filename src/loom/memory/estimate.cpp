#include "loom/memory/estimate.h"

#include <algorithm>

#include "loom/core/error.h"
#include "loom/memory/recompute.h"
#include "loom/model/param_layout.h"
#include "loom/nn/moe.h"
#include "loom/parallel/tensor_parallel.h"

namespace loom {

std::array<double, 4> zero_model_state_bytes(double P, int N, double w, double g, double K) {
  const double n = static_cast<double>(N);
  return {(w + g + K) * P, (w + g) * P + K * P / n, w * P + (g + K) * P / n, (w + g + K) * P / n};
}

namespace {
bool param_bf16(const PrecisionConfig& p) { return resolve_policy(p).param_bf16; }

// The optimizer state bytes of the whole model (its exact per-parameter formula).
int64_t optimizer_bytes(const MemoryPlan& plan, const ParamLayout& layout) {
  const OptimConfig resolved = plan.optim.resolved();
  return optimizer_state_bytes(optim_params(layout, resolved), resolved);
}

// An MoE block's routing and expert buffers (allocate_moe_saved) for N tokens.
int64_t moe_saved_bytes(const ModelConfig& c, int64_t N) {
  const int64_t E = c.moe_experts, K = c.moe_top_k, R = moe_max_rows(c, N), C = c.d_model;
  int64_t floats = 2 * N * E + 3 * N * K + R + R * (c.expert_in_width() + c.expert_ff() + C);
  if (c.moe_shared > 0) {
    const int64_t S = c.moe_shared * c.expert_ff();
    floats += N * ((c.swiglu() ? 2 : 1) * S + S);
  }
  return 4 * floats;
}
}  // namespace

std::array<double, 3> zero_bytes_per_param(const MemoryPlan& plan) {
  const ParamLayout layout = build_param_layout(plan.model);
  const bool w16 = param_bf16(plan.precision);
  const double K = static_cast<double>(optimizer_bytes(plan, layout)) / static_cast<double>(layout.total) +
                   (w16 && plan.precision.master != "bf16" ? 4.0 : 0.0);
  return {w16 ? 2.0 : 4.0, plan.precision.reduce == "bf16" ? 2.0 : 4.0, K};
}

int64_t MemoryEstimate::total() const {
  int64_t t = 0;
  for (int64_t b : bytes) t += b;
  return t;
}

int64_t activation_store_bytes(const MemoryPlan& plan) {
  const ModelConfig& c = plan.model;
  const int64_t B = plan.batch, T = plan.seq_len, BT = B * T, C = c.d_model;
  // The model's ends: tokens and targets (i32), the last block's output, the final norm (and its
  // statistics), the logits, the per-position losses and log-sum-exps.
  int64_t bytes = 4 * (2 * BT + 2 * BT * C + (c.rmsnorm() ? 1 : 2) * BT + BT * c.vocab_size + 2 * BT);
  if (plan.recompute == "budget") {
    return bytes + static_cast<int64_t>(plan.recompute_budget_mb * (1 << 20));
  }
  const std::vector<RecomputePolicy> policies = recompute_plan(plan.recompute, c.n_layer);
  bool shared = false;
  for (int64_t l = 0; l < c.n_layer; ++l) {
    if (c.moe_layer(l)) {  // an MoE block keeps everything but the dense MLP's fc and act
      bytes += block_kept_bytes(c, B, T, RECOMPUTE_NONE) - 4 * BT * (c.mlp_in_width() + c.d_ff) + moe_saved_bytes(c, BT);
      continue;
    }
    bytes += block_kept_bytes(c, B, T, policies[l]);
    shared |= policies[l] != RECOMPUTE_NONE;
  }
  if (shared) bytes += block_kept_bytes(c, B, T, RECOMPUTE_NONE) + 4 * BT * std::max(C, c.n_head * c.head_dim());
  return bytes;
}

MemoryEstimate estimate_memory(const MemoryPlan& whole) {
  LOOM_CHECK(whole.tp >= 1, "parallel.tp must be >= 1, got ", whole.tp);
  if (whole.tp > 1) {  // the rank's slice
    MemoryPlan slice = whole;
    slice.model = tp_local_config(whole.model, whole.tp);
    slice.tp = 1;
    return estimate_memory(slice);
  }
  const MemoryPlan& plan = whole;
  LOOM_CHECK(plan.ranks >= 1, "loom memory: --ranks must be >= 1, got ", plan.ranks);
  LOOM_CHECK(plan.zero_stage >= 0 && plan.zero_stage <= 3, "parallel.zero_stage must be 0, 1, 2 or 3, got ",
             plan.zero_stage);
  const ParamLayout layout = build_param_layout(plan.model);
  const int64_t P = layout.total, N = plan.ranks;
  const int64_t shard = N > 1 && plan.zero_stage > 0 ? (P + N - 1) / N : P;  // rank 0's (the largest) shard
  MemoryEstimate e;
  e.parameters = P;
  const bool sharded_params = plan.zero_stage == 3 && N > 1, sharded_grads = plan.zero_stage >= 2 && N > 1;
  e.bytes[MEM_PARAMETERS] = 4 * (sharded_params ? shard : P) + (param_bf16(plan.precision) ? 2 * P : 0);
  e.bytes[MEM_GRADIENTS] = 4 * (sharded_grads ? shard : P);
  const int64_t state = optimizer_bytes(plan, layout);
  e.bytes[plan.optim.offload ? MEM_OFFLOADED : MEM_OPTIMIZER_STATE] =
      N > 1 && plan.zero_stage > 0 ? state / P * shard + (state % P) * shard / P : state;
  e.bytes[MEM_ACTIVATIONS] = activation_store_bytes(plan);
  return e;
}

}  // namespace loom
