// The defaults of the Backend interface's optional ops: a one-line error naming the op and the
// backend (the gradient compression, model-parallel, mixture-of-experts and latent-attention ops;
// a backend that has them says so in its capabilities), and the portable defaults of
// bf16_weight_linear (widen, then gemm) and of gemm_gelu / gemm_dgelu (the GEMM, then the GELU op).
#include "loom/backend/backend.h"
#include "loom/backend/checks.h"

#include "loom/core/error.h"

namespace loom {

namespace {
[[noreturn]] void unsupported(const Backend& backend, const char* op,
                              const char* feature = "gradient compression") {
  throw Error(str_cat(op, ": not implemented on the ", backend.name(), " backend (", feature,
                      " runs on the CPU backend only)"));
}
[[noreturn]] void no_optimizer(const Backend& backend, const char* op) {
  unsupported(backend, op, "every optimizer but plain adamw");
}
[[noreturn]] void no_model_parallel(const Backend& backend, const char* op) {
  unsupported(backend, op, "model parallelism (parallel.tp / pp / cp / ep)");
}
[[noreturn]] void no_moe(const Backend& backend, const char* op) {
  unsupported(backend, op, "model.moe_experts > 0 (mixture of experts)");
}
[[noreturn]] void no_mla(const Backend& backend, const char* op) {
  unsupported(backend, op, "model.mla_kv_rank > 0 (MLA)");
}
[[noreturn]] void no_low_precision(const Backend& backend, const char* op) {
  unsupported(backend, op, "fp16 / fp8 recipes, QAT and bf16 master weights");
}
}  // namespace

void Backend::gemm_gelu(const Tensor& a, const Tensor& b, const Tensor& pre, const Tensor& act, const GemmSpec& spec,
                        const Tensor* bias) {
  checks::check_gemm_gelu("gemm_gelu", a, b, pre, act, spec, bias, nullptr);
  gemm(a, b, pre, spec, bias);
  gelu_forward(pre, act);
}

void Backend::gemm_dgelu(const Tensor& a, const Tensor& b, const Tensor& pre, const Tensor& scratch, const Tensor& dx,
                         const GemmSpec& spec) {
  checks::check_gemm_gelu("gemm_dgelu", a, b, pre, dx, spec, nullptr, &scratch);
  gemm(a, b, scratch, spec);
  gelu_backward(pre, scratch, dx);
}

void Backend::topk_extract(const Tensor&, const Tensor&, const Tensor&, const Tensor&) { unsupported(*this, "topk_extract"); }
void Backend::scatter_add(const Tensor&, const Tensor&, const Tensor&) { unsupported(*this, "scatter_add"); }
void Backend::scatter_zero(const Tensor&, const Tensor&) { unsupported(*this, "scatter_zero"); }
void Backend::dgc_accumulate(const Tensor&, const Tensor&, const Tensor&, float, double) {
  unsupported(*this, "dgc_accumulate");
}
void Backend::onebit_encode(const Tensor&, const Tensor&, const Tensor&) { unsupported(*this, "onebit_encode"); }
void Backend::onebit_decode_add(const Tensor&, const Tensor&, const Tensor&) { unsupported(*this, "onebit_decode_add"); }
void Backend::qsgd_encode(const Tensor&, const Tensor&, const Tensor&, const QsgdSpec&) { unsupported(*this, "qsgd_encode"); }
void Backend::qsgd_decode_add(const Tensor&, const Tensor&, int, const Tensor&) { unsupported(*this, "qsgd_decode_add"); }
void Backend::lowrank_project(const Tensor&, const Tensor&, const Tensor&, bool) { unsupported(*this, "lowrank_project"); }
void Backend::orthonormalize_columns(const Tensor&) { unsupported(*this, "orthonormalize_columns"); }
void Backend::lowrank_expand(const Tensor&, const Tensor&, const Tensor&, float, float) {
  unsupported(*this, "lowrank_expand");
}

void Backend::vocab_embedding_forward(const Tensor&, const Tensor&, int64_t, int64_t, const Tensor&) {
  no_model_parallel(*this, "vocab_embedding_forward");
}
void Backend::vocab_embedding_backward(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t) {
  no_model_parallel(*this, "vocab_embedding_backward");
}
void Backend::add_positions(const Tensor&, const Tensor&, int64_t) { no_model_parallel(*this, "add_positions"); }
void Backend::positions_backward(const Tensor&, const Tensor&, int64_t) {
  no_model_parallel(*this, "positions_backward");
}
void Backend::attention_forward_bf16(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t) {
  unsupported(*this, "attention_forward_bf16", "precision.attention = bf16");
}
void Backend::attention_backward_bf16(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                      int64_t, int64_t) {
  unsupported(*this, "attention_backward_bf16", "precision.attention = bf16");
}
namespace {
// x's values rounded to bf16 (x itself bf16: its values), in a new tensor of dtype `wide` (f32
// or f64) of the backend (workspace memory).
Tensor bf16_rounded(Backend& backend, const Tensor& x, DType wide) {
  Tensor bf16 = x;
  if (x.dtype() != DTYPE_BF16) {
    bf16 = Tensor::empty(backend.allocator(), x.shape(), DTYPE_BF16, MEM_WORKSPACE);
    backend.cast(x, bf16);
  }
  Tensor rounded = Tensor::empty(backend.allocator(), x.shape(), wide, MEM_WORKSPACE);
  backend.cast(bf16, rounded);
  return rounded;
}
}  // namespace

void Backend::flash_attention_forward_bf16(const Tensor& qkv, const Tensor& out, const Tensor& lse, int64_t n_head,
                                           int64_t n_kv_head) {
  checks::check_attention("flash_attention_forward_bf16", qkv, out, lse, n_head, n_kv_head, 0, true, true);
  const DType wide = checks::attention_compute_dtype(qkv, true);
  if (out.dtype() == wide) {
    flash_attention_forward(bf16_rounded(*this, qkv, wide), out, lse, n_head, n_kv_head, 0);
    return;
  }
  const Tensor o = Tensor::empty(allocator(), out.shape(), wide, MEM_WORKSPACE);  // O kept in bf16
  flash_attention_forward(bf16_rounded(*this, qkv, wide), o, lse, n_head, n_kv_head, 0);
  cast(o, out);
}
void Backend::flash_attention_backward_bf16(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                                            const Tensor& dqkv, int64_t n_head, int64_t n_kv_head) {
  checks::check_attention_backward("flash_attention_backward_bf16", dout, qkv, out, lse, dqkv, n_head, n_kv_head, 0,
                                   true, true);
  const DType wide = checks::attention_compute_dtype(qkv, true);
  Tensor o = out, g = dqkv;
  if (out.dtype() != wide) {  // O kept in bf16: D from its widened values
    o = Tensor::empty(allocator(), out.shape(), wide, MEM_WORKSPACE);
    cast(out, o);
  }
  if (dqkv.dtype() != wide) g = Tensor::empty(allocator(), dqkv.shape(), wide, MEM_WORKSPACE);
  flash_attention_backward(bf16_rounded(*this, dout, wide), bf16_rounded(*this, qkv, wide), o, lse, g, n_head,
                           n_kv_head, 0);
  if (g.dtype() != dqkv.dtype()) cast(g, dqkv);  // dqkv wanted in bf16: rounded
}
void Backend::cross_entropy_loss_and_grad(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                                          const Tensor& lse, float dloss, const Tensor& dlogits) {
  LOOM_CHECK(logits.dtype() != DTYPE_BF16, "cross_entropy_loss_and_grad: bf16 logits are not supported on the ",
             name(), " backend");
  cross_entropy_forward(logits, targets, losses, lse);
  const bool round = dlogits.dtype() != logits.dtype();
  cross_entropy_backward(logits, targets, lse, dloss, round ? logits : dlogits);
  if (round) cast(logits, dlogits);
}
void Backend::cross_entropy_loss_and_grad_columns(const Tensor&, const Tensor&, const Tensor&, const Tensor&, float,
                                                  const Tensor&) {
  LOOM_CHECK(false, "cross_entropy_loss_and_grad_columns is not implemented on the ", name(), " backend");
}
void Backend::vocab_ce_partials(const Tensor&, const Tensor&, int64_t, int64_t, const Tensor&, const Tensor&) {
  no_model_parallel(*this, "vocab_ce_partials");
}
void Backend::vocab_ce_sums(const Tensor&, const Tensor&, int64_t, const Tensor&) {
  no_model_parallel(*this, "vocab_ce_sums");
}
void Backend::vocab_ce_finish(const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  no_model_parallel(*this, "vocab_ce_finish");
}
void Backend::vocab_ce_backward(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, float, const Tensor&) {
  no_model_parallel(*this, "vocab_ce_backward");
}
void Backend::ring_attention_merge(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                   const Tensor&, const Tensor&, const RingBlock&) {
  no_model_parallel(*this, "ring_attention_merge");
}
void Backend::ring_attention_finish(const Tensor&, const Tensor&, const Tensor&, int64_t) {
  no_model_parallel(*this, "ring_attention_finish");
}
void Backend::attention_row_dot(const Tensor&, const Tensor&, const Tensor&, int64_t) {
  no_model_parallel(*this, "attention_row_dot");
}
void Backend::ring_attention_block_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                            const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                            const RingBlock&) {
  no_model_parallel(*this, "ring_attention_block_backward");
}

