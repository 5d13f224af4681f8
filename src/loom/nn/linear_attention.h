// Gated DeltaNet, the linear-attention token mixer of Qwen3-Next's linear layers (Yang, Kautz &
// Hatamizadeh 2024, "Gated Delta Networks"; transformers' Qwen3NextGatedDeltaNet), as one
// sub-layer with the residual: out = x + mixer(rmsnorm(x)), mixer(h) =
//   [q | k | v | z] = h W_qkvz^T,  [b | a] = h W_ba^T        (rows permuted from the folder's
//                                                            key-head groups on import)
//   [q | k | v] = silu(causal depthwise conv_K([q | k | v]))  (Backend::causal_conv1d_silu_*)
//   q = l2norm(q) / sqrt(d_k), k = l2norm(k)                 (per key head; l2norm(x) =
//                                                            x rsqrt(sum x^2 + 1e-6), as
//                                                            head_rmsnorm with weight 1/sqrt(d))
//   beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)  (Backend::delta_gates_*)
//   o = gated delta rule(q, k, v, g, beta)                   (Backend::delta_rule_*, key head h / r
//                                                            for value head h, r = H_v / H_k)
//   y = rmsnorm_dv(o) * w_norm * silu(z)  per value head     (head_rmsnorm + glu on [z | o] rows)
//   mixer(h) = y W_out^T
// Every step is a Backend op; the backward runs them in reverse. The recurrent state (per
// sequence: the conv's last K-1 inputs and the delta rule's H_v d_k d_v state) is what a decoder
// or a context-parallel rank carries from one span to the next (`LinearAttentionState`).
#pragma once
#include <cstdint>

#include "loom/arch/config.h"
#include "loom/backend/backend.h"
#include "loom/nn/layer.h"

