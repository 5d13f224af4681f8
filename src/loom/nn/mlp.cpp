#include "loom/nn/mlp.h"

#include "loom/core/error.h"

namespace loom {

void mlp_saved_fields(const ModelConfig& config, const LayerPlan& plan, const SavedShape& shape, MlpSaved& s,
                      const SavedFieldFn& field) {
  const int64_t B = shape.batch, T = shape.seq_len, C = config.d_model;
  const int64_t Ts = T / shape.seq_shards;  // the residual stream's positions on this rank
  const bool dense = plan.mlp == MlpKind::dense;
  if (shape.keep == RECOMPUTE_FULL) return;
  const DType fc_dtype = plan.fc_bf16 ? DTYPE_BF16 : DTYPE_F32;
  if (shape.keep == RECOMPUTE_SELECTIVE) {
    field(s.fc, {B, T, config.mlp_in_width()}, fc_dtype);
    return;
  }
  if (config.pre_norms()) {
    field(s.norm.out, {B, Ts, C}, saved_dtype(plan, LINEAR_MLP_IN));
    if (!config.rmsnorm()) field(s.norm.mean, {B, Ts}, DTYPE_F32);
    field(s.norm.rstd, {B, Ts}, DTYPE_F32);
  }
  // The output's norm (dense only): its input (fc2's output), not its output.
  if (config.post_norms()) {
    field(s.post_in, {B, Ts, C}, DTYPE_F32);
    field(s.post.rstd, {B, Ts}, DTYPE_F32);
  }
  if (!dense) return;
  field(s.fc, {B, T, config.mlp_in_width()}, fc_dtype);
  field(s.act, {B, T, config.d_ff}, saved_dtype(plan, LINEAR_MLP_OUT));
  if (shape.split_backward) {
    field(s.dy_fc2, {B, T, C}, DTYPE_F32);
    field(s.dy_fc, {B, T, config.mlp_in_width()}, DTYPE_F32);
  }
}

void MlpLayer::set_precision(const PrecisionPolicy& policy, MlpParams params16) {
  params16_ = std::move(params16);
  fc_ = LinearLayer(linear_setup(policy, LINEAR_MLP_IN, true), fc_.base());
  fc2_ = LinearLayer(linear_setup(policy, LINEAR_MLP_OUT, true), fc2_.base());
}

void MlpLayer::activation(Backend& backend, const MlpSaved& s) const {
  // From s.fc's dtype (bf16: LayerPlan::fc_bf16, widened) into s.act's (kept in bf16:
  // LayerPlan::saved_bf16, the kernel rounds what it writes).
  if (config_.gated_mlp()) backend.glu_forward(s.fc, s.act, config_.gate_activation);
  else backend.gelu_forward(s.fc, s.act);
}

void MlpLayer::forward(Backend& backend, const Tensor& mid, MlpSaved& s, const Tensor& out) {
  const MlpParams& p = params_;
  const MlpParams& q = params16_;
  // OLMo 2: mid as it is, the output normed; Gemma: both normed (below).
  const bool pre = config_.pre_norms(), post = config_.post_norms();
  if (pre) norm_forward_saved(backend, config_, mid, p.norm_w, p.norm_b, s.norm);
  if (is_moe()) {
    forward_moe(backend, mid, s, out);
    return;
  }
  const int64_t T = s.fc.dim(1);
  const Tensor input = pre ? links_.whole(backend, s.norm.out, T) : mid;  // (sequence parallel: gathered)
  if (plan_.fc_gelu) {  // fc's output and its GELU from one GEMM where the backend fuses them
    fc_.forward_gelu(backend, input, p.fc_w, q.fc_w, p.fc_b, s.fc, s.act, links_.ws);
  } else {
    adapted_linear_forward(backend, fc_, input, p.fc_w, q.fc_w, p.fc_b, s.fc, fc_lora(s), links_.ws);
    activation(backend, s);
  }
  if (post) {  // out = mid + norm(fc2(act)) (a whole layer: no tp)
    adapted_linear_forward(backend, fc2_, s.act, p.fc2_w, q.fc2_w, p.fc2_b, s.post_in, fc2_lora(s), links_.ws);
    post_norm_residual(backend, config_, s.post_in, p.post_norm_w, Tensor{}, s.post, mid, out);
    return;
  }
  // out = mid + fc2(act); g: the hidden slices' partial outputs (and LoRA's terms) summed over tp.
  residual_linear_forward(backend, links_, fc2_, s.act, p.fc2_w, q.fc2_w, p.fc2_b, mid, out, fc2_lora(s));
}

void MlpLayer::forward_moe(Backend& backend, const Tensor& mid, MlpSaved& s, const Tensor& out) {
  LOOM_CHECK(links_.seq == nullptr && links_.cp == nullptr && moe_scratch_ != nullptr,
             "an MoE block runs without sequence or context parallelism (and needs its scratch)");
  const int64_t T = s.norm.out.dim(1), N = s.norm.out.dim(0) * T, C = config_.d_model;
  backend.copy(mid, out);  // out = mid + MoE(norm2)
  // Under tensor parallelism (not sequence parallel) the block input is whole on every rank
  // of the group: each computes the whole MoE (its parameters are replicated), no reduction.
  moe_forward(backend, config_, params_.moe, s.norm.out.view(0, {N, C}), s.moe, *moe_scratch_, out.view(0, {N, C}),
              T, ep_);
  if (recording_) {
    MoeStats& m = moe_stats_;
    m.load.resize(static_cast<size_t>(config_.moe_experts), 0.0);
    for (int64_t e = 0; e < config_.moe_experts; ++e) m.load[e] += static_cast<double>(s.moe.load[e]);
    m.tokens += N, m.dropped += s.moe.dropped, m.dispatched += s.moe.dispatched, ++m.micro_batches;
    m.aux += s.moe.aux, m.seq_aux += s.moe.seq_aux, m.z += s.moe.z, m.entropy += s.moe.entropy;
  }
}

void MlpLayer::forward_rows(Backend& backend, const Tensor& mid, MlpSaved& s, const Tensor& out) const {
  const MlpParams& p = params_;
  const bool pre = config_.pre_norms(), post = config_.post_norms();
  if (pre) norm_forward(backend, config_, mid, p.norm_w, p.norm_b, s.norm.out, s.norm.mean, s.norm.rstd);
  if (is_moe()) {  // one position per sequence: n tokens routed (statistics are not recorded)
    const int64_t n = mid.dim(0), C = config_.d_model;
    backend.copy(mid, out);
    moe_forward(backend, config_, p.moe, s.norm.out.view(0, {n, C}), s.moe, *moe_scratch_, out.view(0, {n, C}), 1);
    return;
  }
  const Tensor& input = pre ? s.norm.out : mid;
  fc_.forward_plain(backend, input, p.fc_w, p.fc_b, s.fc, 0.0f, links_.ws);
  lora_forward(backend, input, p.fc_lora, config_.lora_scale(), s.fc, links_.ws, {}, p.fc_w);
  activation(backend, s);
  if (post) {  // out = mid + norm(fc2(act))
    const Tensor y = s.post_in.view(0, mid.shape());
    fc2_.forward_plain(backend, s.act, p.fc2_w, p.fc2_b, y, 0.0f, links_.ws);
    lora_forward(backend, s.act, p.fc2_lora, config_.lora_scale(), y, links_.ws, {}, p.fc2_w);
    post_norm_residual(backend, config_, y, p.post_norm_w, Tensor{}, s.post, mid, out);
    return;
  }
  backend.copy(mid, out);
  fc2_.forward_plain(backend, s.act, p.fc2_w, p.fc2_b, out, 1.0f, links_.ws);
  lora_forward(backend, s.act, p.fc2_lora, config_.lora_scale(), out, links_.ws, {}, p.fc2_w);
}

void MlpLayer::backward(Backend& backend, const Tensor& mid, const MlpSaved& s, const Tensor& d_residual,
                        BlockScratch& k, BackwardPart part, const ResidualDy16& r16) {
  const MlpParams& p = params_;
  const MlpParams& g = grads_;
  const MlpParams& q = params16_;
  if (is_moe()) {
    if (part == BACKWARD_WEIGHT) return;  // an MoE's weight gradients were computed in the input pass
    // d(norm2 output) = the MoE backward (router, experts and shared experts at once).
    const int64_t T = s.norm.out.dim(1), N = s.norm.out.dim(0) * T, C = config_.d_model;
    moe_backward(backend, config_, p.moe, g.moe, s.norm.out.view(0, {N, C}), s.moe, *moe_scratch_,
                 d_residual.view(0, {N, C}), k.d_norm.view(0, {N, C}), loss_weight_, T, ep_);
    norm_residual_backward(backend, config_, links_, k, false, d_residual, mid, p.norm_w, s.norm, g.norm_w, g.norm_b,
                           r16.out);
    return;
  }
  const int64_t T = s.fc.dim(1);
  // Sequence parallel: gradients arrive on the shard and are gathered before the row-parallel
  // layer's backward (g's backward); the norm's output is gathered again for the weight gradient.
  const auto whole = [&](const Tensor& shard) { return links_.whole(backend, shard, T); };
  const InputPass pass = input_pass(backend, part, s.dy_fc2);
  // LoRA's adapters (zero-bubble schedules' split backward): their small gradients are computed
  // with the input gradient, in the input pass; the weight pass is the frozen base's, which has none.
  if (part == BACKWARD_WEIGHT) {  // the weight gradients from the kept output gradients
    fc2_.backward(backend, s.act, p.fc2_w, q.fc2_w, s.dy_fc2, Tensor{}, g.fc2_w, Tensor{}, links_.ws);
    fc_.backward(backend, config_.pre_norms() ? whole(s.norm.out) : mid, p.fc_w, q.fc_w, s.dy_fc, Tensor{}, g.fc_w,
                 Tensor{}, links_.ws);
    return;
  }
  // Output norm: d(fc2 output) through it from d(out) (a whole layer: no tp).
  const bool pre = config_.pre_norms(), post = config_.post_norms();
  if (post) norm_backward(backend, config_, d_residual, s.post_in, p.post_norm_w, Tensor{}, s.post.rstd, k.d_tmp, g.post_norm_w, Tensor{});
  const Tensor dy_out = post ? k.d_tmp.view(0, d_residual.shape()) : whole(d_residual);
  pass.keep(dy_out, s.dy_fc2);
  // r16.in: d(out) rounded by the norm backward that finalised it (LayerPlan::fc2_dy_bf16), for fc2's GEMMs.
  LOOM_CHECK(!r16.in.defined() || (!post && links_.seq == nullptr), "mlp backward: a bf16 d(out) for fc2 with an "
             "output norm or sequence parallelism");
  // d(fc output): in bf16 where the plan says (fc's GEMMs read it as it is), else fp32.
  const bool dy16 = plan_.mlp_in_dy_bf16 && part == BACKWARD_ALL && links_.ws != nullptr;
  const Tensor d_fc = dy16 ? links_.ws->bf16(LinearWorkspace::Y, k.d_fc.shape()) : k.d_fc;
  // fused: fc2's input-gradient GEMM writes d(fc output) through the GELU at once (k.d_act its scratch)
  const bool fused = plan_.fc2_dgelu && dy16;
  const GeluBackward gelu{s.fc, k.d_act};
  adapted_linear_backward(backend, fc2_, s.act, p.fc2_w, q.fc2_w, dy_out, fused ? d_fc : k.d_act, pass.dw(g.fc2_w),
                          g.fc2_b, fc2_lora(s), g.fc2_lora, links_.ws, r16.in, fused ? &gelu : nullptr);
  if (!fused) {
    if (config_.gated_mlp()) backend.glu_backward(s.fc, k.d_act, d_fc, config_.gate_activation);
    else backend.gelu_backward(s.fc, k.d_act, d_fc);
  }
  pass.keep(d_fc, s.dy_fc);
  const Tensor input = pre ? whole(s.norm.out) : mid;
  adapted_linear_backward(backend, fc_, input, p.fc_w, q.fc_w, d_fc, k.d_norm, pass.dw(g.fc_w), g.fc_b, fc_lora(s),
                          g.fc_lora, links_.ws);
  if (!pre) {  // d(mid) = d(out) + the MLP's d(mid)
    backend.add_inplace(d_residual, k.d_norm.view(0, d_residual.shape()));
    if (r16.out.defined()) backend.cast(d_residual, r16.out);  // (no norm to write it: plan rules leave this out)
    return;
  }
  // f: the hidden slices' partial d(norm2 output), then through norm2 into d(mid) (and its bf16 rounding).
  norm_residual_backward(backend, config_, links_, k, true, d_residual, mid, p.norm_w, s.norm, g.norm_w, g.norm_b,
                         r16.out);
}

void MlpLayer::recompute_selective(Backend& backend, const Tensor& mid, MlpSaved& s) const {
  norm_forward_saved(backend, config_, mid, params_.norm_w, params_.norm_b, s.norm);
  activation(backend, s);
}

}  // namespace loom
