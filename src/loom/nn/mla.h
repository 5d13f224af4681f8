// Multi-head Latent Attention (DeepSeek-AI 2024, "DeepSeek-V2: A Strong, Economical, and
// Efficient Mixture-of-Experts Language Model", §2.1), forward and backward in fp32.
// Dims: B batch, T positions, N = B T rows, C d_model, H heads, d_c latent (model.mla_kv_rank),
// d_r decoupled RoPE width (mla_rope_dim), d_n a head's non-RoPE query/key width (mla_nope_dim),
// d_v a head's value width (mla_v_dim), d_q query latent (mla_q_rank; 0: none), qk = d_n + d_r.
// With x the block's normed input (N, C):
//   q   = W_q x, or W_qb RMSNorm(W_qa x) when d_q > 0           (N, H qk), per head [q_n | q_r]
//   c   = W_dkv x,  c' = RMSNorm(c)                              (N, d_c)
//   k_r = RoPE(W_kr x)                                          (N, d_r), one key shared by the heads
//   [k_n | v]_h = W_kvb c'                                      (N, H (d_n + d_v))
//   q_r = RoPE(q_r) (per head, at the row's position)
//   s_h(i, j) = (q_n,h(i) . k_n,h(j) + q_r,h(i) . k_r(j)) / sqrt(d_n + d_r), causal (and the
//   sliding window model.attn_window), p = softmax_j(s), o_h(i) = sum_j p(i, j) v_h(j)
//   attn = [o_1 .. o_H]                                          (N, H d_v); the block's o_proj follows.
// W_dkv and W_kr are the rows [0, d_c) and [d_c, d_c + d_r) of kv_a_proj_with_mqa. RoPE is the
// rotate-half convention of the other Llama heads over width d_r (pairs (j, j + d_r / 2)).
// Decoding keeps only [c' | k_r] per position (d_c + d_r floats per layer) and attends with
// W_uk absorbed into the query (DeepSeek-V2 §2.1.2): per head, q~ = W_uk,h^T q_n (d_c),
// s(j) = (q~ . c'(j) + q_r . k_r(j)) / sqrt(qk), o_h = W_uv,h (sum_j p(j) c'(j)).
// Parameter gradients accumulate (+=); activation gradients are overwritten. The element loops
// (the RoPE slices, the attention and its backward, the latent decoding) are Backend ops
// (mla_rope, mla_attention_forward / _backward, mla_attend_latents); this file orders them.
#pragma once
#include <cstdint>

#include "loom/backend/backend.h"
#include "loom/arch/config.h"

namespace loom {

// One block's MLA weights (or their gradients), views into the flat buffers.
struct MlaParams {
  Tensor q_w;       // (H qk, C) when d_q = 0
  Tensor q_a_w;     // (d_q, C) when d_q > 0
  Tensor q_a_norm;  // (d_q)
  Tensor q_b_w;     // (H qk, d_q)
  Tensor kv_a_w;    // (d_c + d_r, C): W_dkv rows, then W_kr rows
  Tensor kv_norm;   // (d_c)
  Tensor kv_b_w;    // (H (d_n + d_v), d_c): per head W_uk (d_n rows), then W_uv (d_v rows)
  bool defined() const { return kv_a_w.defined(); }
};

// The activations an MLA forward writes and its backward reads (views of the attention sub-layer's
// AttentionSaved, nn/attention.h).
struct MlaActivations {
  Tensor qa, qa_norm, qa_rstd;  // (B,T,d_q), (B,T,d_q), (B,T): d_q > 0 only
  Tensor q;                     // (B,T,H qk) after RoPE
  Tensor c, c_norm, c_rstd;     // (B,T,d_c) latent, normed latent, (B,T)
  Tensor kr;                    // (B,T,d_r) after RoPE
  Tensor kv;                    // (B,T,H (d_n + d_v)) = [k_n | v] per head
  Tensor probs;                 // (B,H,T,T) attention probabilities (0 where masked)
  Tensor attn;                  // (B,T,H d_v)
};

// Floats of the workspace mla_backward needs for (B, T).
int64_t mla_scratch_floats(const ModelConfig& config, int64_t batch, int64_t seq_len);

// The projections: q (roped), c, c_norm, kr (roped), kv from x (B,T,C). Row (b, t) sits at
// position positions[b] when given (decoding rows, T = 1), else at t.
void mla_project(Backend& backend, const ModelConfig& config, const MlaParams& p, const Tensor& x,
                 const MlaActivations& a, const int64_t* positions = nullptr);
// The whole forward: the projections, then attention into a.probs and a.attn.
void mla_forward(Backend& backend, const ModelConfig& config, const MlaParams& p, const Tensor& x,
                 const MlaActivations& a);
// d_attn (B,T,H d_v) -> dx (B,T,C) (overwritten); g's gradients accumulate. scratch: a flat
// f32 tensor of at least mla_scratch_floats(B, T).
void mla_backward(Backend& backend, const ModelConfig& config, const MlaParams& p, const MlaParams& g,
                  const Tensor& x, const MlaActivations& a, const Tensor& d_attn, const Tensor& dx,
                  const Tensor& scratch);

// Decoding from the cache: out (H d_v) = one position's attention, q (H qk, roped) over the
// cached latents (count, d_c + d_r) = [c' | k_r], all visible (W_uk absorbed into the query).
void mla_attend_latents(Backend& backend, const ModelConfig& config, const MlaParams& p, const Tensor& q,
                        const Tensor& latents, const Tensor& out);

}  // namespace loom
