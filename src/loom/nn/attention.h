// The attention sub-layer of a block: mid = x + proj(attention(rope(qkv(norm1(x))))), with the
// attention of its plan's kind (nn/plan.h), one function pair per kind: the queries, keys and
// values (after RoPE) in saved.qkv -> saved.attn, and back from d_attn to d_qkv. MLA projects
// its own q/k/v from the normed input (nn/mla.h).
#pragma once
#include <array>
#include <cstdint>
#include <vector>

#include "loom/arch/config.h"
#include "loom/backend/backend.h"
#include "loom/core/documents.h"
#include "loom/nn/context_parallel.h"
#include "loom/nn/layer.h"
#include "loom/nn/linear.h"
#include "loom/nn/lora.h"
#include "loom/nn/mla.h"
#include "loom/nn/plan.h"

namespace loom {

// The attention sub-layer's parameters (or gradients) as views into a flat buffer. Biases are
// undefined tensors for bias-free architectures; an MLA layer has mla's projections in place of qkv.
struct AttentionParams {
  Tensor norm_w, norm_b;  // (C): the input's norm (not with model.post_norm)
  Tensor post_norm_w;     // (C): the output's norm (model.post_norm, model.sandwich_norm; RMSNorm)
  Tensor qkv_w, qkv_b;    // ((H + 2 KV) hd, C), ((H + 2 KV) hd)
  Tensor q_norm, k_norm;  // (hd) each: model.qk_norm
  MlaParams mla;          // MLA: queries, latent, decoupled RoPE key and up-projections
  Tensor gate_w;          // (H hd, C): model.attn_output_gate's projection
  Tensor sinks;           // (H): model.attn_sinks' per-head logits
  Tensor proj_w, proj_b;  // (C, H hd), (C); MLA: (C, H d_v)
  LoraAdapters qkv_lora, proj_lora;  // model.lora(): the adapters of q/k/v and o (nn/lora.h)
};

// What the attention sub-layer keeps for its backward, for one micro-batch.
struct AttentionSaved {
  NormSaved norm;  // norm1 of the block input (the residual stream's positions); not with model.post_norm
  // The output's norm (ModelConfig::post_norms): its input, the output projection's output
  // (B,T,C), and its statistics (its output goes straight into the residual stream).
  Tensor post_in;
  NormSaved post;
  Tensor qkv;      // (B,T,(H+2KV)hd), after RoPE; not for MLA
  // model.qk_norm: the query and key heads before their norm, and the norms' rstd (one per row
  // with model.qk_norm_whole).
  Tensor q_in, q_rstd, k_in, k_rstd;  // (B,T,H hd), (B,T,H | 1), (B,T,KV hd), (B,T,KV | 1)
  // MLA (nn/mla.h) in place of qkv: the query latent and its norm (d_q > 0), the queries after
  // RoPE, the KV latent and its norm, the decoupled RoPE key, the per-head [k_n | v].
  Tensor mla_qa, mla_qa_norm, mla_qa_rstd;  // (B,T,d_q), (B,T,d_q), (B,T)
  Tensor mla_q;                             // (B,T,H (d_n + d_r))
  Tensor mla_c, mla_c_norm, mla_c_rstd;     // (B,T,d_c), (B,T,d_c), (B,T)
  Tensor mla_kr;                            // (B,T,d_r)
  Tensor mla_kv;                            // (B,T,H (d_n + d_v))
  Tensor probs;  // (B,H,T,T): mha and mla
  // The attention rows' log-sum-exp (B,H,T), kept instead of probs by flash and by ring
  // attention (T is then this rank's T/cp positions); Ulysses keeps its own record.
  Tensor lse;
  UlyssesSaved ulysses;
  Tensor attn;  // (B,T,H hd); MLA: (B,T,H d_v)
  // model.attn_output_gate: [gate | attn] per row (the gate projection's output beside the
  // attention's), and sigmoid(gate) * attn, o_proj's input.
  Tensor gate_attn;  // (B,T,2 H hd)
  Tensor gated;      // (B,T,H hd)
  // Only for a backward split into input and weight gradients (zero-bubble pipelines): the
  // output gradients of the two linear layers, kept from the input pass for the weight pass
  // (MLA: its projections' weight gradients are computed in the input pass, nothing kept).
  Tensor dy_proj, dy_qkv;  // (B,T,C), (B,T,(H+2KV)hd)
  // Packed documents (core/documents.h): the micro-batch's spans, each attended and rotated on
  // its own (the store's, set by the model for each pass); nullptr: every row one sequence.
  const DocumentSpans* docs = nullptr;
  LoraDropout lora_dropout;  // peft.dropout in a training pass (the model sets it); p = 0 otherwise
};

// Each field the attention sub-layer of `plan` allocates for `shape`, in allocation order
// (selective recompute: qkv, attn and flash's lse only; full recompute: none).
void attention_saved_fields(const ModelConfig& config, const LayerPlan& plan, const SavedShape& shape,
                            AttentionSaved& s, const SavedFieldFn& field);

// The kind dispatch of the attention itself: s.qkv -> s.attn (and s.probs or s.lse or
// s.ulysses); back from k.d_attn to k.d_qkv. cp: the context-parallel group (ring and ulysses).
void attention_forward(Backend& backend, const LayerPlan& plan, const ModelConfig& config, ContextParallel* cp,
                       AttentionSaved& s);
void attention_backward(Backend& backend, const LayerPlan& plan, const ModelConfig& config, ContextParallel* cp,
                        const AttentionSaved& s, BlockScratch& k);

class AttentionLayer {
 public:
  AttentionLayer() = default;
  AttentionLayer(const ModelConfig& config, AttentionParams params, AttentionParams grads)
      : config_(config), params_(std::move(params)), grads_(std::move(grads)) {}