namespace loom {

// The mixer's widths: H_k key heads of d_k, H_v value heads of d_v, a conv of K taps.
struct GatedDeltaNetShape {
  int64_t key_heads = 1, value_heads = 1, key_dim = 1, value_dim = 1, conv_taps = 4;
  int64_t qk_width() const { return key_heads * key_dim; }             // D_q = D_k
  int64_t v_width() const { return value_heads * value_dim; }          // D_v (= D_z)
  int64_t conv_width() const { return 2 * qk_width() + v_width(); }    // [q | k | v]
  int64_t qkvz_width() const { return conv_width() + v_width(); }      // [q | k | v | z]
};

struct GatedDeltaNetParams {
  Tensor norm_w;          // (C): the block's input norm
  Tensor qkvz_w;          // (2 D_q + 2 D_v, C): rows [q | k | v | z]
  Tensor ba_w;            // (2 H_v, C): rows [b | a]
  Tensor conv_w;          // (2 D_q + D_v, K)
  Tensor a_log, dt_bias;  // (H_v) each
  Tensor gate_norm_w;     // (d_v): the gated RMSNorm's weight
  Tensor out_w;           // (C, D_v)
};

// What the forward keeps for the backward (N = B T rows).
struct GatedDeltaNetSaved {
  NormSaved norm;            // out (B,T,C), rstd (B,T)
  Tensor qkvz, ba;           // (N, 2 D_q + 2 D_v), (N, 2 H_v)
  Tensor mixed;              // (B,T,2 D_q + D_v): the conv's input
  Tensor q, k, v;            // (B,T,H_k,d_k) twice, (B,T,H_v,d_v): after the conv (q, k normed)
  Tensor q_in, q_rstd, k_in, k_rstd;  // the l2 norms' inputs and statistics
  Tensor g, beta;            // (B,T,H_v)
  Tensor gated;              // (N H_v, 2 d_v): [z | rmsnorm(o) w] per value head
  Tensor gate_in, gate_rstd;  // the gated norm's input (o) and statistics
  Tensor act;                // (N, D_v): y, the output projection's input
  // Context parallel only: the state entering each of this rank's two chunks, per sequence
  // (2, B, K-1, 2 D_q + D_v) and (2, B, H_v, d_k, d_v), for the backward.
  Tensor span_conv, span_delta;
};

// The state carried between spans of a sequence: the conv's last K-1 inputs (B, K-1, 2 D_q + D_v)
// and the delta rule's (B, H_v, d_k, d_v). Undefined tensors: zeros (a sequence's start).
struct LinearAttentionState {
  Tensor conv, delta;
};

// The shape of model.linear_* (ModelConfig).
GatedDeltaNetShape gated_delta_net_shape(const ModelConfig& config);

// Each field of the record for (batch, seq_len) rows, in allocation order (the block's record
// and memory/estimate.h walk the same list).
// context_parallel: also the spans' entering states.
void gated_delta_net_saved_fields(const GatedDeltaNetShape& shape, int64_t batch, int64_t seq_len, int64_t d_model,
                                  GatedDeltaNetSaved& s, const SavedFieldFn& field, DType dtype = DTYPE_F32,
                                  bool context_parallel = false);
GatedDeltaNetSaved allocate_gated_delta_net_saved(Allocator& allocator, const GatedDeltaNetShape& shape, int64_t batch,
                                                  int64_t seq_len, int64_t d_model, DType dtype = DTYPE_F32);

class GatedDeltaNet {
 public:
  GatedDeltaNet(const ModelConfig& config, const GatedDeltaNetShape& shape, GatedDeltaNetParams params,
                GatedDeltaNetParams grads);
  // out = x + mixer(x) (x, out (B,T,C)); `in` / `out_state`, when defined, the state before and
  // after the span.
  void forward(Backend& backend, const Tensor& x, GatedDeltaNetSaved& s, const Tensor& out,
               const LinearAttentionState& in = {}, const LinearAttentionState& out_state = {}) const;
  // d_residual (B,T,C) holds d(out) and becomes d(x); the parameters' gradients accumulate.
  // d_in, when defined, gets d(state before the span) from d_out_state (undefined: zeros).
  void backward(Backend& backend, const Tensor& x, const GatedDeltaNetSaved& s, const Tensor& d_residual,
                const LinearAttentionState& in = {}, const LinearAttentionState& d_out_state = {},
                const LinearAttentionState& d_in = {}) const;
  // Decoding: x, out (n, 1, C), row r a position of its sequence, whose state is cache.linear_state
  // (layer, r) (host floats, updated in place). Consecutive rows of one sequence (a prompt's chunk)
  // run as one span; one row per sequence runs as one batch.
  void forward_rows(Backend& backend, const Tensor& x, const Tensor& out, DecodeCache& cache, int64_t layer) const;
  // Tensor parallel (parallel/tensor_parallel.h): this is one rank's slice of the heads; the
  // output projection's partial sums are all-reduced over `tp` in forward, d(normed input) in
  // backward. nullptr: the whole mixer.
  void set_tensor_parallel(Communicator* tp) { tp_ = tp; }
  // Context parallel (nn/context_parallel.h's zig-zag layout: rank r holds chunks r and 2N-1-r of
  // the sequence): forward and backward run the 2N chunks in sequence order, each on its owner,
  // the state (conv inputs and delta state, per sequence of the batch) sent to the next chunk's
  // owner, and in the backward d(state) back the other way. Exact, and serial: the ranks take
  // turns (a prefix scan of the chunks' state maps would overlap them; not done yet). nullptr:
  // the whole sequence on this rank.
  void set_context_parallel(ContextParallel* cp) { cp_ = cp; }
  ContextParallel* context_parallel() const { return cp_; }

 private:
  // The l2 norms' constant weights: 1 / d_k for q (its 1/sqrt(d_k) scale folded in), 1/sqrt(d_k) for k.
  Tensor l2_weight(Backend& backend, bool query) const;

  ModelConfig config_;
  GatedDeltaNetShape shape_;
  GatedDeltaNetParams params_, grads_;
  Communicator* tp_ = nullptr;
  ContextParallel* cp_ = nullptr;
  void forward_cp(Backend& backend, const Tensor& x, GatedDeltaNetSaved& s, const Tensor& out) const;
  void backward_cp(Backend& backend, const Tensor& x, const GatedDeltaNetSaved& s, const Tensor& d_residual) const;
};

}  // namespace loom
