#include "loom/nn/attention.h"

#include <algorithm>

#include "loom/core/error.h"
#include "loom/nn/context_parallel.h"

namespace loom {

namespace {

// Context parallel: q, k and v of this rank's positions as separate (B, T/cp, width) buffers.
struct SplitQkv {
  Tensor q, k, v;
};
SplitQkv split_views(const ContextParallel& cp, const ModelConfig& c, int64_t B, int64_t Tl, bool grads) {
  const int64_t H = c.n_head, KV = c.n_kv_head, hd = c.head_dim();
  const Tensor& q = grads ? cp.dq : cp.q;
  const Tensor& k = grads ? cp.dk : cp.k;
  const Tensor& v = grads ? cp.dv : cp.v;
  return {q.view(0, {B, Tl, H * hd}), k.view(0, {B, Tl, KV * hd}), v.view(0, {B, Tl, KV * hd})};
}

void split_qkv(Backend& backend, const Tensor& qkv, const SplitQkv& out, const ModelConfig& c, bool into_wide) {
  const int64_t H = c.n_head, KV = c.n_kv_head, hd = c.head_dim();
  copy_columns(backend, qkv, 0, out.q, into_wide);
  copy_columns(backend, qkv, H * hd, out.k, into_wide);
  copy_columns(backend, qkv, (H + KV) * hd, out.v, into_wide);
}

// Packed documents (core/documents.h): f(qkv, attn, saved, d_attn, d_qkv) once per span on
// views of its positions, (1, L, width), with its own probabilities (1, H, L, L) or flash's
// lse (1, H, L) carved one after another from `saved` (a span's L^2 never outgrow the row's T^2).
// d_attn, d_qkv: undefined in the forward.
template <typename F>
void for_each_document(const DocumentSpans& docs, const Tensor& qkv, const Tensor& attn, const Tensor& saved,
                       const Tensor& d_attn, const Tensor& d_qkv, int64_t H, bool flash, F&& f) {
  const int64_t T = qkv.dim(1), W = qkv.dim(2), A = attn.dim(2);
  int64_t carved = 0;
  for (const DocumentSpan& d : docs) {
    const int64_t at = d.row * T + d.begin, L = d.length;
    const Tensor sv = flash ? saved.view(carved, {1, H, L}) : saved.view(carved, {1, H, L, L});
    carved += sv.numel();
    f(qkv.view(at * W, {1, L, W}), attn.view(at * A, {1, L, A}), sv,
      d_attn.defined() ? d_attn.view(at * A, {1, L, A}) : Tensor{}, d_qkv.defined() ? d_qkv.view(at * W, {1, L, W}) : Tensor{});
  }
}

// The q/k norms as head_rmsnorm's heads: H heads of hd and KV of hd after them (Qwen3), or one of
// H hd and one of KV hd (model.qk_norm_whole, OLMo 2: the keys' "head" H / KV of KV hd starts at H hd).
struct QkNormHeads {
  int64_t q, q_width, k_first, k, k_width;
};
QkNormHeads qk_norm_heads(const ModelConfig& c) {
  const int64_t H = c.n_head, KV = c.n_kv_head;
  if (c.qk_norm_whole) return {1, c.q_norm_width(), H / KV, 1, c.k_norm_width()};
  return {H, c.head_dim(), H, KV, c.head_dim()};
}

void check_documents(const LayerPlan& plan) {
  LOOM_CHECK(plan.attention == AttentionKind::mha || plan.attention == AttentionKind::flash, "packed documents "
             "(data.document_mask) with ", plan.attention == AttentionKind::mla ? "MLA" : "context-parallel",
             " attention are not supported yet");
  LOOM_CHECK(!plan.sinks, "packed documents (data.document_mask) with attention sinks (model.attn_sinks) are not "
             "supported yet");
}

// The plain attention's ops, with the plan's GEMM precision (LayerPlan::attention_bf16: no window).
void mha_op_forward(Backend& backend, const LayerPlan& plan, const ModelConfig& c, const Tensor& qkv, const Tensor& out,
                    const Tensor& probs) {
  if (plan.attention_bf16) backend.attention_forward_bf16(qkv, out, probs, c.n_head, c.n_kv_head);
  else backend.attention_forward(qkv, out, probs, c.n_head, c.n_kv_head, plan.window);
}
void mha_op_backward(Backend& backend, const LayerPlan& plan, const ModelConfig& c, const Tensor& dout,
                     const Tensor& qkv, const Tensor& out, const Tensor& probs, const Tensor& dqkv) {
  if (plan.attention_bf16) backend.attention_backward_bf16(dout, qkv, out, probs, dqkv, c.n_head, c.n_kv_head);
  else backend.attention_backward(dout, qkv, out, probs, dqkv, c.n_head, c.n_kv_head, plan.window);
}

// Flash attention's ops, with the plan's GEMM precision (bf16: on tensor cores where the backend has them).
void flash_forward(Backend& backend, const LayerPlan& plan, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                   int64_t H, int64_t KV) {
  if (plan.attention_bf16) backend.flash_attention_forward_bf16(qkv, out, lse, H, KV);
  else backend.flash_attention_forward(qkv, out, lse, H, KV, plan.window);
}
void flash_backward(Backend& backend, const LayerPlan& plan, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                    const Tensor& lse, const Tensor& dqkv, int64_t H, int64_t KV) {
  if (plan.attention_bf16) backend.flash_attention_backward_bf16(dout, qkv, out, lse, dqkv, H, KV);
  else backend.flash_attention_backward(dout, qkv, out, lse, dqkv, H, KV, plan.window);
}

// The probabilities (mha) of s.qkv into `out`, per document when packed.
void mha_forward(Backend& backend, const LayerPlan& plan, const ModelConfig& c, const AttentionSaved& s,
                 const Tensor& out) {
  if (s.docs == nullptr) {
    mha_op_forward(backend, plan, c, s.qkv, out, s.probs);
    return;
  }
  for_each_document(*s.docs, s.qkv, out, s.probs, Tensor{}, Tensor{}, c.n_head, false,
                    [&](const Tensor& qkv, const Tensor& o, const Tensor& probs, const Tensor&, const Tensor&) {
                      mha_op_forward(backend, plan, c, qkv, o, probs);
                    });
}

}  // namespace

void attention_forward(Backend& backend, const LayerPlan& plan, const ModelConfig& c, ContextParallel* cp, AttentionSaved& s) {
  const int64_t H = c.n_head, KV = c.n_kv_head;
  if (s.docs != nullptr) {
    check_documents(plan);
    if (plan.attention == AttentionKind::mha) {
      mha_forward(backend, plan, c, s, s.attn);
    } else {
      for_each_document(*s.docs, s.qkv, s.attn, s.lse, Tensor{}, Tensor{}, H, true,
                        [&](const Tensor& qkv, const Tensor& out, const Tensor& lse, const Tensor&, const Tensor&) {
                          flash_forward(backend, plan, qkv, out, lse, H, KV);
                        });
    }
    return;
  }
  switch (plan.attention) {
    case AttentionKind::mha:
      mha_op_forward(backend, plan, c, s.qkv, s.attn, s.probs);
      return;
    case AttentionKind::flash:
      flash_forward(backend, plan, s.qkv, s.attn, s.lse, H, KV);
      return;
    case AttentionKind::ring:
    case AttentionKind::ulysses: {
      LOOM_CHECK(cp != nullptr, "context-parallel attention without a cp group");
      const SplitQkv x = split_views(*cp, c, s.qkv.dim(0), s.qkv.dim(1), false);
      split_qkv(backend, s.qkv, x, c, false);
      if (plan.attention == AttentionKind::ulysses) ulysses_attention_forward(backend, *cp->comm, x.q, x.k, x.v, s.attn, s.ulysses, H, KV, &cp->work);
      else ring_attention_forward(backend, *cp->comm, x.q, x.k, x.v, s.attn, s.lse, H, KV, &cp->work);
      return;
    }
    case AttentionKind::mla:
    case AttentionKind::linear:
      break;
  }
  throw Error("attention_forward: MLA and linear attention run their own modules (nn/mla.h, nn/linear_attention.h)");
}

void attention_backward(Backend& backend, const LayerPlan& plan, const ModelConfig& c, ContextParallel* cp,
                        const AttentionSaved& s, BlockScratch& k) {
  const int64_t H = c.n_head, KV = c.n_kv_head;
  if (s.docs != nullptr) {
    check_documents(plan);
    const bool flash = plan.attention == AttentionKind::flash;
    for_each_document(*s.docs, s.qkv, s.attn, flash ? s.lse : s.probs, k.d_attn, k.d_qkv, H, flash,
                      [&](const Tensor& qkv, const Tensor& out, const Tensor& saved, const Tensor& d_out,
                          const Tensor& d_qkv) {
                        if (flash) flash_backward(backend, plan, d_out, qkv, out, saved, d_qkv, H, KV);
                        else mha_op_backward(backend, plan, c, d_out, qkv, out, saved, d_qkv);
                      });
    return;
  }
  switch (plan.attention) {
    case AttentionKind::mha:
      mha_op_backward(backend, plan, c, k.d_attn, s.qkv, s.attn, s.probs, k.d_qkv);
      return;
    case AttentionKind::flash:
      flash_backward(backend, plan, k.d_attn, s.qkv, s.attn, s.lse, k.d_qkv, H, KV);
      return;
    case AttentionKind::ring:
    case AttentionKind::ulysses: {
      LOOM_CHECK(cp != nullptr, "context-parallel attention without a cp group");
      const int64_t B = s.qkv.dim(0), Tl = s.qkv.dim(1);
      const SplitQkv d = split_views(*cp, c, B, Tl, true);
      if (plan.attention == AttentionKind::ulysses) {
        ulysses_attention_backward(backend, *cp->comm, k.d_attn, s.ulysses, d.q, d.k, d.v, H, KV, &cp->work);
      } else {
        const SplitQkv x = split_views(*cp, c, B, Tl, false);
        split_qkv(backend, s.qkv, x, c, false);
        ring_attention_backward(backend, *cp->comm, k.d_attn, x.q, x.k, x.v, s.attn, s.lse, d.q, d.k, d.v, H, KV, &cp->work);
      }
      split_qkv(backend, k.d_qkv, d, c, true);
      return;
    }
    case AttentionKind::mla:
    case AttentionKind::linear:
      break;
  }
  throw Error("attention_backward: MLA and linear attention run their own modules (nn/mla.h, nn/linear_attention.h)");
}


void attention_saved_fields(const ModelConfig& config, const LayerPlan& plan, const SavedShape& shape,
                            AttentionSaved& s, const SavedFieldFn& field) {
  const int64_t B = shape.batch, T = shape.seq_len, C = config.d_model, H = config.n_head;
  const int64_t Ts = T / shape.seq_shards;  // the residual stream's positions on this rank
  const bool mla = plan.attention == AttentionKind::mla, flash = plan.attention == AttentionKind::flash;
  const DType qkv_dtype = plan.qkv_bf16 ? DTYPE_BF16 : DTYPE_F32;  // the GEMM writes it, the flash kernels read it
  if (shape.keep == RECOMPUTE_FULL) return;
  const auto qk_norm_fields = [&] {
    if (!config.qk_norm) return;
    field(s.q_in, {B, T, H * config.head_dim()}, DTYPE_F32);
    field(s.q_rstd, {B, T, config.qk_norm_whole ? 1 : H}, DTYPE_F32);
    field(s.k_in, {B, T, config.n_kv_head * config.head_dim()}, DTYPE_F32);
    field(s.k_rstd, {B, T, config.qk_norm_whole ? 1 : config.n_kv_head}, DTYPE_F32);
  };
  if (shape.keep == RECOMPUTE_SELECTIVE) {  // the GEMM outputs (sizes only for MLA: its blocks do not recompute)
    if (!mla) field(s.qkv, {B, T, config.qkv_width()}, qkv_dtype);
    qk_norm_fields();
    field(s.attn, {B, T, config.attn_width()}, saved_dtype(plan, LINEAR_ATTN_OUT));
    if (flash) field(s.lse, {B, H, T}, DTYPE_F32);  // the attention is not recomputed
    return;
  }
  if (config.pre_norms()) {
    field(s.norm.out, {B, Ts, C}, saved_dtype(plan, LINEAR_ATTN_QKV));
    if (!config.rmsnorm()) field(s.norm.mean, {B, Ts}, DTYPE_F32);
    field(s.norm.rstd, {B, Ts}, DTYPE_F32);
  }
  // The output's norm: its input (the projection's output), not its output, which goes straight
  // into the residual stream.
  if (config.post_norms()) {
    field(s.post_in, {B, Ts, C}, DTYPE_F32);
    field(s.post.rstd, {B, Ts}, DTYPE_F32);
  }
  if (mla) {
    const int64_t dq = config.mla_q_rank, dc = config.mla_kv_rank;
    if (dq > 0) {
      field(s.mla_qa, {B, T, dq}, DTYPE_F32);
      field(s.mla_qa_norm, {B, T, dq}, DTYPE_F32);
      field(s.mla_qa_rstd, {B, T}, DTYPE_F32);
    }
    field(s.mla_q, {B, T, H * config.mla_qk()}, DTYPE_F32);
    field(s.mla_c, {B, T, dc}, DTYPE_F32);
    field(s.mla_c_norm, {B, T, dc}, DTYPE_F32);
    field(s.mla_c_rstd, {B, T}, DTYPE_F32);
    field(s.mla_kr, {B, T, config.mla_rope_dim}, DTYPE_F32);
    field(s.mla_kv, {B, T, H * (config.mla_nope() + config.mla_v())}, DTYPE_F32);
  } else {
    field(s.qkv, {B, T, config.qkv_width()}, qkv_dtype);
    qk_norm_fields();
  }
  // FlashAttention or context parallel keep the rows' log-sum-exp (Ulysses then its own record).
  if (plan.attention == AttentionKind::mha || mla) field(s.probs, {B, H, T, T}, DTYPE_F32);
  else field(s.lse, {B, H, T}, DTYPE_F32);
  field(s.attn, {B, T, config.attn_width()}, saved_dtype(plan, LINEAR_ATTN_OUT));
  if (plan.output_gate) {
    field(s.gate_attn, {B, T, 2 * config.attn_width()}, DTYPE_F32);
    field(s.gated, {B, T, config.attn_width()}, DTYPE_F32);
  }
  if (shape.split_backward) {
    field(s.dy_proj, {B, T, C}, DTYPE_F32);
    if (!mla) field(s.dy_qkv, {B, T, config.qkv_width()}, DTYPE_F32);
  }
}

void AttentionLayer::set_precision(const PrecisionPolicy& policy, AttentionParams params16) {
  params16_ = std::move(params16);
  qkv_ = LinearLayer(linear_setup(policy, LINEAR_ATTN_QKV, true), qkv_.base());
  proj_ = LinearLayer(linear_setup(policy, LINEAR_ATTN_OUT, true), proj_.base());
}

MlaActivations AttentionLayer::mla_activations(const AttentionSaved& s) {
  return {s.mla_qa, s.mla_qa_norm, s.mla_qa_rstd, s.mla_q, s.mla_c, s.mla_c_norm, s.mla_c_rstd, s.mla_kr, s.mla_kv,
          s.probs, s.attn};
}

void AttentionLayer::rope(Backend& backend, const Tensor& qkv, bool backward, const DocumentSpans* docs) const {
  const int64_t heads = config_.n_head + config_.n_kv_head, hd = config_.head_dim();
  const ContextParallel* cp = links_.cp;
  if (docs != nullptr) {  // packed documents: positions restart at each document's start
    LOOM_CHECK(cp == nullptr, "packed documents (data.document_mask) with context parallelism are not supported yet");
    const int64_t T = qkv.dim(1), W = qkv.dim(2);
    for (const DocumentSpan& d : *docs) {
      const Tensor x = qkv.view((d.row * T + d.begin) * W, {1, d.length, W});
      if (backward) backend.rope_backward(x, hd, heads, plan_.rope_spec, 0);
      else backend.rope_forward(x, hd, heads, plan_.rope_spec, 0);
    }
    return;
  }
  if (cp == nullptr) {
    if (backward) backend.rope_backward(qkv, hd, heads, plan_.rope_spec, 0);
    else backend.rope_forward(qkv, hd, heads, plan_.rope_spec, 0);
    return;
  }
  // This rank's positions are two chunks of the sequence (zig-zag): each rotated at its start.
  const int64_t B = qkv.dim(0), Tl = qkv.dim(1), W = qkv.dim(2), chunk = Tl / 2;
  const Tensor tmp = cp->chunk.view(0, {B, chunk, W});
  for (int c = 0; c < 2; ++c) {
    for (int64_t b = 0; b < B; ++b) backend.copy(qkv.view((b * Tl + c * chunk) * W, {chunk, W}), tmp.view(b * chunk * W, {chunk, W}));
    if (backward) backend.rope_backward(tmp, hd, heads, plan_.rope_spec, cp->chunk_starts[static_cast<size_t>(c)]);
    else backend.rope_forward(tmp, hd, heads, plan_.rope_spec, cp->chunk_starts[static_cast<size_t>(c)]);
    for (int64_t b = 0; b < B; ++b) backend.copy(tmp.view(b * chunk * W, {chunk, W}), qkv.view((b * Tl + c * chunk) * W, {chunk, W}));
  }
}

void AttentionLayer::qk_norm_forward(Backend& backend, const Tensor& qkv, const AttentionSaved& s) const {
  if (!config_.qk_norm) return;
  const QkNormHeads n = qk_norm_heads(config_);
  const int64_t rows = qkv.numel() / qkv.dim(-1);
  backend.head_rmsnorm_forward(qkv, params_.q_norm, 0, n.q, n.q_width, config_.norm_eps,
                               s.q_in.view(0, {rows * n.q * n.q_width}), s.q_rstd.view(0, {rows * n.q}));
  backend.head_rmsnorm_forward(qkv, params_.k_norm, n.k_first, n.k, n.k_width, config_.norm_eps,
                               s.k_in.view(0, {rows * n.k * n.k_width}), s.k_rstd.view(0, {rows * n.k}));
}

void AttentionLayer::qk_norm_backward(Backend& backend, const Tensor& d_qkv, const AttentionSaved& s) const {
  if (!config_.qk_norm) return;
  const QkNormHeads n = qk_norm_heads(config_);
  backend.head_rmsnorm_backward(d_qkv, s.q_in, params_.q_norm, s.q_rstd, 0, n.q, n.q_width, grads_.q_norm);
  backend.head_rmsnorm_backward(d_qkv, s.k_in, params_.k_norm, s.k_rstd, n.k_first, n.k, n.k_width, grads_.k_norm);
}

void AttentionLayer::forward(Backend& backend, const Tensor& x, AttentionSaved& s, const Tensor& mid) {
  const AttentionParams& p = params_;
  const AttentionParams& q = params16_;
  const int64_t T = s.attn.dim(1);
  // OLMo 2: the input as it is, the output normed; Gemma: both normed (below).
  const bool pre = config_.pre_norms(), post = config_.post_norms();
  if (pre) norm_forward_saved(backend, config_, x, p.norm_w, p.norm_b, s.norm);
  if (plan_.attention == AttentionKind::mla) {  // multi-head latent attention (nn/mla.h): a whole layer only
    mla_forward(backend, config_, p.mla, s.norm.out, mla_activations(s));
  } else {
    const Tensor input = pre ? links_.whole(backend, s.norm.out, T) : x;  // (sequence parallel: gathered)
    // qkv kept in bf16 (LayerPlan::qkv_bf16): written so by the GEMM, or staged in fp32 for the
    // adapters, the q/k norms and RoPE, then rounded (the bits the flash kernels would round to).
    const bool qkv_staged = s.qkv.dtype() == DTYPE_BF16 && (plan_.rope || config_.qk_norm || !p.qkv_lora.empty());
    LOOM_CHECK(!qkv_staged || links_.ws != nullptr, "attention: a bf16 qkv record under RoPE needs a workspace");
    const Tensor qkv = qkv_staged ? links_.ws->f32(LinearWorkspace::R, s.qkv.shape()) : s.qkv;
    adapted_linear_forward(backend, qkv_, input, p.qkv_w, q.qkv_w, p.qkv_b, qkv, qkv_lora(s), links_.ws);
    qk_norm_forward(backend, qkv, s);
    if (plan_.rope) rope(backend, qkv, false, s.docs);
    if (qkv_staged) backend.cast(qkv, s.qkv);
    // O kept in bf16 (LayerPlan::saved_bf16): the bf16 flash kernels write it rounded; the plain
    // attention computes it in fp32, then rounded into s.attn.
    if (s.attn.dtype() == DTYPE_F32 || plan_.attention == AttentionKind::flash) {
      attention_forward(backend, plan_, config_, links_.cp, s);
      if (plan_.sinks) backend.attention_sink_forward(s.attn, s.lse, p.sinks, config_.n_head);
    } else {
      AttentionSaved staged = s;
      staged.attn = saved_target(s.attn, links_.ws);
      attention_forward(backend, plan_, config_, links_.cp, staged);
      if (plan_.sinks) backend.attention_sink_forward(staged.attn, s.lse, p.sinks, config_.n_head);
      store_saved(backend, staged.attn, s.attn);
    }
    if (plan_.output_gate) output_gate_forward(backend, input, s);
  }
  const Tensor& attn = proj_input(s);
  if (post) {  // mid = x + norm(proj(attn)) (a whole layer: no tp)
    adapted_linear_forward(backend, proj_, attn, p.proj_w, q.proj_w, p.proj_b, s.post_in, proj_lora(s), links_.ws);
    post_norm_residual(backend, config_, s.post_in, p.post_norm_w, Tensor{}, s.post, x, mid);
    return;
  }
  // mid = x + proj(attn); g: the heads' partial projections summed over tp.
  residual_linear_forward(backend, links_, proj_, attn, p.proj_w, q.proj_w, p.proj_b, x, mid, proj_lora(s));
}

void AttentionLayer::output_gate_forward(Backend& backend, const Tensor& input, const AttentionSaved& s) const {
  const int64_t A = config_.attn_width(), N = s.attn.numel() / A;
  const Tensor gate = Tensor::empty(backend.allocator(), {N, A}, DTYPE_F32, MEM_WORKSPACE);
  linear_forward(backend, input.view(0, {N, input.dim(-1)}), params_.gate_w, Tensor{}, gate);
  const Tensor ga = s.gate_attn.view(0, {N, 2 * A});
  copy_columns(backend, ga, 0, gate, true);
  copy_columns(backend, ga, A, s.attn.view(0, {N, A}), true);
  backend.glu_forward(ga, s.gated.view(0, {N, A}), GateActivation::sigmoid);
}

void AttentionLayer::output_gate_backward(Backend& backend, const Tensor& input, const AttentionSaved& s,
                                          const Tensor& d_gated, const Tensor& d_attn, const Tensor& d_input) const {
  const int64_t A = config_.attn_width(), N = s.attn.numel() / A, C = input.dim(-1);
  Allocator& a = backend.allocator();
  const Tensor d_ga = Tensor::empty(a, {N, 2 * A}, DTYPE_F32, MEM_WORKSPACE);
  const Tensor d_gate = Tensor::empty(a, {N, A}, DTYPE_F32, MEM_WORKSPACE);
  backend.glu_backward(s.gate_attn.view(0, {N, 2 * A}), d_gated.view(0, {N, A}), d_ga, GateActivation::sigmoid);
  copy_columns(backend, d_ga, 0, d_gate, false);
  copy_columns(backend, d_ga, A, d_attn.view(0, {N, A}), false);
  linear_backward(backend, input.view(0, {N, C}), params_.gate_w, d_gate, d_input.view(0, {N, C}), grads_.gate_w,
                  Tensor{});
}

void AttentionLayer::forward_rows(Backend& backend, const Tensor& x, AttentionSaved& s, const Tensor& mid,
                                  const std::vector<int64_t>& positions, DecodeCache& cache, int64_t layer) const {
  const AttentionParams& p = params_;
  const int64_t n = x.dim(0), H = config_.n_head, hd = config_.head_dim(), W = config_.qkv_width();
  // The sinks where the attends read them: the parameter for a cache in the backend's memory,
  // host floats for the others (nn/layer.h DecodeCache).
  const bool rows_in_backend = plan_.attention != AttentionKind::mla && cache.in_backend_memory();
  cache.sink_logits = plan_.sinks ? p.sinks : Tensor{};
  cache.sinks.resize(plan_.sinks && !rows_in_backend ? static_cast<size_t>(H) : 0);
  if (!cache.sinks.empty()) backend.read(p.sinks, cache.sinks.data());
  const bool pre = config_.pre_norms(), post = config_.post_norms();
  if (pre) norm_forward(backend, config_, x, p.norm_w, p.norm_b, s.norm.out, s.norm.mean, s.norm.rstd);
  if (plan_.attention == AttentionKind::mla) {
    mla_rows(backend, s, positions, cache, layer);
  } else {
    const Tensor& input = pre ? s.norm.out : x;
    qkv_.forward_plain(backend, input, p.qkv_w, p.qkv_b, s.qkv, 0.0f, links_.ws);
    lora_forward(backend, input, p.qkv_lora, config_.lora_scale(), s.qkv, links_.ws, {}, p.qkv_w);
    qk_norm_forward(backend, s.qkv.view(0, {n, W}), s);
    if (plan_.rope) backend.rope_rows_forward(s.qkv.view(0, {n, 1, W}), hd, H + config_.n_kv_head, plan_.rope_spec, positions);
    if (rows_in_backend) {  // the rows stay in the backend's memory
      cache.attend_all(backend, layer, s.qkv.view(0, {n, W}), s.attn.view(0, {n, H * hd}));
    } else {
      host_rows_attend(backend, s, cache, layer, n);
    }
    if (plan_.output_gate) output_gate_forward(backend, input, s);
  }
  const Tensor& attn = proj_input(s);
  if (post) {  // mid = x + norm(proj(attn))
    const Tensor y = s.post_in.view(0, x.shape());
    proj_.forward_plain(backend, attn, p.proj_w, p.proj_b, y, 0.0f, links_.ws);
    lora_forward(backend, attn, p.proj_lora, config_.lora_scale(), y, links_.ws, {}, p.proj_w);
    post_norm_residual(backend, config_, y, p.post_norm_w, Tensor{}, s.post, x, mid);
    return;
  }
  backend.copy(x, mid);
  proj_.forward_plain(backend, attn, p.proj_w, p.proj_b, mid, 1.0f, links_.ws);
  lora_forward(backend, attn, p.proj_lora, config_.lora_scale(), mid, links_.ws, {}, p.proj_w);
}

void AttentionLayer::host_rows_attend(Backend& backend, AttentionSaved& s, DecodeCache& cache, int64_t layer,
                                      int64_t n) const {
  const int64_t H = config_.n_head, hd = config_.head_dim();
  const int64_t W = config_.qkv_width(), KW = config_.n_kv_head * hd;
  // The rows' q, k, v to the host in one read; each row's attention through its host cache; the
  // outputs back in one write (the same arithmetic as on the rows in place).
  std::vector<float>& qkv = cache.host_qkv;
  std::vector<float>& attn = cache.host_attn;
  qkv.resize(static_cast<size_t>(n * W));
  attn.resize(static_cast<size_t>(n * H * hd));
  backend.read(s.qkv.view(0, {n, W}), qkv.data());
  cache.attend_host_rows(layer, n, qkv.data(), W, H * hd, H * hd + KW, attn.data(), H * hd);
  backend.write(s.attn.view(0, {n, H * hd}), attn.data());
}

void AttentionLayer::mla_rows(Backend& backend, AttentionSaved& s, const std::vector<int64_t>& positions,
                              DecodeCache& cache, int64_t layer) const {
  const int64_t n = s.norm.out.dim(0), dc = config_.mla_kv_rank, dr = config_.mla_rope_dim;
  MlaActivations a = mla_activations(s);
  a.kv = Tensor{};  // the up-projection is absorbed into the query
  mla_project(backend, config_, params_.mla, s.norm.out, a, positions.data());
  const int64_t qw = config_.n_head * config_.mla_qk(), lw = dc + dr, aw = config_.attn_width();
  std::vector<float> latent(static_cast<size_t>(lw));
  for (int64_t r = 0; r < n; ++r) {  // the row's [c' | k_r] to the host cache, the visible latents back
    backend.read(a.c_norm.view(r * dc, {dc}), latent.data());
    backend.read(a.kr.view(r * dr, {dr}), latent.data() + dc);
    int64_t count = 0;
    const float* latents = cache.latent(layer, r, latent.data(), &count);
    // A sliding window attends to the newest attn_window positions only.
    const int64_t first = config_.attn_window > 0 ? std::max<int64_t>(0, count - config_.attn_window) : 0;
    const Tensor visible = Tensor::empty(backend.allocator(), {count - first, lw}, DTYPE_F32, MEM_WORKSPACE);
    backend.write(visible, latents + first * lw);
    mla_attend_latents(backend, config_, params_.mla, a.q.view(r * qw, {qw}), visible, a.attn.view(r * aw, {aw}));
  }
}

void AttentionLayer::backward(Backend& backend, const Tensor& x, const AttentionSaved& s, const Tensor& d_residual,
                              BlockScratch& k, BackwardPart part, const ResidualDy16& r16) {
  const AttentionParams& p = params_;
  const AttentionParams& g = grads_;
  const AttentionParams& q = params16_;
  const int64_t T = s.attn.dim(1);
  // Sequence parallel: gradients arrive on the shard and are gathered before the row-parallel
  // layer's backward (g's backward); the norm's output is gathered again for the weight gradient.
  const auto whole = [&](const Tensor& shard) { return links_.whole(backend, shard, T); };
  const bool mla = plan_.attention == AttentionKind::mla, pre = config_.pre_norms(), post = config_.post_norms();
  const InputPass pass = input_pass(backend, part, s.dy_proj);
  // LoRA's adapters (zero-bubble schedules' split backward): their small gradients are computed
  // with the input gradient, in the input pass; the weight pass is the frozen base's, which has none.
  const Tensor& attn = proj_input(s);
  if (part == BACKWARD_WEIGHT) {  // the weight gradients from the kept output gradients
    proj_.backward(backend, attn, p.proj_w, q.proj_w, s.dy_proj, Tensor{}, g.proj_w, Tensor{}, links_.ws);
    // An MLA layer's projections' weight gradients were computed in the input pass.
    if (!mla) qkv_.backward(backend, pre ? whole(s.norm.out) : x, p.qkv_w, q.qkv_w, s.dy_qkv, Tensor{}, g.qkv_w, Tensor{}, links_.ws);
    return;
  }
  // Output norm: d(projection output) through it from d(mid) (a whole layer: no tp).
  if (post) norm_backward(backend, config_, d_residual, s.post_in, p.post_norm_w, Tensor{}, s.post.rstd, k.d_tmp, g.post_norm_w, Tensor{});
  const Tensor dy_mid = post ? k.d_tmp.view(0, d_residual.shape()) : whole(d_residual);
  pass.keep(dy_mid, s.dy_proj);
  // Gated attention: d(gated) first, then d(attn) and the gate projection's d(input) from it.
  Tensor d_gate_input;
  // dO in bf16 where the plan says (the bf16 flash backward reads it as it is; written rounded by
  // the projection's bf16 GEMM), else fp32.
  BlockScratch kd = k;
  if (plan_.attn_dy_bf16 && part == BACKWARD_ALL && links_.ws != nullptr) {
    kd.d_attn = links_.ws->bf16(LinearWorkspace::P, k.d_attn.shape());
  }
  const Tensor d_proj_in = plan_.output_gate ? Tensor::empty(backend.allocator(), k.d_attn.shape(), DTYPE_F32, MEM_WORKSPACE)
                                             : kd.d_attn;
  // r16.in: d(mid) rounded by norm2's backward, which finalised it (LayerPlan::proj_dy_bf16), for proj's GEMMs.
  LOOM_CHECK(!r16.in.defined() || (!post && links_.seq == nullptr), "attention backward: a bf16 d(mid) for proj with "
             "an output norm or sequence parallelism");
  adapted_linear_backward(backend, proj_, attn, p.proj_w, q.proj_w, dy_mid, d_proj_in, pass.dw(g.proj_w), g.proj_b,
                          proj_lora(s), g.proj_lora, links_.ws, r16.in);
  if (plan_.output_gate) {
    const Tensor& gate_in = pre ? s.norm.out : x;  // the gate projection's input
    d_gate_input = Tensor::empty(backend.allocator(), gate_in.shape(), DTYPE_F32, MEM_WORKSPACE);
    output_gate_backward(backend, gate_in, s, d_proj_in, k.d_attn, d_gate_input);
  }
  if (mla) {  // d(norm1 output) and MLA's weight gradients (also in a split input pass)
    mla_backward(backend, config_, p.mla, g.mla, s.norm.out, mla_activations(s), k.d_attn, k.d_norm, k.d_qkv);
  } else {
    // d(qkv) in bf16 where the plan says (the qkv layer's GEMMs read it as it is), else fp32.
    const bool dy16 = plan_.qkv_dy_bf16 && part == BACKWARD_ALL && links_.ws != nullptr;
    BlockScratch k16 = kd;
    if (dy16) k16.d_qkv = links_.ws->bf16(LinearWorkspace::Y, k.d_qkv.shape());
    const Tensor d_qkv = k16.d_qkv;
    if (s.attn.dtype() == DTYPE_F32 || plan_.attention == AttentionKind::flash) {  // (flash: the bf16 kernels read a bf16 O)
      // Sinks: d(O') = g dO, and the plain backward given O (Backend::attention_sink_backward).
      if (plan_.sinks) backend.attention_sink_backward(k.d_attn, s.attn, s.lse, p.sinks, g.sinks, config_.n_head);
      attention_backward(backend, plan_, config_, links_.cp, s, k16);
    } else {  // O kept in bf16: the kernel reads it widened (D = rowsum(dO o O) of the bf16 O, as autocast's)
      AttentionSaved widened = s;
      widened.attn = saved_f32(backend, s.attn, links_.ws);
      if (plan_.sinks) backend.attention_sink_backward(k.d_attn, widened.attn, s.lse, p.sinks, g.sinks, config_.n_head);
      attention_backward(backend, plan_, config_, links_.cp, widened, k16);
    }
    if (plan_.rope) rope(backend, d_qkv, true, s.docs);
    qk_norm_backward(backend, d_qkv, s);
    pass.keep(d_qkv, s.dy_qkv);
    const Tensor input = pre ? whole(s.norm.out) : x;
    adapted_linear_backward(backend, qkv_, input, p.qkv_w, q.qkv_w, d_qkv, k.d_norm, pass.dw(g.qkv_w), g.qkv_b,
                            qkv_lora(s), g.qkv_lora, links_.ws);
    if (d_gate_input.defined()) backend.add_inplace(k.d_norm.view(0, d_gate_input.shape()), d_gate_input);
  }
  if (!pre) {  // d(x) = d(mid) + the attention's d(x)
    backend.add_inplace(d_residual, k.d_norm.view(0, d_residual.shape()));
    if (r16.out.defined()) backend.cast(d_residual, r16.out);  // (no norm to write it: plan rules leave this out)
    return;
  }
  // f: the heads' partial d(norm1 output), then through norm1 into d(x) (and its bf16 rounding).
  norm_residual_backward(backend, config_, links_, k, true, d_residual, x, p.norm_w, s.norm, g.norm_w, g.norm_b,
                         r16.out);
}

void AttentionLayer::recompute_selective(Backend& backend, const Tensor& x, AttentionSaved& s,
                                         const Tensor& out_scratch) const {
  norm_forward_saved(backend, config_, x, params_.norm_w, params_.norm_b, s.norm);
  if (plan_.attention != AttentionKind::flash) mha_forward(backend, plan_, config_, s, out_scratch.view(0, s.attn.shape()));
}

}  // namespace loom