// Model-parallel slicing.
void Backend::copy_block(const Tensor&, const Tensor&, const BlockCopy&) { no_model_parallel(*this, "copy_block"); }

void copy_columns(Backend& backend, const Tensor& wide, int64_t first, const Tensor& narrow, bool into_wide) {
  const int64_t W = wide.dim(-1), w = narrow.dim(-1), rows = wide.numel() / W;
  LOOM_CHECK(narrow.numel() == rows * w && first >= 0 && first + w <= W, "copy_columns: ", narrow.describe(),
             " is not columns [", first, ", +", w, ") of ", wide.describe());
  if (into_wide) backend.copy_block(narrow, wide, BlockCopy{rows, w, 0, 0, w, 0, first, W});
  else backend.copy_block(wide, narrow, BlockCopy{rows, w, 0, first, W, 0, 0, w});
}

// Mixture of experts and latent attention.
void Backend::moe_route(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        const MoeRouting&) {
  no_moe(*this, "moe_route");
}
void Backend::moe_assign(const Tensor&, int64_t, const Tensor&, const Tensor&, const Tensor&) {
  no_moe(*this, "moe_assign");
}
void Backend::moe_dispatch(const Tensor&, const Tensor&, const Tensor&) { no_moe(*this, "moe_dispatch"); }
void Backend::moe_combine(const Tensor&, const Tensor&, const Tensor&, const Tensor&) { no_moe(*this, "moe_combine"); }
void Backend::moe_combine_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  no_moe(*this, "moe_combine_backward");
}
void Backend::moe_balance_stats(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, const MoeRouting&) {
  no_moe(*this, "moe_balance_stats");
}
void Backend::moe_router_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, const Tensor&, const Tensor&, const Tensor&, const MoeRouting&) {
  no_moe(*this, "moe_router_backward");
}
void Backend::head_rmsnorm_forward(const Tensor&, const Tensor&, int64_t, int64_t, int64_t, float, const Tensor&,
                                   const Tensor&) {
  unsupported(*this, "head_rmsnorm_forward", "model.qk_norm");
}
void Backend::head_rmsnorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, int64_t,
                                    const Tensor&) {
  unsupported(*this, "head_rmsnorm_backward", "model.qk_norm");
}
void Backend::delta_rule_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                 const Tensor&, const Tensor&, const Tensor&, DeltaRuleForm, int64_t) {
  unsupported(*this, "delta_rule_forward", "the gated delta rule, linear attention");
}
void Backend::delta_rule_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, const Tensor&, const Tensor&, const Tensor&, DeltaRuleForm, int64_t) {
  unsupported(*this, "delta_rule_backward", "the gated delta rule, linear attention");
}
void Backend::causal_conv1d_silu_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  unsupported(*this, "causal_conv1d_silu_forward", "the gated delta rule, linear attention");
}
void Backend::causal_conv1d_silu_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                          const Tensor&, const Tensor&) {
  unsupported(*this, "causal_conv1d_silu_backward", "the gated delta rule, linear attention");
}
void Backend::delta_gates_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  unsupported(*this, "delta_gates_forward", "the gated delta rule, linear attention");
}
void Backend::delta_gates_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                   const Tensor&, const Tensor&, const Tensor&) {
  unsupported(*this, "delta_gates_backward", "the gated delta rule, linear attention");
}
void Backend::attention_sink_forward(const Tensor&, const Tensor&, const Tensor&, int64_t) {
  unsupported(*this, "attention_sink_forward", "attention sinks (GPT-OSS)");
}
void Backend::attention_sink_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t) {
  unsupported(*this, "attention_sink_backward", "attention sinks (GPT-OSS)");
}
void Backend::mla_rope(const Tensor&, int64_t, int64_t, int64_t, int64_t, const RopeSpec&, int64_t, bool) {
  no_mla(*this, "mla_rope");
}
void Backend::mla_attention_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                    const MlaDims&) {
  no_mla(*this, "mla_attention_forward");
}
void Backend::mla_attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                     const Tensor&, const Tensor&, const Tensor&, const Tensor&, const MlaDims&) {
  no_mla(*this, "mla_attention_backward");
}
void Backend::mla_attend_latents(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const MlaDims&) {
  no_mla(*this, "mla_attend_latents");
}

