#include "loom/nn/block.h"

#include <string>

#include "loom/core/error.h"
#include "loom/nn/attention.h"

namespace loom {

namespace {
Tensor view_of(const ParamLayout& layout, const Tensor& flat, const std::string& name) {
  const ParamSpec& spec = layout.find(name);
  return flat.view(spec.offset, spec.shape);
}
}  // namespace

BlockParams block_params_view(const ModelConfig& config, const ParamLayout& layout, const Tensor& flat, int64_t layer) {
  BlockParams b;
  AttentionParams& p = b.attention;
  MlpParams& m = b.mlp;
  auto v = [&](const std::string& name) { return view_of(layout, flat, name); };
  if (config.arch == ARCH_GPT2) {
    const std::string pre = "h." + std::to_string(layer) + ".";
    p.norm_w = v(pre + "ln_1.weight"), p.norm_b = v(pre + "ln_1.bias");
    p.qkv_w = v(pre + "attn.c_attn.weight"), p.qkv_b = v(pre + "attn.c_attn.bias");
    p.proj_w = v(pre + "attn.c_proj.weight"), p.proj_b = v(pre + "attn.c_proj.bias");
    m.norm_w = v(pre + "ln_2.weight"), m.norm_b = v(pre + "ln_2.bias");
    if (config.moe_layer(layer)) {
      m.moe = moe_params_view(config, layout, flat, layer);
    } else {
      m.fc_w = v(pre + "mlp.c_fc.weight"), m.fc_b = v(pre + "mlp.c_fc.bias");
      m.fc2_w = v(pre + "mlp.c_proj.weight"), m.fc2_b = v(pre + "mlp.c_proj.bias");
    }
  } else {
    const std::string pre = "model.layers." + std::to_string(layer) + ".";
    if (config.pre_norms()) p.norm_w = v(pre + "input_layernorm.weight");
    if (config.post_norms()) p.post_norm_w = v(pre + "post_attention_layernorm.weight");
    if (config.linear_layer(layer)) {
      const std::string a = pre + "linear_attn.";
      GatedDeltaNetParams& l = b.linear;
      l.norm_w = p.norm_w;
      l.qkvz_w = v(a + "in_proj_qkvz.weight"), l.ba_w = v(a + "in_proj_ba.weight");
      l.conv_w = v(a + "conv1d.weight"), l.a_log = v(a + "A_log"), l.dt_bias = v(a + "dt_bias");
      l.gate_norm_w = v(a + "norm.weight"), l.out_w = v(a + "out_proj.weight");
    } else if (config.mla()) {
      const std::string a = pre + "self_attn.";
      if (config.mla_q_rank > 0) {
        p.mla.q_a_w = v(a + "q_a_proj.weight"), p.mla.q_a_norm = v(a + "q_a_layernorm.weight");
        p.mla.q_b_w = v(a + "q_b_proj.weight");
      } else {
        p.mla.q_w = v(a + "q_proj.weight");
      }
      p.mla.kv_a_w = v(a + "kv_a_proj_with_mqa.weight"), p.mla.kv_norm = v(a + "kv_a_layernorm.weight");
      p.mla.kv_b_w = v(a + "kv_b_proj.weight");
    } else {
      p.qkv_w = v(pre + "self_attn.qkv_proj.weight");
      if (config.qkv_bias) p.qkv_b = v(pre + "self_attn.qkv_proj.bias");
      if (config.qk_norm) p.q_norm = v(pre + "self_attn.q_norm.weight"), p.k_norm = v(pre + "self_attn.k_norm.weight");
      if (config.attn_output_gate) p.gate_w = v(pre + "self_attn.gate_proj.weight");
      if (config.attn_sinks) p.sinks = v(pre + "self_attn.sinks");
    }
    if (!config.linear_layer(layer)) p.proj_w = v(pre + "self_attn.o_proj.weight");
    if (config.attn_out_bias && !config.linear_layer(layer)) p.proj_b = v(pre + "self_attn.o_proj.bias");
    if (config.pre_norms()) {
      m.norm_w = v(pre + (config.sandwich_norm ? "pre_feedforward_layernorm.weight" : "post_attention_layernorm.weight"));
    }
    if (config.post_norms()) m.post_norm_w = v(pre + "post_feedforward_layernorm.weight");
    if (config.moe_layer(layer)) {
      m.moe = moe_params_view(config, layout, flat, layer);
    } else {
      m.fc_w = v(pre + "mlp.gate_up_proj.weight");
      m.fc2_w = v(pre + "mlp.down_proj.weight");
    }
  }
  for (const LoraSite& site : lora_sites(config, layer)) {
    const LoraAdapter adapter{v(site.module + ".lora_A.weight"), v(site.module + ".lora_B.weight"), site.out_begin,
                              config.lora_dora ? v(site.module + ".lora_magnitude_vector") : Tensor{}};
    switch (site.linear) {
      case LORA_ON_QKV: p.qkv_lora.push_back(adapter); break;
      case LORA_ON_PROJ: p.proj_lora.push_back(adapter); break;
      case LORA_ON_FC: m.fc_lora.push_back(adapter); break;
      case LORA_ON_FC2: m.fc2_lora.push_back(adapter); break;
    }
  }
  return b;
}

namespace {
// Each field of a block's record in allocation order: the input, the attention sub-layer's,
// mid (the residual stream between them, kept by selective recompute), the MLP sub-layer's.
void block_saved_fields(const ModelConfig& config, const LayerPlan& plan, const SavedShape& shape, BlockSaved& s,
                        const SavedFieldFn& field) {
  LOOM_CHECK(shape.seq_shards >= 1 && shape.seq_len % shape.seq_shards == 0, "sequence parallel: train.seq_len (",
             shape.seq_len, ") must be a multiple of parallel.tp (", shape.seq_shards, ")");
  const bool model_parallel = shape.split_backward || shape.seq_shards > 1 || plan.attention == AttentionKind::ring ||
                              plan.attention == AttentionKind::ulysses || plan.mlp == MlpKind::moe;
  LOOM_CHECK(shape.keep == RECOMPUTE_NONE || !model_parallel, "activation checkpointing (train.recompute) with "
             "pipeline, sequence or context parallelism or MoE blocks is not supported yet");
  const int64_t B = shape.batch, Ts = shape.seq_len / shape.seq_shards, C = config.d_model;
  field(s.input, {B, Ts, C}, DTYPE_F32);
  if (plan.attention == AttentionKind::linear) {
    gated_delta_net_saved_fields(gated_delta_net_shape(config), B, Ts, C, s.linear, field, DTYPE_F32,
                                 plan.context_parallel);
  } else {
    attention_saved_fields(config, plan, shape, s.attention, field);
  }
  if (shape.keep != RECOMPUTE_FULL) field(s.mid, {B, Ts, C}, DTYPE_F32);
  mlp_saved_fields(config, plan, shape, s.mlp, field);
}

bool has_moe_record(const LayerPlan& plan, const SavedShape& shape) {
  return plan.mlp == MlpKind::moe && shape.keep == RECOMPUTE_NONE;
}
}  // namespace

BlockSaved allocate_block_saved(Allocator& allocator, const ModelConfig& config, const LayerPlan& plan,
                                const SavedShape& shape) {
  BlockSaved s;
  block_saved_fields(config, plan, shape, s, [&](Tensor& field, Shape dims, DType dtype) {
    field = Tensor::empty(allocator, std::move(dims), dtype, shape.category);
  });
  if (has_moe_record(plan, shape)) s.mlp.moe = allocate_moe_saved(allocator, config, shape.batch * shape.seq_len, shape.ep);
  return s;
}

int64_t block_saved_bytes(const ModelConfig& config, const LayerPlan& plan, const SavedShape& shape) {
  int64_t bytes = 0;
  BlockSaved s;
  block_saved_fields(config, plan, shape, s, [&](Tensor&, const Shape& dims, DType dtype) {
    int64_t n = static_cast<int64_t>(dtype_size(dtype));
    for (int64_t d : dims) n *= d;
    bytes += n;
  });
  return bytes + (has_moe_record(plan, shape) ? moe_saved_bytes(config, shape.batch * shape.seq_len, shape.ep) : 0);
}

std::array<Tensor, 4> block_linear_inputs(const ModelConfig& config, const BlockSaved& saved) {
  const bool pre = config.pre_norms();
  if (saved.linear.act.defined()) {  // a gated DeltaNet block: its projections' inputs (not of the attention kinds)
    return {saved.linear.norm.out, saved.linear.act, pre ? saved.mlp.norm.out : saved.mid, saved.mlp.act};
  }
  return {pre ? saved.attention.norm.out : saved.input, AttentionLayer::proj_input(saved.attention),
          pre ? saved.mlp.norm.out : saved.mid, saved.mlp.act};
}

Block::Block(const ModelConfig& config, int64_t layer, BlockParams params, BlockParams grads)
    : config_(config),
      layer_(layer),
      attention_(config, std::move(params.attention), std::move(grads.attention)),
      mlp_(config, std::move(params.mlp), std::move(grads.mlp)) {
  if (config.linear_layer(layer)) {
    linear_ = std::make_shared<GatedDeltaNet>(config, gated_delta_net_shape(config), std::move(params.linear),
                                                    std::move(grads.linear));
  }
  replan(choices_);
}

void Block::replan(const PlanChoices& choices) {
  plan_ = resolve_layer_plan(config_, layer_, choices);  // throws naming the keys: nothing changes then
  choices_ = choices;
  attention_.set_plan(plan_);
  mlp_.set_plan(plan_);
}

void Block::relink(const LayerLinks& links) {
  links_ = links;
  attention_.set_links(links);
  mlp_.set_links(links);
}

void Block::set_tensor_parallel(Communicator* tp, SequenceScratch* sequence) {
  PlanChoices c = choices_;
  c.tensor_parallel = tp != nullptr;
  c.sequence_parallel = sequence != nullptr;
  replan(c);
  LayerLinks links = links_;
  links.tp = tp, links.seq = sequence;
  relink(links);
  if (linear_) linear_->set_tensor_parallel(tp);
}

void Block::set_precision(const PrecisionPolicy& policy, BlockParams params16, LinearWorkspace* workspace) {
  PlanChoices c = choices_;
  choose_precision(c, policy);
  replan(c);  // MLA refuses low-precision projections by name
  LayerLinks links = links_;
  links.ws = workspace;
  relink(links);
  attention_.set_precision(policy, std::move(params16.attention));
  mlp_.set_precision(policy, std::move(params16.mlp));
}

void Block::set_context_parallel(ContextParallel* cp) {
  PlanChoices c = choices_;
  c.context = cp == nullptr ? PlanChoices::NONE : cp->ulysses ? PlanChoices::ULYSSES : PlanChoices::RING;
  replan(c);
  LayerLinks links = links_;
  links.cp = cp;
  relink(links);
  if (linear_) linear_->set_context_parallel(cp);
}

void Block::set_flash_attention(bool on) {
  PlanChoices c = choices_;
  c.flash = on;
  replan(c);
}

void Block::set_recompute(RecomputePolicy policy) {
  PlanChoices c = choices_;
  c.recompute = policy;
  replan(c);
}

BlockSaved with_kept(const BlockSaved& shared, const BlockSaved& kept, RecomputePolicy policy) {
  BlockSaved r = shared;
  r.input = kept.input;
  r.attention.docs = kept.attention.docs;
  r.attention.lora_dropout = kept.attention.lora_dropout, r.mlp.lora_dropout = kept.mlp.lora_dropout;
  if (policy == RECOMPUTE_SELECTIVE) {
    r.attention.qkv = kept.attention.qkv, r.attention.attn = kept.attention.attn, r.mid = kept.mid;
    r.mlp.fc = kept.mlp.fc;
    if (kept.attention.lse.defined()) r.attention.lse = kept.attention.lse;  // FlashAttention
  }
  return r;
}

void Block::recompute(Backend& backend, const BlockSaved& kept, RecomputePolicy policy, BlockSaved& full,
                      const Tensor& out_scratch) {
  LOOM_CHECK(policy != RECOMPUTE_NONE && !is_moe() && !config_.mla() && !linear_ && links_.tp == nullptr &&
                 links_.cp == nullptr,
             "block recompute: a policy that recomputes, on a block without MoE, MLA, linear attention or model "
             "parallelism");
  const int64_t B = kept.input.dim(0), T = kept.input.dim(1), C = config_.d_model;
  BlockSaved& r = full;
  r = with_kept(full, kept, policy);
  if (policy == RECOMPUTE_FULL) {
    const bool was = mlp_.recording();
    mlp_.set_recording(false);
    forward(backend, r, out_scratch.view(0, {B, T, C}));
    mlp_.set_recording(was);
    return;
  }
  // Selective: the GEMM outputs and the residual stream are kept; norms, probabilities and the
  // activation come again from them (with FlashAttention lse is kept: no attention to rerun).
  attention_.recompute_selective(backend, r.input, r.attention, out_scratch);
  mlp_.recompute_selective(backend, r.mid, r.mlp);
}

void Block::forward(Backend& backend, BlockSaved& s, const Tensor& out) {
  if (linear_) linear_->forward(backend, s.input, s.linear, s.mid);
  else attention_.forward(backend, s.input, s.attention, s.mid);
  mlp_.forward(backend, s.mid, s.mlp, out);
}

void Block::forward_rows(Backend& backend, BlockSaved& s, const Tensor& out, const std::vector<int64_t>& positions,
                         DecodeCache& cache, int64_t layer) const {
  LOOM_CHECK(links_.tp == nullptr, "decoding a tensor-parallel block slice is not supported");
  LOOM_CHECK(static_cast<int64_t>(positions.size()) == s.input.dim(0), "forward_rows: ", positions.size(),
             " positions for ", s.input.dim(0), " rows");
  if (linear_) linear_->forward_rows(backend, s.input, s.mid, cache, layer);
  else attention_.forward_rows(backend, s.input, s.attention, s.mid, positions, cache, layer);
  mlp_.forward_rows(backend, s.mid, s.mlp, out);
}

void Block::backward(Backend& backend, const BlockSaved& s, const Tensor& d_residual, BlockScratch& k,
                     BackwardPart part, const ResidualDy16& r16) {
  // d_residual: d(out) -> d(mid) through the MLP sub-layer and its residual path, then -> d(input).
  // d(mid) in bf16 for the attention's proj where its plan reads it so, written by norm2's backward.
  const Tensor mid16 = residual_dy16(plan_, LINEAR_ATTN_OUT, part, links_.ws, d_residual.shape());
  mlp_.backward(backend, s.mid, s.mlp, d_residual, k, part, {r16.in, mid16});
  if (linear_) {
    LOOM_CHECK(part == BACKWARD_ALL, "a gated DeltaNet block's backward is not split into input and weight passes "
               "(zero-bubble pipeline schedules) yet");
    linear_->backward(backend, s.input, s.linear, d_residual);
    if (r16.out.defined()) backend.cast(d_residual, r16.out);  // its norm's backward writes no bf16 copy
    return;
  }
  attention_.backward(backend, s.input, s.attention, d_residual, k, part, {mid16, r16.out});
}

}  // namespace loom
