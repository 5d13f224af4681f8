// Mixture of experts in place of a block's MLP (docs/moe.md; Shazeer et al. 2017, GShard,
// Switch Transformer, DeepSeekMoE / DeepSeek-V3). For the N tokens x (N, C) of a micro-batch
// (the block's second norm output; sequences of seq_len consecutive rows):
//   u = x Wr^T (N, E);  s = softmax(u) or sigmoid(u);  selection scores s + b (b: the routing
//   bias, used to select only, never in a gate weight);
//   group-limited routing (moe_groups > 1): a group scores the sum of its two best selection
//   scores, tokens choose among the moe_topk_groups best groups' experts;
//   top-k by selection score (ties to the lower index), best first;
//   gates g_j = s_{i_j} (/ sum of the k selected s when moe_renorm) x moe_route_scale;
//   capacity (moe_capacity_factor > 0): each expert takes at most ceil(k N / E x factor)
//   assignments in priority order (every token's first choice, in token order, before any
//   second choice: GShard); the rest are dropped (their token's residual passes through);
//   y = sum over kept j of g_j E_{i_j}(x) + shared(x), E(x) = W2 act(W1 x) (GELU or SwiGLU by
//   arch, no biases), the shared experts one MLP of moe_shared x moe_d_ff.
// Losses, each added to the objective and reported (q = s / sum_e s, the normalised scores):
//   Switch/GShard: alpha E sum_i f_i P_i, f_i = (assignments to i) / (k N), P_i = mean_t q_ti
//                  (= alpha at a uniform split);
//   DeepSeek-V3 sequence-wise: per sequence alpha' sum_i f_i P_i with f_i = E/(k T) x (its
//                  tokens choosing i), P_i = mean over its tokens of q_ti; averaged over sequences;
//   z-loss: c_z mean_t (logsumexp_e u_te)^2.
// Auxiliary-loss-free balancing (DeepSeek-V3): after each step b_i -= gamma sign(load_i - mean
// load), load counted over the step's micro-batches and data-parallel ranks (moe_update_bias).
// Assignments are counted before capacity: load, f_i and the max violation all use them.
//
// Expert parallelism (GShard; `ep` communicator of P ranks): rank r computes experts
// [r E/P, (r+1) E/P) for the tokens of every rank of its group. Each rank routes its own tokens,
// sends each expert's rows to the expert's rank with one all-to-all-v of exactly the kept rows
// (no padding to capacity), the owners run their experts and send the outputs back with a
// second all-to-all-v; backward sends the rows' output gradients and returns their input
// gradients the same way. The router, the shared experts and the losses stay local.
#pragma once
#include <cstdint>
#include <vector>

#include "loom/core/range_set.h"
#include "loom/backend/backend.h"
#include "loom/comm/communicator.h"
#include "loom/arch/config.h"
#include "loom/arch/param_layout.h"