// Low precision.
float Backend::amax(const Tensor&) { no_low_precision(*this, "amax"); }
void Backend::fake_quant(const Tensor&, const Tensor&, const NumberGrid&, float, float) {
  no_low_precision(*this, "fake_quant");
}
void Backend::quant_codes_bf16(const Tensor&, const Tensor&, const NumberGrid&, float) {
  no_low_precision(*this, "quant_codes_bf16");
}
void Backend::fake_quant_blocks(const Tensor&, const Tensor&, const NumberGrid&, int64_t, int64_t) {
  no_low_precision(*this, "fake_quant_blocks");
}
void Backend::fake_quant_mxfp4(const Tensor&, const Tensor&) { no_low_precision(*this, "fake_quant_mxfp4"); }
void Backend::fake_quant_nvfp4(const Tensor&, const Tensor&) { no_low_precision(*this, "fake_quant_nvfp4"); }
void Backend::nf4_dequantize(const Tensor&, const Tensor&, const Tensor&, const Nf4Spec&, int64_t, const Tensor&) {
  unsupported(*this, "nf4_dequantize", "QLoRA's NF4 base weights");
}

void Backend::soft_target_loss(const Tensor&, const Tensor&, float, float, const Tensor&, const Tensor&) {
  unsupported(*this, "soft_target_loss", "a teacher's soft targets");
}

