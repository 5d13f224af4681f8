#include "loom/nn/layer.h"

#include "loom/core/error.h"

#include "loom/nn/mla.h"
#include "loom/nn/sequence_parallel.h"

namespace loom {

void norm_forward(Backend& backend, const ModelConfig& config, const Tensor& x, const Tensor& weight,
                  const Tensor& bias, const Tensor& out, const Tensor& mean, const Tensor& rstd) {
  if (config.rmsnorm()) backend.rmsnorm_forward(x, weight, out, rstd, config.norm_eps);
  else backend.layernorm_forward(x, weight, bias, out, mean, rstd, config.norm_eps);
}

void norm_backward(Backend& backend, const ModelConfig& config, const Tensor& dout, const Tensor& x,
                   const Tensor& weight, const Tensor& mean, const Tensor& rstd, const Tensor& dx,
                   const Tensor& dweight, const Tensor& dbias, bool accumulate, const Tensor& dx16) {
  if (config.rmsnorm()) backend.rmsnorm_backward(dout, x, weight, rstd, dx, dweight, accumulate, dx16);
  else backend.layernorm_backward(dout, x, weight, mean, rstd, dx, dweight, dbias, accumulate, dx16);
}

Tensor LayerLinks::whole(Backend& backend, const Tensor& shard, int64_t seq_len) const {
  if (seq == nullptr) return shard;
  const Tensor full = seq->full.view(0, {shard.dim(0), seq_len, shard.dim(2)});
  sequence_all_gather(backend, *tp, shard, full, seq->staging);
  return full;
}

void LayerLinks::reduce(Backend& backend, const Tensor& partial, const Tensor& into) const {
  if (seq != nullptr) sequence_reduce_scatter(backend, *tp, partial, into, seq->staging);
  else tp->all_reduce(into);
}

Tensor saved_target(const Tensor& field, LinearWorkspace* ws) {
  if (field.dtype() == DTYPE_F32) return field;
  LOOM_CHECK(field.dtype() == DTYPE_BF16 && ws != nullptr, "a saved activation in ", dtype_name(field.dtype()),
             " needs bf16 and the linear layers' workspace");
  return ws->f32(LinearWorkspace::S, field.shape());
}

void store_saved(Backend& backend, const Tensor& target, const Tensor& field) {
  if (field.dtype() != target.dtype()) backend.cast(target, field);
}

Tensor saved_f32(Backend& backend, const Tensor& field, LinearWorkspace* ws) {
  if (field.dtype() == DTYPE_F32) return field;
  const Tensor wide = saved_target(field, ws);
  backend.cast(field, wide);
  return wide;
}

void norm_forward_saved(Backend& backend, const ModelConfig& config, const Tensor& x, const Tensor& weight,
                        const Tensor& bias, const NormSaved& norm) {
  norm_forward(backend, config, x, weight, bias, norm.out, norm.mean, norm.rstd);
}


namespace {
const LoraAdapters kNoAdapters;
const LoraAdapters& adapters_of(const LoraTerm& lora) { return lora.adapters != nullptr ? *lora.adapters : kNoAdapters; }
}  // namespace

void adapted_linear_forward(Backend& backend, LinearLayer& layer, const Tensor& x, const Tensor& w, const Tensor& w16,
                            const Tensor& b, const Tensor& y, const LoraTerm& lora, LinearWorkspace* ws) {
  const LoraAdapters& adapters = adapters_of(lora);
  const LoraWeight lw = lora_layer_weight(backend, w, w16, adapters, lora.scale, lora.dropout, ws);
  layer.forward(backend, x, lw.w, w16, b, y, 0.0f, ws);
  lora_forward(backend, x, adapters, lora.scale, y, ws, lora.dropout, w, lw.dora_merged);
}

void adapted_linear_backward(Backend& backend, LinearLayer& layer, const Tensor& x, const Tensor& w, const Tensor& w16,
                             const Tensor& dy, const Tensor& dx, const Tensor& dw, const Tensor& db,
                             const LoraTerm& lora, const LoraAdapters& grads, LinearWorkspace* ws,
                             const Tensor& dy16, const GeluBackward* gelu) {
  const LoraAdapters& adapters = adapters_of(lora);
  LOOM_CHECK(gelu == nullptr || adapters.empty(), "linear layer: a GELU's input gradient from the GEMM with LoRA "
             "adapters (their term adds to the layer's input gradient)");
  const LoraWeight lw = lora_layer_weight(backend, w, w16, adapters, lora.scale, lora.dropout, ws);
  layer.backward(backend, x, lw.w, w16, dy, dx, dw, db, ws, dy16, gelu);
  lora_backward(backend, x, adapters, grads, lora.scale, dy, dx, ws, lora.dropout, w, lw.dora_merged);
}

void residual_linear_forward(Backend& backend, const LayerLinks& links, LinearLayer& layer, const Tensor& x,
                             const Tensor& w, const Tensor& w16, const Tensor& b, const Tensor& residual,
                             const Tensor& out, const LoraTerm& lora) {
  const LoraAdapters& adapters = adapters_of(lora);
  const LoraWeight lw = lora_layer_weight(backend, w, w16, adapters, lora.scale, lora.dropout, links.ws);
  if (links.tp == nullptr) {
    layer.forward_residual(backend, x, lw.w, w16, b, residual, out, links.ws);  // out = residual + layer(x)
    lora_forward(backend, x, adapters, lora.scale, out, links.ws, lora.dropout, w, lw.dora_merged);
    return;
  }
  const int64_t C = out.dim(2);
  const Tensor y = links.seq != nullptr ? links.seq->full.view(0, {x.dim(0), x.dim(1), C}) : out;
  layer.forward(backend, x, lw.w, w16, links.tp->rank() == 0 ? b : Tensor{}, y, 0.0f, links.ws);
  // This rank's partial term, summed with the layer's.
  lora_forward(backend, x, adapters, lora.scale, y, links.ws, lora.dropout, w, lw.dora_merged);
  links.reduce(backend, y, out);
  backend.add_inplace(out, residual);
}

BlockScratch allocate_block_scratch(Allocator& allocator, const ModelConfig& config, int64_t batch, int64_t seq_len) {
  const int64_t B = batch, T = seq_len, C = config.d_model;
  auto ws = [&](Shape shape) { return Tensor::empty(allocator, std::move(shape), DTYPE_F32, MEM_WORKSPACE); };
  BlockScratch s;
  s.d_norm = ws({B, T, C});
  s.d_tmp = ws({B, T, C});
  // MLA: a width w with B T w >= mla_scratch_floats(B, T) (B T x floats and T more).
  const int64_t mla_width = config.mla() ? mla_scratch_floats(config, 1, 1) : 0;
  s.d_qkv = ws({B, T, config.mla() ? mla_width : config.qkv_width()});
  s.d_attn = ws({B, T, config.attn_width()});
  s.d_fc = ws({B, T, config.mlp_in_width()});
  s.d_act = ws({B, T, config.d_ff});
  return s;
}

InputPass input_pass(Backend& backend, BackwardPart part, const Tensor& kept) {
  LOOM_CHECK(part == BACKWARD_ALL || kept.defined(), "block backward: the ",
             part == BACKWARD_WEIGHT ? "weight" : "input", " pass needs activations allocated for a split backward");
  return {backend, part == BACKWARD_INPUT};
}

void post_norm_residual(Backend& backend, const ModelConfig& config, const Tensor& y, const Tensor& weight,
                        const Tensor& bias, const NormSaved& norm, const Tensor& residual, const Tensor& out) {
  norm_forward(backend, config, y, weight, bias, out, norm.mean, norm.rstd);
  backend.add_inplace(out, residual);
}

void norm_residual_backward(Backend& backend, const ModelConfig& config, const LayerLinks& links, BlockScratch& k,
                            bool partial, const Tensor& d_residual, const Tensor& x, const Tensor& weight,
                            const NormSaved& norm, const Tensor& dweight, const Tensor& dbias,
                            const Tensor& d_residual16) {
  // Sequence parallel: the partial gradient (whole sequence, k.d_norm) is reduced onto the
  // shard in d_tmp. The norm's input gradient is added into d_residual by the norm's backward
  // itself (accumulate: one pass over the residual stream's gradient, no separate add).
  const bool sp = links.seq != nullptr;
  const Tensor dn = sp ? k.d_tmp.view(0, d_residual.shape()) : k.d_norm;
  if (partial && sp) sequence_reduce_scatter(backend, *links.tp, k.d_norm, dn, links.seq->staging);
  else if (partial && links.tp != nullptr) links.tp->all_reduce(k.d_norm);
  norm_backward(backend, config, dn, x, weight, norm.mean, norm.rstd, d_residual, dweight, dbias, true, d_residual16);
}

Tensor residual_dy16(const LayerPlan& reader, LinearKind kind, BackwardPart part, LinearWorkspace* ws,
                     const Shape& shape) {
  LOOM_CHECK(kind == LINEAR_ATTN_OUT || kind == LINEAR_MLP_OUT, "residual_dy16: the residual stream's gradient is "
             "the output gradient of a block's output layers only");
  const bool reads = kind == LINEAR_ATTN_OUT ? reader.proj_dy_bf16 : reader.fc2_dy_bf16;
  if (!reads || part != BACKWARD_ALL || ws == nullptr) return {};
  return ws->bf16(LinearWorkspace::O, shape);
}

}  // namespace loom