namespace loom {

// One MoE block's parameters (or gradients) as views into a flat buffer.
struct MoeParams {
  Tensor router_w;               // (E, C)
  Tensor router_b;               // (E): model.moe_router_bias, added to the logits (trained)
  Tensor bias;                   // (E) routing bias (ROLE_BUFFER: not trained)
  std::vector<Tensor> fc_w;      // [e] (F or 2F, C)
  std::vector<Tensor> fc2_w;     // [e] (C, F)
  std::vector<Tensor> fc_b, fc2_b;  // [e] (F or 2F), (C): model.moe_expert_bias; empty without
  Tensor shared_fc_w, shared_fc2_w;  // (S or 2S, C), (C, S); undefined without shared experts
  Tensor shared_gate_w;              // (1, C): model.moe_shared_gate
  bool defined() const { return router_w.defined(); }
};

MoeParams moe_params_view(const ModelConfig& config, const ParamLayout& layout, const Tensor& flat, int64_t layer);

// Capacity per expert for `tokens` tokens (capacity mode), and the most expert rows a
// micro-batch can hold: k N dropless, min(k N, E x capacity) with capacity.
int64_t moe_capacity(const ModelConfig& config, int64_t tokens);
int64_t moe_max_rows(const ModelConfig& config, int64_t tokens);

// What one micro-batch keeps for the backward, and its routing statistics.
struct MoeSaved {
  Tensor logits, scores;      // (N, E) router logits u and scores s
  Tensor expert, gates, row;  // (N, k): selected experts (i32, best first), gates, row in the expert buffers (i32, -1: dropped)
  Tensor token;               // (R) i32: the token of each expert row (rows grouped by expert)
  Tensor counts;              // (3E + 1) i32: Backend::moe_assign's [load | kept | offsets]
  Tensor h, act, ye;          // (R, F or 2F), (R, F), (R, C): each row's expert pre-activation, activation, output
                              // (expert parallel: h, act over the P R rows this rank's experts received)
  Tensor xp;                  // expert parallel: (P R, C) the received rows, by local expert then source rank
  std::vector<int64_t> recv_rows;  // expert parallel: [source x E/P + local expert] rows received
  Tensor shared_fc, shared_act;  // (N, S or 2S), (N, S)
  Tensor shared_gate;            // model.moe_shared_gate: (N, 2C) [x . w broadcast over C | the shared experts' output]
  std::vector<int64_t> offsets;  // (E + 1): expert e's rows are [offsets[e], offsets[e + 1])
  std::vector<int64_t> load;     // (E): assignments per expert (before capacity)
  int64_t tokens = 0, dropped = 0;
  int64_t dispatched = 0;     // expert parallel: rows sent to other ranks' experts (each way, forward and backward)
  double aux = 0, seq_aux = 0, z = 0;  // the losses' values (already weighted by their coefficients)
  double entropy = 0;                  // mean over tokens of the router's entropy (nats, of q)
};

// Shared scratch of every MoE block's forward and backward (sized for `tokens`).
struct MoeScratch {
  Tensor xe, dye, dh, dact;   // (R, C), (R, C), (R, F or 2F), (R, F) (dh, dact: P R rows expert parallel)
  Tensor recv, yp;            // expert parallel: (P R, C) rows by source rank, and by local expert
  Tensor counts_out, counts_in;  // expert parallel: (E) i32 rows per expert sent, received
  Tensor ds;                  // (N, E)
  Tensor dx;                  // (N, C)
  Tensor shared_dfc, shared_dact;  // (N, S or 2S), (N, S)
  Tensor route;               // f32 (threads (E + 2 G)): Backend::moe_route's scratch
  Tensor stats;               // f64 (4): Backend::moe_balance_stats' losses
  Tensor sums;                // f64 ((1 + N + threads) E): the balance statistics' and the router backward's scratch
  // Host scratch, sized on first use and kept, so that a step after the first allocates nothing.
  std::vector<int32_t> counts_host;              // (3E + 1): counts read back; expert parallel: (E) rows per expert
  std::vector<float> bias_host;                  // (E): moe_update_bias' copy of the routing bias
  std::vector<int64_t> sent, got, eoff, cursor;  // expert parallel: elements per rank, the local experts' offsets
};

// ep: the expert-parallel group's size (the received rows are sized for the worst case, every
// rank's rows to this rank's experts).
MoeSaved allocate_moe_saved(Allocator& allocator, const ModelConfig& config, int64_t tokens, int ep = 1);
// The bytes allocate_moe_saved allocates (the same list of fields), without allocating.
int64_t moe_saved_bytes(const ModelConfig& config, int64_t tokens, int ep = 1);
MoeScratch allocate_moe_scratch(Allocator& allocator, const ModelConfig& config, int64_t tokens, int ep = 1);

// y (N, C) += MoE(x); fills `saved`. seq_len: the rows of one sequence (for the sequence-wise loss).
void moe_forward(Backend& backend, const ModelConfig& config, const MoeParams& p, const Tensor& x, MoeSaved& saved,
                 MoeScratch& scratch, const Tensor& y, int64_t seq_len, Communicator* ep = nullptr);
// dy (N, C): the gradient of y. Writes dx (N, C) (overwritten), accumulates the parameter
// gradients into g (the routing bias gets none), and adds loss_weight x the auxiliary losses'
// gradients (the weight the cross-entropy's gradient carries).
void moe_backward(Backend& backend, const ModelConfig& config, const MoeParams& p, const MoeParams& g, const Tensor& x,
                  const MoeSaved& saved, MoeScratch& scratch, const Tensor& dy, const Tensor& dx, float loss_weight,
                  int64_t seq_len, Communicator* ep = nullptr);

// Expert parallel: the flat ranges (merged, ascending) of the experts ep rank `ep_rank` computes
// (own) or of those the other ranks compute (!own).
RangeSet moe_expert_ranges(const ModelConfig& config, const ParamLayout& layout, int ep_rank, int ep_size, bool own);

// Auxiliary-loss-free balancing: bias_i -= gamma sign(load_i - mean load), through host (E floats,
// read into and written back from `host`, grown on first use).
void moe_update_bias(Backend& backend, const Tensor& bias, const std::vector<double>& load, float gamma,
                     std::vector<float>& host);

// max_i load_i / mean load - 1 (0 when balanced; the MaxVio of Wang et al. 2024).
double moe_max_violation(const std::vector<double>& load);

}  // namespace loom