void Backend::kv_attention(const KvAttendPlan&, const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  unsupported(*this, "kv_attention", "a KV cache in the backend's memory");
}

void Backend::kv_store(const KvStorePlan&, const std::vector<Tensor>&, const Tensor&, const Tensor&, const Tensor&) {
  unsupported(*this, "kv_store", "a KV cache in the backend's memory");
}

void Backend::rope_rows_forward(const Tensor& x, int64_t head_dim, int64_t n_heads, const RopeSpec& rope,
                                const std::vector<int64_t>& positions) {
  checks::check_rope_rows(x, head_dim, n_heads, positions);
  const int64_t W = x.dim(2);
  for (size_t r = 0; r < positions.size(); ++r) {
    rope_forward(x.view(static_cast<int64_t>(r) * W, {1, 1, W}), head_dim, n_heads, rope, positions[r]);
  }
}

StepGraphScope::StepGraphScope(Backend& backend, bool on, int64_t key)
    : backend_(backend), key_(key), on_(on && backend.begin_step_graph()) {}
StepGraphScope::~StepGraphScope() {
  if (on_) backend_.abort_step_graph();
}
void StepGraphScope::launch() {
  if (!on_) return;
  on_ = false;
  backend_.end_step_graph(key_);
}

void Backend::argmax_rows(const Tensor&, const Tensor&) { unsupported(*this, "argmax_rows", "greedy decoding on the backend"); }
void Backend::sample_rows(const Tensor&, const std::vector<RowSampling>&, const std::vector<SamplePenalty>&, const Tensor&) {
  unsupported(*this, "sample_rows", "sampled decoding on the backend");
}

void Backend::int_linear(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const IntWeightSpec&, const Tensor*,
                         const Tensor&, float, const Tensor*) {
  unsupported(*this, "int_linear", "quantized checkpoints (loom quantize)");
}