  // The plan (the block resolves it), the layout's links, the precision recipes of qkv and proj
  // and the weights' bf16 copies (params16: empty without precision.param = bf16).
  void set_plan(const LayerPlan& plan) { plan_ = plan; }
  void set_links(const LayerLinks& links) { links_ = links; }
  void set_precision(const PrecisionPolicy& policy, AttentionParams params16);

  // x (B,Ts,C): the block input; writes mid = x + proj(attention(...)) and s.
  void forward(Backend& backend, const Tensor& x, AttentionSaved& s, const Tensor& mid);
  // One position of each of n sequences (decoding, T = 1) through `cache` (Block::forward_rows).
  void forward_rows(Backend& backend, const Tensor& x, AttentionSaved& s, const Tensor& mid,
                    const std::vector<int64_t>& positions, DecodeCache& cache, int64_t layer) const;
  // d_residual: gradient w.r.t. mid on entry, w.r.t. x on exit (BACKWARD_ALL / _INPUT);
  // BACKWARD_WEIGHT: only the projections' weight gradients from the kept output gradients.
  // r16 (nn/layer.h ResidualDy16): d(mid) in bf16 for proj, and where norm1's backward writes
  // d(x)'s rounding for the block before's fc2.
  void backward(Backend& backend, const Tensor& x, const AttentionSaved& s, const Tensor& d_residual,
                BlockScratch& k, BackwardPart part, const ResidualDy16& r16 = {});
  // Selective recompute (mha / flash, a whole layer): norm1 from x, and the probabilities from
  // the kept qkv (flash keeps lse: nothing to rerun); out_scratch takes the attention output.
  void recompute_selective(Backend& backend, const Tensor& x, AttentionSaved& s, const Tensor& out_scratch) const;

  // o_proj's input: the gated attention output with model.attn_output_gate, else the attention's.
  static const Tensor& proj_input(const AttentionSaved& s) { return s.gated.defined() ? s.gated : s.attn; }
  LinearLayer* qkv() { return &qkv_; }
  LinearLayer* proj() { return &proj_; }

 private:
  ModelConfig config_;
  AttentionParams params_, grads_, params16_;
  LayerPlan plan_;
  LayerLinks links_;
  LinearLayer qkv_, proj_;
  // A training pass's adapters of q/k/v (site 0) and o (site 1), with their dropout.
  LoraTerm qkv_lora(const AttentionSaved& s) const {
    return {&params_.qkv_lora, config_.lora_scale(), s.lora_dropout.at_site(0)};
  }
  LoraTerm proj_lora(const AttentionSaved& s) const {
    return {&params_.proj_lora, config_.lora_scale(), s.lora_dropout.at_site(1)};
  }
  void rope(Backend& backend, const Tensor& qkv, bool backward, const DocumentSpans* docs) const;
  // model.qk_norm on the query and key heads of qkv (in place), before RoPE; and its backward
  // on d_qkv after RoPE's.
  void qk_norm_forward(Backend& backend, const Tensor& qkv, const AttentionSaved& s) const;
  void qk_norm_backward(Backend& backend, const Tensor& d_qkv, const AttentionSaved& s) const;
  // model.attn_output_gate: s.gated = sigmoid(input W_gate^T) * s.attn; and its backward from
  // d(gated) (d_gated) into k.d_attn and the gate's share of d(input) added to d_input.
  void output_gate_forward(Backend& backend, const Tensor& input, const AttentionSaved& s) const;
  void output_gate_backward(Backend& backend, const Tensor& input, const AttentionSaved& s, const Tensor& d_gated,
                            const Tensor& d_attn, const Tensor& d_input) const;
  static MlaActivations mla_activations(const AttentionSaved& s);
  // MLA decoding (T = 1): the projections at each row's position, the row's [c' | k_r] stored
  // (cache.latent) and its attention over the visible latents (the window's) into s.attn.
  // forward_rows' attention of n rows through a host cache: the rows staged through the host.
  void host_rows_attend(Backend& backend, AttentionSaved& s, DecodeCache& cache, int64_t layer, int64_t n) const;
  void mla_rows(Backend& backend, AttentionSaved& s, const std::vector<int64_t>& positions, DecodeCache& cache,
                int64_t layer) const;
};

}  // namespace loom
