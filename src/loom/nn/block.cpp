#include "loom/nn/block.h"

#include <algorithm>
#include <string>

#include "loom/core/error.h"
#include "loom/nn/attention.h"
#include "loom/nn/sequence_parallel.h"

namespace loom {

namespace {
Tensor view_of(const ParamLayout& layout, const Tensor& flat, const std::string& name) {
  const ParamSpec& spec = layout.find(name);
  return flat.view(spec.offset, spec.shape);
}
}  // namespace

BlockParams block_params_view(const ModelConfig& config, const ParamLayout& layout, const Tensor& flat, int64_t layer) {
  BlockParams p;
  auto v = [&](const std::string& name) { return view_of(layout, flat, name); };
  if (config.arch == ARCH_GPT2) {
    const std::string pre = "h." + std::to_string(layer) + ".";
    p.norm1_w = v(pre + "ln_1.weight"), p.norm1_b = v(pre + "ln_1.bias");
    p.qkv_w = v(pre + "attn.c_attn.weight"), p.qkv_b = v(pre + "attn.c_attn.bias");
    p.proj_w = v(pre + "attn.c_proj.weight"), p.proj_b = v(pre + "attn.c_proj.bias");
    p.norm2_w = v(pre + "ln_2.weight"), p.norm2_b = v(pre + "ln_2.bias");
    if (config.moe_layer(layer)) {
      p.moe = moe_params_view(config, layout, flat, layer);
    } else {
      p.fc_w = v(pre + "mlp.c_fc.weight"), p.fc_b = v(pre + "mlp.c_fc.bias");
      p.fc2_w = v(pre + "mlp.c_proj.weight"), p.fc2_b = v(pre + "mlp.c_proj.bias");
    }
  } else {
    const std::string pre = "model.layers." + std::to_string(layer) + ".";
    p.norm1_w = v(pre + "input_layernorm.weight");
    if (config.mla()) {
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
    }
    p.proj_w = v(pre + "self_attn.o_proj.weight");
    p.norm2_w = v(pre + "post_attention_layernorm.weight");
    if (config.moe_layer(layer)) {
      p.moe = moe_params_view(config, layout, flat, layer);
    } else {
      p.fc_w = v(pre + "mlp.gate_up_proj.weight");
      p.fc2_w = v(pre + "mlp.down_proj.weight");
    }
  }
  return p;
}

namespace {
// The fields of a BlockSaved that allocate_block_saved allocates, with their shapes (fp32), in
// allocation order; an MoE block's MoeSaved is added by the callers.
std::vector<std::pair<Tensor BlockSaved::*, Shape>> block_saved_fields(const ModelConfig& config, int64_t batch,
                                                                      int64_t seq_len, bool split_backward,
                                                                      int64_t seq_shards, bool context_parallel,
                                                                      bool moe, RecomputePolicy keep, bool flash) {
  LOOM_CHECK(seq_shards >= 1 && seq_len % seq_shards == 0, "sequence parallel: train.seq_len (", seq_len,
             ") must be a multiple of parallel.tp (", seq_shards, ")");
  const int64_t B = batch, T = seq_len, C = config.d_model, H = config.n_head;
  const int64_t Ts = seq_len / seq_shards;  // the residual stream's positions on this rank
  std::vector<std::pair<Tensor BlockSaved::*, Shape>> f;
  f.push_back({&BlockSaved::input, {B, Ts, C}});
  LOOM_CHECK(!config.mla() || (seq_shards == 1 && !context_parallel), "model.mla_kv_rank > 0 (MLA) is not supported "
             "with sequence parallelism (parallel.sequence_parallel) or context parallelism (parallel.cp > 1)");
  LOOM_CHECK(!config.mla() || !flash, "train.flash_attention is not supported with model.mla_kv_rank > 0 (MLA computes "
             "its own attention)");
  if (keep != RECOMPUTE_NONE) {  // activation checkpointing (no model parallelism, no MoE)
    LOOM_CHECK(!split_backward && seq_shards == 1 && !context_parallel && !moe,
               "activation checkpointing (train.recompute) with pipeline, sequence or context parallelism or MoE "
               "blocks is not supported yet");
    if (keep == RECOMPUTE_SELECTIVE) {  // (sizes only for MLA: its blocks do not recompute)
      if (!config.mla()) f.push_back({&BlockSaved::qkv, {B, T, config.qkv_width()}});
      f.push_back({&BlockSaved::attn, {B, T, config.attn_width()}});
      if (flash) f.push_back({&BlockSaved::lse, {B, H, T}});  // the attention is not recomputed
      f.push_back({&BlockSaved::mid, {B, Ts, C}});
      f.push_back({&BlockSaved::fc, {B, T, config.mlp_in_width()}});
    }
    return f;
  }
  f.push_back({&BlockSaved::norm1, {B, Ts, C}});
  if (!config.rmsnorm()) f.push_back({&BlockSaved::mean1, {B, Ts}});
  f.push_back({&BlockSaved::rstd1, {B, Ts}});
  if (config.mla()) {
    const int64_t dq = config.mla_q_rank, dc = config.mla_kv_rank;
    if (dq > 0) {
      f.push_back({&BlockSaved::mla_qa, {B, T, dq}});
      f.push_back({&BlockSaved::mla_qa_norm, {B, T, dq}});
      f.push_back({&BlockSaved::mla_qa_rstd, {B, T}});
    }
    f.push_back({&BlockSaved::mla_q, {B, T, H * config.mla_qk()}});
    f.push_back({&BlockSaved::mla_c, {B, T, dc}});
    f.push_back({&BlockSaved::mla_c_norm, {B, T, dc}});
    f.push_back({&BlockSaved::mla_c_rstd, {B, T}});
    f.push_back({&BlockSaved::mla_kr, {B, T, config.mla_rope_dim}});
    f.push_back({&BlockSaved::mla_kv, {B, T, H * (config.mla_nope() + config.mla_v())}});
  } else {
    f.push_back({&BlockSaved::qkv, {B, T, config.qkv_width()}});
  }
  // FlashAttention or ring attention keep the rows' log-sum-exp; Ulysses keeps its own record.
  if (context_parallel || flash) f.push_back({&BlockSaved::lse, {B, H, T}});
  else f.push_back({&BlockSaved::probs, {B, H, T, T}});
  f.push_back({&BlockSaved::attn, {B, T, config.attn_width()}});
  f.push_back({&BlockSaved::mid, {B, Ts, C}});
  f.push_back({&BlockSaved::norm2, {B, Ts, C}});
  if (!config.rmsnorm()) f.push_back({&BlockSaved::mean2, {B, Ts}});
  f.push_back({&BlockSaved::rstd2, {B, Ts}});
  if (!moe) {
    f.push_back({&BlockSaved::fc, {B, T, config.mlp_in_width()}});
    f.push_back({&BlockSaved::act, {B, T, config.d_ff}});
  }
  if (split_backward) {
    if (!moe) f.push_back({&BlockSaved::dy_fc2, {B, T, C}});
    if (!moe) f.push_back({&BlockSaved::dy_fc, {B, T, config.mlp_in_width()}});
    f.push_back({&BlockSaved::dy_proj, {B, T, C}});
    // MLA: its projections' weight gradients are computed in the input pass (nothing kept).
    if (!config.mla()) f.push_back({&BlockSaved::dy_qkv, {B, T, config.qkv_width()}});
  }
  return f;
}
}  // namespace

BlockSaved allocate_block_saved(Allocator& allocator, const ModelConfig& config, int64_t batch, int64_t seq_len,
                                bool split_backward, int64_t seq_shards, bool context_parallel, bool moe,
                                RecomputePolicy keep, MemCategory category, int ep, bool flash) {
  BlockSaved s;
  for (auto& [field, shape] : block_saved_fields(config, batch, seq_len, split_backward, seq_shards, context_parallel,
                                                 moe, keep, flash)) {
    s.*field = Tensor::empty(allocator, std::move(shape), DTYPE_F32, category);
  }
  if (moe && keep == RECOMPUTE_NONE) s.moe = allocate_moe_saved(allocator, config, batch * seq_len, ep);
  return s;
}

int64_t block_saved_bytes(const ModelConfig& config, int64_t batch, int64_t seq_len, bool split_backward,
                          int64_t seq_shards, bool context_parallel, bool moe, RecomputePolicy keep, int ep,
                          bool flash) {
  int64_t floats = 0;
  for (const auto& [field, shape] : block_saved_fields(config, batch, seq_len, split_backward, seq_shards,
                                                       context_parallel, moe, keep, flash)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    floats += n;
  }
  return 4 * floats + (moe && keep == RECOMPUTE_NONE ? moe_saved_bytes(config, batch * seq_len, ep) : 0);
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

void norm_forward(Backend& backend, const ModelConfig& config, const Tensor& x, const Tensor& weight,
                  const Tensor& bias, const Tensor& out, const Tensor& mean, const Tensor& rstd) {
  if (config.rmsnorm()) backend.rmsnorm_forward(x, weight, out, rstd, config.norm_eps);
  else backend.layernorm_forward(x, weight, bias, out, mean, rstd, config.norm_eps);
}

void norm_backward(Backend& backend, const ModelConfig& config, const Tensor& dout, const Tensor& x,
                   const Tensor& weight, const Tensor& mean, const Tensor& rstd, const Tensor& dx,
                   const Tensor& dweight, const Tensor& dbias) {
  if (config.rmsnorm()) backend.rmsnorm_backward(dout, x, weight, rstd, dx, dweight);
  else backend.layernorm_backward(dout, x, weight, mean, rstd, dx, dweight, dbias);
}

Block::Block(const ModelConfig& config, int64_t layer, BlockParams params, BlockParams grads)
    : config_(config), params_(std::move(params)), grads_(std::move(grads)), layer_(layer) {
  replan(choices_);
}

void Block::replan(const PlanChoices& choices) {
  plan_ = resolve_layer_plan(config_, layer_, choices);  // throws naming the keys: nothing changes then
  choices_ = choices;
}

void Block::set_tensor_parallel(Communicator* tp, SequenceScratch* sequence) {
  PlanChoices c = choices_;
  c.tensor_parallel = tp != nullptr;
  c.sequence_parallel = sequence != nullptr;
  replan(c);
  tp_ = tp;
  seq_ = sequence;
}

void Block::set_precision(const PrecisionPolicy& policy, BlockParams params16, LinearWorkspace* workspace) {
  PlanChoices c = choices_;
  for (size_t k = 0; k < c.linears.size(); ++k) c.linears[k] = policy.recipe[k];
  c.qat = policy.qat;
  replan(c);  // MLA refuses low-precision projections by name
  params16_ = std::move(params16);
  ws_ = workspace;
  qkv_ = LinearLayer(linear_setup(policy, LINEAR_ATTN_QKV, true));
  proj_ = LinearLayer(linear_setup(policy, LINEAR_ATTN_OUT, true));
  fc_ = LinearLayer(linear_setup(policy, LINEAR_MLP_IN, true));
  fc2_ = LinearLayer(linear_setup(policy, LINEAR_MLP_OUT, true));
}

void Block::set_context_parallel(ContextParallel* cp) {
  PlanChoices c = choices_;
  c.context = cp == nullptr ? PlanChoices::NONE : cp->ulysses ? PlanChoices::ULYSSES : PlanChoices::RING;
  replan(c);
  cp_ = cp;
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

MlaActivations Block::mla_activations(const BlockSaved& s) {
  return {s.mla_qa, s.mla_qa_norm, s.mla_qa_rstd, s.mla_q, s.mla_c, s.mla_c_norm, s.mla_c_rstd, s.mla_kr, s.mla_kv,
          s.probs, s.attn};
}

BlockSaved with_kept(const BlockSaved& shared, const BlockSaved& kept, RecomputePolicy policy) {
  BlockSaved r = shared;
  r.input = kept.input;
  if (policy == RECOMPUTE_SELECTIVE) {
    r.qkv = kept.qkv, r.attn = kept.attn, r.mid = kept.mid, r.fc = kept.fc;
    if (kept.lse.defined()) r.lse = kept.lse;  // FlashAttention
  }
  return r;
}

void Block::recompute(Backend& backend, const BlockSaved& kept, RecomputePolicy policy, BlockSaved& full,
                      const Tensor& out_scratch) {
  LOOM_CHECK(policy != RECOMPUTE_NONE && !is_moe() && !config_.mla() && tp_ == nullptr && cp_ == nullptr,
             "block recompute: a policy that recomputes, on a block without MoE, MLA or model parallelism");
  const BlockParams& p = params_;
  const int64_t B = kept.input.dim(0), T = kept.input.dim(1), C = config_.d_model;
  auto shaped = [](const Tensor& t, Shape shape) { return t.view(0, std::move(shape)); };
  BlockSaved& r = full;
  r = with_kept(full, kept, policy);
  if (policy == RECOMPUTE_FULL) {
    const bool was = recording_;
    recording_ = false;
    forward(backend, r, shaped(out_scratch, {B, T, C}));
    recording_ = was;
    return;
  }
  // Selective: the GEMM outputs and the residual stream are kept; norms, probabilities and the
  // activation come again from them (with FlashAttention lse is kept: no attention to rerun).
  norm_forward(backend, config_, r.input, p.norm1_w, p.norm1_b, r.norm1, r.mean1, r.rstd1);
  if (plan_.attention != AttentionKind::flash) {
    backend.attention_forward(r.qkv, shaped(out_scratch, r.attn.shape()), r.probs, config_.n_head, config_.n_kv_head,
                              config_.attn_window);
  }
  norm_forward(backend, config_, r.mid, p.norm2_w, p.norm2_b, r.norm2, r.mean2, r.rstd2);
  if (config_.swiglu()) backend.swiglu_forward(r.fc, r.act);
  else backend.gelu_forward(r.fc, r.act);
}

void Block::rope(Backend& backend, const Tensor& qkv, bool backward) const {
  const int64_t heads = config_.n_head + config_.n_kv_head, hd = config_.head_dim();
  if (cp_ == nullptr) {
    if (backward) backend.rope_backward(qkv, hd, heads, config_.rope_theta, 0);
    else backend.rope_forward(qkv, hd, heads, config_.rope_theta, 0);
    return;
  }
  // This rank's positions are two chunks of the sequence (zig-zag): each rotated at its start.
  const int64_t B = qkv.dim(0), Tl = qkv.dim(1), W = qkv.dim(2), chunk = Tl / 2;
  const Tensor tmp = cp_->chunk.view(0, {B, chunk, W});
  for (int c = 0; c < 2; ++c) {
    for (int64_t b = 0; b < B; ++b) backend.copy(qkv.view((b * Tl + c * chunk) * W, {chunk, W}), tmp.view(b * chunk * W, {chunk, W}));
    if (backward) backend.rope_backward(tmp, hd, heads, config_.rope_theta, cp_->chunk_starts[static_cast<size_t>(c)]);
    else backend.rope_forward(tmp, hd, heads, config_.rope_theta, cp_->chunk_starts[static_cast<size_t>(c)]);
    for (int64_t b = 0; b < B; ++b) backend.copy(tmp.view(b * chunk * W, {chunk, W}), qkv.view((b * Tl + c * chunk) * W, {chunk, W}));
  }
}

Tensor Block::gathered(Backend& backend, const Tensor& shard, int64_t seq_len) const {
  const Tensor full = seq_->full.view(0, {shard.dim(0), seq_len, shard.dim(2)});
  sequence_all_gather(backend, *tp_, shard, full, seq_->staging);
  return full;
}

void Block::forward(Backend& backend, BlockSaved& s, const Tensor& out) {
  const BlockParams& p = params_;
  const BlockParams& q = params16_;
  const int64_t T = s.attn.dim(1);
  // The row-parallel layers' partial outputs: summed over the group into the residual stream
  // (all-reduce), or reduced onto this rank's sequence shard (reduce-scatter).
  const auto reduce = [&](const Tensor& partial, const Tensor& into) {
    if (seq_ != nullptr) sequence_reduce_scatter(backend, *tp_, partial, into, seq_->staging);
    else tp_->all_reduce(into);
  };
  const Tensor partial = seq_ != nullptr ? seq_->full.view(0, {s.attn.dim(0), T, config_.d_model}) : Tensor{};
  norm_forward(backend, config_, s.input, p.norm1_w, p.norm1_b, s.norm1, s.mean1, s.rstd1);
  if (plan_.attention == AttentionKind::mla) {  // multi-head latent attention (nn/mla.h): a whole block only
    mla_forward(backend, config_, p.mla, s.norm1, mla_activations(s));
  } else {
    qkv_.forward(backend, seq_ != nullptr ? gathered(backend, s.norm1, T) : s.norm1, p.qkv_w, q.qkv_w, p.qkv_b, s.qkv, 0.0f, ws_);
    if (!config_.learned_positions()) rope(backend, s.qkv, false);
    attention_forward(backend, plan_, config_, cp_, s);
  }
  if (tp_ != nullptr) {  // g: the heads' partial projections summed (bias added once, by rank 0)
    const Tensor y = seq_ != nullptr ? partial : s.mid;
    proj_.forward(backend, s.attn, p.proj_w, q.proj_w, tp_->rank() == 0 ? p.proj_b : Tensor{}, y, 0.0f, ws_);
    reduce(y, s.mid);
    backend.add_inplace(s.mid, s.input);
  } else {
    backend.copy(s.input, s.mid);
    proj_.forward(backend, s.attn, p.proj_w, q.proj_w, p.proj_b, s.mid, 1.0f, ws_);  // mid = input + proj(attn)
  }

  norm_forward(backend, config_, s.mid, p.norm2_w, p.norm2_b, s.norm2, s.mean2, s.rstd2);
  if (is_moe()) {  // out = mid + MoE(norm2)
    LOOM_CHECK(seq_ == nullptr && cp_ == nullptr && moe_scratch_ != nullptr,
               "an MoE block runs without sequence or context parallelism (and needs its scratch)");
    const int64_t N = s.norm2.dim(0) * T, C = config_.d_model;
    backend.copy(s.mid, out);
    // Under tensor parallelism (not sequence parallel) the block input is whole on every rank
    // of the group: each computes the whole MoE (its parameters are replicated), no reduction.
    moe_forward(backend, config_, p.moe, s.norm2.view(0, {N, C}), s.moe, *moe_scratch_, out.view(0, {N, C}), T, ep_);
    if (recording_) {
      MoeStats& m = moe_stats_;
      m.load.resize(static_cast<size_t>(config_.moe_experts), 0.0);
      for (int64_t e = 0; e < config_.moe_experts; ++e) m.load[e] += static_cast<double>(s.moe.load[e]);
      m.tokens += N, m.dropped += s.moe.dropped, m.dispatched += s.moe.dispatched, ++m.micro_batches;
      m.aux += s.moe.aux, m.seq_aux += s.moe.seq_aux, m.z += s.moe.z, m.entropy += s.moe.entropy;
    }
    return;
  }
  fc_.forward(backend, seq_ != nullptr ? gathered(backend, s.norm2, T) : s.norm2, p.fc_w, q.fc_w, p.fc_b, s.fc, 0.0f, ws_);
  if (config_.swiglu()) backend.swiglu_forward(s.fc, s.act);
  else backend.gelu_forward(s.fc, s.act);
  if (tp_ != nullptr) {  // g: the hidden slices' partial outputs summed
    const Tensor y = seq_ != nullptr ? partial : out;
    fc2_.forward(backend, s.act, p.fc2_w, q.fc2_w, tp_->rank() == 0 ? p.fc2_b : Tensor{}, y, 0.0f, ws_);
    reduce(y, out);
    backend.add_inplace(out, s.mid);
  } else {
    backend.copy(s.mid, out);
    fc2_.forward(backend, s.act, p.fc2_w, q.fc2_w, p.fc2_b, out, 1.0f, ws_);  // out = mid + fc2(act)
  }
}

void Block::forward_rows(Backend& backend, BlockSaved& s, const Tensor& out, const std::vector<int64_t>& positions,
                         DecodeCache& cache, int64_t layer) const {
  LOOM_CHECK(tp_ == nullptr, "decoding a tensor-parallel block slice is not supported");
  const BlockParams& p = params_;
  const int64_t n = s.input.dim(0), H = config_.n_head, hd = config_.head_dim();
  const int64_t W = config_.qkv_width(), KW = config_.n_kv_head * hd;
  LOOM_CHECK(static_cast<int64_t>(positions.size()) == n, "forward_rows: ", positions.size(), " positions for ", n, " rows");
  norm_forward(backend, config_, s.input, p.norm1_w, p.norm1_b, s.norm1, s.mean1, s.rstd1);
  if (plan_.attention == AttentionKind::mla) {
    mla_rows(backend, s, positions, cache, layer);
  } else {
    linear_forward(backend, s.norm1, p.qkv_w, p.qkv_b, s.qkv);
    if (!config_.learned_positions()) {
      for (int64_t r = 0; r < n; ++r) {
        backend.rope_forward(s.qkv.view(r * W, {1, 1, W}), hd, H + config_.n_kv_head, config_.rope_theta, positions[r]);
      }
    }
    // The rows' q, k, v to the host in one read; each row's attention through its host cache;
    // the outputs back in one write (the same arithmetic as on the rows in place).
    std::vector<float>& qkv = cache.host_qkv;
    std::vector<float>& attn = cache.host_attn;
    qkv.resize(static_cast<size_t>(n * W));
    attn.resize(static_cast<size_t>(n * H * hd));
    backend.read(s.qkv.view(0, {n, W}), qkv.data());
    for (int64_t r = 0; r < n; ++r) {
      const float* row = qkv.data() + r * W;
      cache.attend(layer, r, row, row + H * hd, row + H * hd + KW, attn.data() + r * H * hd);
    }
    backend.write(s.attn.view(0, {n, H * hd}), attn.data());
  }
  backend.copy(s.input, s.mid);
  linear_forward(backend, s.attn, p.proj_w, p.proj_b, s.mid, 1.0f);
  norm_forward(backend, config_, s.mid, p.norm2_w, p.norm2_b, s.norm2, s.mean2, s.rstd2);
  if (is_moe()) {  // one position per sequence: n tokens routed (statistics are not recorded)
    backend.copy(s.mid, out);
    const int64_t C = config_.d_model;
    moe_forward(backend, config_, p.moe, s.norm2.view(0, {n, C}), s.moe, *moe_scratch_, out.view(0, {n, C}), 1);
    return;
  }
  linear_forward(backend, s.norm2, p.fc_w, p.fc_b, s.fc);
  if (config_.swiglu()) backend.swiglu_forward(s.fc, s.act);
  else backend.gelu_forward(s.fc, s.act);
  backend.copy(s.mid, out);
  linear_forward(backend, s.act, p.fc2_w, p.fc2_b, out, 1.0f);
}

void Block::mla_rows(Backend& backend, BlockSaved& s, const std::vector<int64_t>& positions, DecodeCache& cache,
                     int64_t layer) const {
  const int64_t n = s.input.dim(0), dc = config_.mla_kv_rank, dr = config_.mla_rope_dim;
  MlaActivations a = mla_activations(s);
  a.kv = Tensor{};  // the up-projection is absorbed into the query
  mla_project(backend, config_, params_.mla, s.norm1, a, positions.data());
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

void Block::backward(Backend& backend, const BlockSaved& s, const Tensor& d_residual, BlockScratch& k,
                     BackwardPart part) {
  const BlockParams& p = params_;
  const BlockParams& g = grads_;
  const BlockParams& q = params16_;
  const int64_t T = s.attn.dim(1);
  const bool sp = seq_ != nullptr;
  // Sequence parallel: gradients arrive on the shard and are gathered before the row-parallel
  // layers' backward (g's backward); the norms' inputs are gathered again for the weight gradients.
  const auto whole = [&](const Tensor& shard) { return sp ? gathered(backend, shard, T) : shard; };
  if (part == BACKWARD_WEIGHT) {  // the four weight gradients from the kept output gradients
    LOOM_CHECK(s.dy_proj.defined(), "block backward: the weight pass needs activations allocated for a split backward");
    if (!is_moe()) {  // an MoE block's weight gradients were computed in the input pass
      fc2_.backward(backend, s.act, p.fc2_w, q.fc2_w, s.dy_fc2, Tensor{}, g.fc2_w, Tensor{}, ws_);
      fc_.backward(backend, whole(s.norm2), p.fc_w, q.fc_w, s.dy_fc, Tensor{}, g.fc_w, Tensor{}, ws_);
    }
    proj_.backward(backend, s.attn, p.proj_w, q.proj_w, s.dy_proj, Tensor{}, g.proj_w, Tensor{}, ws_);
    // An MLA block's projections' weight gradients were computed in the input pass.
    if (plan_.attention != AttentionKind::mla) qkv_.backward(backend, whole(s.norm1), p.qkv_w, q.qkv_w, s.dy_qkv, Tensor{}, g.qkv_w, Tensor{}, ws_);
    return;
  }
  const bool split = part == BACKWARD_INPUT;
  LOOM_CHECK(!split || s.dy_proj.defined(), "block backward: the input pass needs activations allocated for a split backward");
  // Weight gradients now, or (split) kept output gradients for the weight pass.
  auto dw = [split](const Tensor& grad) { return split ? Tensor{} : grad; };
  auto keep = [&backend, split](const Tensor& dy, const Tensor& into) {
    if (split) backend.copy(dy, into);
  };
  // The column-parallel layers' partial input gradients: summed over the group (f: all-reduce),
  // or reduced onto the shard (reduce-scatter) into dn; the norm's input gradient then goes to dx.
  const Tensor dn = sp ? k.d_tmp.view(0, d_residual.shape()) : k.d_norm;
  const Tensor dx = sp ? k.d_norm.view(0, d_residual.shape()) : k.d_tmp;
  const auto reduce = [&]() {
    if (sp) sequence_reduce_scatter(backend, *tp_, k.d_norm, dn, seq_->staging);
    else if (tp_ != nullptr) tp_->all_reduce(k.d_norm);
  };
  // MLP branch: d_residual is d(out); the residual path passes it to d(mid) unchanged.
  if (is_moe()) {  // d(norm2 output) = MoE backward (router, experts and shared experts at once)
    const int64_t N = s.norm2.dim(0) * T, C = config_.d_model;
    moe_backward(backend, config_, p.moe, g.moe, s.norm2.view(0, {N, C}), s.moe, *moe_scratch_,
                 d_residual.view(0, {N, C}), k.d_norm.view(0, {N, C}), loss_weight_, T, ep_);
  } else {
    const Tensor dy_out = whole(d_residual);
    keep(dy_out, s.dy_fc2);
    fc2_.backward(backend, s.act, p.fc2_w, q.fc2_w, dy_out, k.d_act, dw(g.fc2_w), g.fc2_b, ws_);
    if (config_.swiglu()) backend.swiglu_backward(s.fc, k.d_act, k.d_fc);
    else backend.gelu_backward(s.fc, k.d_act, k.d_fc);
    keep(k.d_fc, s.dy_fc);
    fc_.backward(backend, whole(s.norm2), p.fc_w, q.fc_w, k.d_fc, k.d_norm, dw(g.fc_w), g.fc_b, ws_);
    reduce();  // f: the hidden slices' partial d(norm2 output)
  }
  norm_backward(backend, config_, dn, s.mid, p.norm2_w, s.mean2, s.rstd2, dx, g.norm2_w, g.norm2_b);
  backend.add_inplace(d_residual, dx);  // now d(mid)

  // Attention branch.
  const Tensor dy_mid = whole(d_residual);
  keep(dy_mid, s.dy_proj);
  proj_.backward(backend, s.attn, p.proj_w, q.proj_w, dy_mid, k.d_attn, dw(g.proj_w), g.proj_b, ws_);
  if (plan_.attention == AttentionKind::mla) {  // d(norm1 output) and MLA's weight gradients (also in a split input pass)
    mla_backward(backend, config_, p.mla, g.mla, s.norm1, mla_activations(s), k.d_attn, k.d_norm, k.d_qkv);
  } else {
    attention_backward(backend, plan_, config_, cp_, s, k);
    if (!config_.learned_positions()) rope(backend, k.d_qkv, true);
    keep(k.d_qkv, s.dy_qkv);
    qkv_.backward(backend, whole(s.norm1), p.qkv_w, q.qkv_w, k.d_qkv, k.d_norm, dw(g.qkv_w), g.qkv_b, ws_);
  }
  reduce();  // f: the heads' partial d(norm1 output)
  norm_backward(backend, config_, dn, s.input, p.norm1_w, s.mean1, s.rstd1, dx, g.norm1_w, g.norm1_b);
  backend.add_inplace(d_residual, dx);  // now d(input)
}

}  // namespace loom