void Backend::int_dequantize(const Tensor&, const Tensor&, const Tensor&, const IntWeightSpec&, const Tensor*, const Tensor&) {
  unsupported(*this, "int_dequantize", "quantized checkpoints (loom quantize)");
}
void Backend::bf16_weight_linear(const Tensor& x, const Tensor& w, const Tensor& y, float beta, const Tensor* bias) {
  checks::check_bf16_weight_linear(x, w, y, bias);
  const Tensor wide = Tensor::empty(allocator(), w.shape(), DTYPE_F32, MEM_WORKSPACE);
  cast(w, wide);
  GemmSpec spec;
  spec.trans_b = true, spec.beta = beta;
  gemm(x.reshape({x.numel() / w.dim(1), w.dim(1)}), wide, y.reshape({y.numel() / w.dim(0), w.dim(0)}), spec, bias);
}

void Backend::round_bf16(const Tensor&, bool, const RoundingDraw&) { no_low_precision(*this, "round_bf16"); }
void Backend::row_norms(const Tensor&, const Tensor&) { unsupported(*this, "row_norms", "DoRA, peft.dora"); }
void Backend::dora_weight(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  unsupported(*this, "dora_weight", "DoRA, peft.dora");
}
void Backend::dora_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  unsupported(*this, "dora_backward", "DoRA, peft.dora");
}

void Backend::dropout(const Tensor&, const Tensor&, float, const RoundingDraw&) {
  throw Error(str_cat("dropout: not implemented on the ", name(), " backend (peft.dropout)"));
}

// ---------------------------------------------------------------- optimizer ops
void Backend::sgd_step(const Tensor&, const Tensor&, const Tensor&, const OptimHyper&) { no_optimizer(*this, "sgd_step"); }
void Backend::adagrad_step(const Tensor&, const Tensor&, const Tensor&, const OptimHyper&) {
  no_optimizer(*this, "adagrad_step");
}
void Backend::rmsprop_step(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptimHyper&) {
  no_optimizer(*this, "rmsprop_step");
}
void Backend::adam_step(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptimHyper&) {
  no_optimizer(*this, "adam_step");
}
void Backend::lion_step(const Tensor&, const Tensor&, const Tensor&, const OptimHyper&) { no_optimizer(*this, "lion_step"); }
void Backend::adam_mini_step(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptimHyper&) {
  no_optimizer(*this, "adam_mini_step");
}
void Backend::adafactor_step(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptimHyper&) {
  no_optimizer(*this, "adafactor_step");
}
void Backend::sm3_step(const Tensor&, const Tensor&, const Tensor&, const OptimHyper&) { no_optimizer(*this, "sm3_step"); }
void Backend::came_step(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        const OptimHyper&) {
  no_optimizer(*this, "came_step");
}
void Backend::scale_transpose(const Tensor&, const Tensor&, float, bool) { no_optimizer(*this, "scale_transpose"); }
void Backend::axpy(const Tensor&, const Tensor&, float) { no_optimizer(*this, "axpy"); }
void Backend::muon_momentum(const Tensor&, const Tensor&, const Tensor&, const OptimHyper&) {
  no_optimizer(*this, "muon_momentum");
}
void Backend::newton_schulz_normalize(const Tensor&, const Tensor&) { no_optimizer(*this, "newton_schulz_normalize"); }
void Backend::decayed_update(const Tensor&, const Tensor&, float, float) { no_optimizer(*this, "decayed_update"); }
void Backend::leading_eigenvectors(const Tensor&, const Tensor&) { no_optimizer(*this, "leading_eigenvectors"); }
void Backend::gram_schmidt(const Tensor&, const Tensor&, const Tensor&) { no_optimizer(*this, "gram_schmidt"); }
void Backend::ldadam_rotate(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const OptimHyper&) {
  no_optimizer(*this, "ldadam_rotate");
}
void Backend::ldadam_adam(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptimHyper&) {
  no_optimizer(*this, "ldadam_adam");
}
void Backend::ldadam_apply(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool, const OptimHyper&) {
  no_optimizer(*this, "ldadam_apply");
}

}  // namespace loom
