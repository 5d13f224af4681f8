#include "loom/model/transformer.h"

#include "loom/model/init.h"
#include "loom/model/recompute_timing.h"
#include "loom/nn/context_parallel.h"
#include "loom/nn/lora.h"
#include "loom/nn/sequence_parallel.h"
#include "loom/nn/vocab_parallel.h"

#include <algorithm>
#include <set>

#include "loom/core/error.h"

namespace loom {

Transformer::Transformer(Backend& backend, const ModelConfig& config, ModelUse use)
    : backend_(backend), config_(config), layout_(build_param_layout(config)), ws_(backend.allocator()) {
  Allocator& alloc = backend_.allocator();
  // MLA's and the mixture of experts' element loops are Backend ops (capabilities()).
  const BackendCapabilities caps = backend_.capabilities();
  LOOM_CHECK(config_.moe_experts == 0 || caps.mixture_of_experts, "model.moe_experts > 0 (mixture of experts) is not "
             "supported on the ", backend_.name(), " backend (capabilities().mixture_of_experts is false)");
  LOOM_CHECK(!config_.mla() || caps.latent_attention, "model.mla_kv_rank > 0 (MLA) is not supported on the ",
             backend_.name(), " backend (capabilities().latent_attention is false)");
  LOOM_CHECK(!config_.qk_norm || caps.head_norm, "model.qk_norm is not supported on the ", backend_.name(),
             " backend (capabilities().head_norm is false)");
  LOOM_CHECK(!config_.lora_dora || caps.dora, "peft.dora is not supported on the ", backend_.name(),
             " backend yet (capabilities().dora is false: it lacks row_norms, dora_weight and dora_backward)");
  params_ = use.lazy_params ? Tensor::zeros_lazy(alloc, {layout_.total}, DTYPE_F32, MEM_PARAMETERS)
                            : Tensor::zeros(alloc, {layout_.total}, DTYPE_F32, MEM_PARAMETERS);
  if (use.gradients) {  // lazy with lazy parameters: a frozen range's gradients are never written
    grads_ = use.lazy_params ? Tensor::zeros_lazy(alloc, {layout_.total}, DTYPE_F32, MEM_GRADIENTS)
                             : Tensor::zeros(alloc, {layout_.total}, DTYPE_F32, MEM_GRADIENTS);
  }
  frozen_end_ = config_.lora() ? lora_begin(config_, layout_) : 0;
  if (frozen_end_ > 0) {  // the norm ops always compute their weights' gradients: frozen ones land here
    const int64_t width = std::max(config_.d_model, config_.q_norm_width());
    sink_w_ = Tensor::zeros(alloc, {width}, DTYPE_F32, MEM_WORKSPACE);
    sink_b_ = Tensor::zeros(alloc, {width}, DTYPE_F32, MEM_WORKSPACE);
  }
  for (int64_t l = 0; l < config_.n_layer; ++l) {
    blocks_.emplace_back(config_, l, block_params_view(config_, layout_, params_, l),
                         use.gradients ? frozen_grads(block_params_view(config_, layout_, grads_, l)) : BlockParams{});
    blocks_.back().set_moe_scratch(&moe_scratch_);
  }
  units_ = layout_units(config_, layout_);
  final_offset_ = units_[0].ranges()[1].begin;
  for (size_t l = 1; l < units_.size(); ++l) block_offset_.push_back(units_[l].ranges()[0].begin);
  if (config_.arch == ARCH_GPT2) {
    embed_w = param("wte.weight"), d_embed_w = grad("wte.weight");
    pos_w = param("wpe.weight"), d_pos_w = grad("wpe.weight");
    final_w = param("ln_f.weight"), d_final_w = grad("ln_f.weight");
    final_b = param("ln_f.bias"), d_final_b = grad("ln_f.bias");
    head_w = embed_w, d_head_w = d_embed_w;
  } else {
    embed_w = param("model.embed_tokens.weight"), d_embed_w = grad("model.embed_tokens.weight");
    final_w = param("model.norm.weight"), d_final_w = grad("model.norm.weight");
    head_w = param(head_param_name(config_)), d_head_w = grad(head_param_name(config_));
  }
  if (frozen_end_ > 0) {  // LoRA: no gradient for the embeddings and the head
    d_embed_w = d_pos_w = d_head_w = Tensor{};
    d_final_w = sink(d_final_w, sink_w_), d_final_b = sink(d_final_b, sink_b_);
  }
}

Tensor Transformer::sink(const Tensor& grad, const Tensor& sink) {
  return grad.defined() ? sink.view(0, grad.shape()) : Tensor{};
}

BlockParams Transformer::frozen_grads(BlockParams g) const {
  if (frozen_end_ == 0) return g;
  AttentionParams& a = g.attention;
  MlpParams& m = g.mlp;
  for (Tensor* t : {&a.qkv_w, &a.qkv_b, &a.proj_w, &a.proj_b, &m.fc_w, &m.fc_b, &m.fc2_w, &m.fc2_b}) *t = Tensor{};
  for (Tensor* t : {&a.norm_w, &a.post_norm_w, &a.q_norm, &a.k_norm, &a.sinks, &m.norm_w, &m.post_norm_w}) *t = sink(*t, sink_w_);
  for (Tensor* t : {&a.norm_b, &m.norm_b}) *t = sink(*t, sink_b_);
  return g;
}

RangeSet Transformer::frozen_ranges() const {
  return frozen_end_ > 0 ? RangeSet::span(0, frozen_end_) : RangeSet{};
}

Tensor Transformer::param(const std::string& name) const {
  const ParamSpec& spec = layout_.find(name);
  return params_.view(spec.offset, spec.shape);
}

Tensor Transformer::grad(const std::string& name) const {
  if (!grads_.defined()) return Tensor{};  // an inference model
  const ParamSpec& spec = layout_.find(name);
  return grads_.view(spec.offset, spec.shape);
}

void Transformer::init_weights(uint64_t seed, int64_t from) {
  init_params(backend_, config_, layout_, params_, seed, from);
}

void Transformer::zero_grads() {
  if (!grads_.defined()) return;
  // A frozen range's gradients are never written (and their pages may be released).
  backend_.fill(grads_.view(frozen_end_, {layout_.total - frozen_end_}), 0.0);
}

void Transformer::set_precision(const PrecisionPolicy& policy) {
  if (!backend_.capabilities().low_precision) {  // the quantizers are ops this backend lacks
    for (int k = 0; k < LINEAR_KIND_COUNT; ++k) {
      LOOM_CHECK(policy.recipe[static_cast<size_t>(k)] == RECIPE_F32 || policy.recipe[static_cast<size_t>(k)] == RECIPE_BF16,
                 "precision recipe ", recipe_name(policy.recipe[static_cast<size_t>(k)]), " is not supported on the ",
                 backend_.name(), " backend yet (f32 and bf16 are; it lacks the fp16 and fp8 quantizers)");
    }
    LOOM_CHECK(policy.qat == QAT_NONE && !policy.master_bf16 && !policy.reduce_bf16, "precision.qat, "
               "precision.master = bf16 and precision.reduce = bf16 are not supported on the ", backend_.name(),
               " backend yet (it lacks the quantizers and bf16 rounding)");
  }
  LOOM_CHECK(!policy.attention_bf16 || backend_.capabilities().bf16_attention, "precision.attention = bf16 is not "
             "supported on the ", backend_.name(), " backend yet (it lacks attention_forward_bf16): set it to f32");
  // A base kept in bf16 only lives in the bf16 copy, which stays (and stays needed).
  LOOM_CHECK(!base_.bf16() || policy.param_bf16, "precision.param = f32 for a model whose frozen base is kept in bf16 "
             "only (keep_base_bf16)");
  policy_ = policy;
  if (!base_.bf16()) {
    params16_ = Tensor{};
    if (policy_.param_bf16) params16_ = Tensor::empty(backend_.allocator(), {layout_.total}, DTYPE_BF16, MEM_PARAMETERS);
  }
  head16_ = Tensor{};
  for (int64_t l = 0; l < config_.n_layer; ++l) {
    blocks_[static_cast<size_t>(l)].set_precision(
        policy_, params16_.defined() ? block_params_view(config_, layout_, params16_, l) : BlockParams{}, &ws_);
  }
  head_ = LinearLayer(linear_setup(policy_, LINEAR_HEAD, false));
  if (params16_.defined()) {
    const ParamSpec& head = layout_.find(head_param_name(config_));
    head16_ = params16_.view(head.offset, head.shape);
  }
  sync_weight_copy();
}

void Transformer::quantize_base() {
  base_.check(backend_, config_, params_, params16_.defined());
  set_precision(policy_);  // the blocks get the workspace their layers dequantize into
  base_.quantize(backend_, config_, layout_, params_, blocks_);
}

void Transformer::load_quantized_base(const FrozenBase::WeightRead& read) {
  base_.check(backend_, config_, params_, params16_.defined());
  set_precision(policy_);
  base_.load(backend_, config_, layout_, params_, blocks_, read);
}

void Transformer::keep_base_bf16() {
  base_.keep_bf16(backend_, config_, layout_, params_, params16_);
}

void Transformer::load_bf16_base(const FrozenBase::WeightRead& read) {
  base_.load_bf16(backend_, config_, layout_, params_, params16_, read);
}

void Transformer::sync_weight_copy() {
  if (!params16_.defined()) return;
  if (!base_.bf16()) {
    backend_.cast(params_, params16_);
    return;
  }
  for (const Range& r : RangeSet::span(0, layout_.total).subtract(base_.ranges())) {  // the kept base is the copy
    backend_.cast(params_.view(r.begin, {r.end - r.begin}), params16_.view(r.begin, {r.end - r.begin}));
  }
}

void Transformer::end_step() {  // every linear layer in linear_layers()'s order, without building the list
  for (Block& b : blocks_) {
    for (LinearLayer* l : b.linears()) l->end_step();
  }
  head_.end_step();
}

void Transformer::set_recording(bool on) {
  recording_ = on;
  for (LinearLayer* l : linear_layers()) l->set_recording(on);
  for (Block& b : blocks_) b.set_recording(on);
}

void Transformer::moe_end_step(Communicator* group) {
  moe_stats_.end_step(backend_, config_, blocks_, group, moe_scratch_.bias_host);
}

std::vector<DelayedScaling*> Transformer::delayed_scalings() {
  std::vector<DelayedScaling*> out;  // linear_layers()' order, each layer's x, w, dy
  for (LinearLayer* l : linear_layers()) {
    if (l->setup().recipe != RECIPE_FP8_DELAYED) continue;
    for (DelayedScaling& s : l->scaling()) out.push_back(&s);
  }
  return out;
}

const Tensor& Transformer::pack_scaling_state() {
  return scaling_state_.pack(backend_, delayed_scalings(), policy_.fp8_history);
}

void Transformer::unpack_scaling_state() {
  scaling_state_.unpack(backend_, delayed_scalings(), policy_.fp8_history);
}

std::vector<LinearLayer*> Transformer::linear_layers() {
  std::vector<LinearLayer*> out;
  for (Block& b : blocks_) {
    for (LinearLayer* l : b.linears()) out.push_back(l);
  }
  out.push_back(&head_);
  return out;
}

void Transformer::set_int_weights(std::map<std::string, IntWeight> weights) {
  int_weights_.check(backend_, params_);
  set_precision(policy_);  // the layers get the workspace they dequantize into
  int_weights_.set(backend_, params_, linear_weights(), config_.tied_head() ? embed_w : Tensor{}, std::move(weights));
}

void Transformer::set_bf16_weights(std::map<std::string, Tensor> weights) {
  LOOM_CHECK(bf16_weights_.empty(), "set_bf16_weights: the model already has bf16 weights");
  auto check = [&](const std::string& name, const Tensor& w, const Shape& shape) {
    LOOM_CHECK(w.dtype() == DTYPE_BF16 && w.shape() == shape && w.device() == params_.device(), name,
               ": a bf16 weight must be bf16", shape_str(shape), " on the model's backend, got ", w.describe());
  };
  std::set<std::string> used;
  // The token embedding is looked up in bf16 (Backend::embedding_forward widens its rows); a
  // tied head, which linear_weights() names after it, multiplies with the same tensor.
  const std::string embedding = embedding_param_name(config_);
  if (auto it = weights.find(embedding); it != weights.end()) {
    check(embedding, it->second, embed_w.shape());
    embed_w = it->second;
    used.insert(embedding);
  }
  for (const LinearWeight& lw : linear_weights()) {
    auto it = weights.find(lw.name);
    if (it == weights.end()) continue;
    check(lw.name, it->second, lw.weight.shape());
    lw.layer->set_bf16_weight(it->second);
    used.insert(lw.name);
  }
  for (const auto& [name, w] : weights) {
    LOOM_CHECK(used.count(name), name, ": a bf16 tensor that is not the token embedding or a linear layer's weight of "
               "this model");
  }
  bf16_weights_ = std::move(weights);
}

int64_t Transformer::bf16_weight_params() const {
  int64_t total = 0;
  for (const auto& [name, w] : bf16_weights_) total += w.numel();
  return total;
}

ActivationStore Transformer::allocate_store(int64_t batch, int64_t seq_len) {
  return allocate_stage_store(batch, seq_len, 0, config_.n_layer, false);
}

ActivationStore Transformer::allocate_prompt_store(int64_t seq_len) {
  return allocate_store_for(1, seq_len, 0, config_.n_layer, false, cp_.comm != nullptr, true, false, true);
}

ActivationStore Transformer::allocate_block_store(int64_t batch, int64_t seq_len, int64_t layer) {
  return allocate_store_for(batch, seq_len, layer, layer + 1, false, cp_.comm != nullptr, true, false, false, false);
}

ActivationStore Transformer::allocate_stage_store(int64_t batch, int64_t seq_len, int64_t first, int64_t last,
                                                  bool split_backward) {
  return allocate_store_for(batch, seq_len, first, last, split_backward, cp_.comm != nullptr);
}

void Transformer::set_recompute(std::vector<RecomputePolicy> plan, bool offload) {
  LOOM_CHECK(scratch_tokens_ == 0, "set_recompute must come before the activation stores are allocated");
  LOOM_CHECK(plan.empty() || static_cast<int64_t>(plan.size()) == config_.n_layer, "recompute plan of ", plan.size(),
             " layers for a model of ", config_.n_layer);
  LOOM_REFUSED(!config_.mla() || std::all_of(plan.begin(), plan.end(), [](RecomputePolicy p) { return p == RECOMPUTE_NONE; }),
               "model.mla_kv_rank > 0 (MLA) is not supported with activation checkpointing: set train.recompute = none");
  recompute_ = std::move(plan);
  recompute_offload_ = offload;
  for (size_t l = 0; l < blocks_.size(); ++l) blocks_[l].set_recompute(recompute_.empty() ? RECOMPUTE_NONE : recompute_[l]);
}

void Transformer::set_flash_attention(bool on) {
  LOOM_CHECK(on == flash_ || scratch_tokens_ == 0,
             "set_flash_attention must come before the activation stores are allocated");
  for (Block& b : blocks_) b.set_flash_attention(on);
  flash_ = on;
}

std::vector<std::array<double, RECOMPUTE_COUNT>> Transformer::measure_recompute_seconds(int64_t batch, int64_t seq_len,
                                                                                     int repeats) {
  return loom::measure_recompute_seconds(backend_, config_, blocks_, recompute_record_plan(), batch, seq_len, repeats);
}

LayerPlan Transformer::recompute_record_plan() const {
  LayerPlan plan = blocks_.front().plan();  // (the blocks that recompute: no model parallelism, no MoE)
  plan.mlp = MlpKind::dense;
  return plan;
}

ActivationStore Transformer::allocate_store_for(int64_t batch, int64_t seq_len, int64_t first, int64_t last,
                                                bool split_backward, bool context_parallel, bool recompute, bool rows,
                                                bool last_logits, bool head, int64_t logit_rows) {
  LOOM_CHECK(batch > 0, "batch size must be > 0, got ", batch);
  LOOM_CHECK(seq_len > 0 && seq_len <= config_.max_seq_len, "sequence length ", seq_len,
             " must be in [1, model.max_seq_len = ", config_.max_seq_len, "]");
  LOOM_CHECK(0 <= first && first < last && last <= config_.n_layer, "pipeline stage: layers [", first, ", ", last,
             ") outside the model's ", config_.n_layer);
  Allocator& alloc = backend_.allocator();
  const int64_t C = config_.d_model;
  if (context_parallel) {  // this rank's positions only: two zig-zag chunks
    check_cp_seq_len(seq_len, cp_.comm->size());
    const std::vector<int64_t> positions = cp_local_positions(seq_len, cp_.comm->rank(), cp_.comm->size());
    const int64_t Tl = seq_len / cp_.comm->size();
    cp_.chunk_starts = {positions[0], positions[static_cast<size_t>(Tl / 2)]};
    const int64_t hd = config_.head_dim();
    auto ws = [&](int64_t n) { return Tensor::empty(alloc, {n}, DTYPE_F32, MEM_WORKSPACE); };
    if (!cp_.q.defined() || cp_.q.numel() < batch * Tl * config_.n_head * hd) {
      cp_.q = ws(batch * Tl * config_.n_head * hd), cp_.dq = ws(batch * Tl * config_.n_head * hd);
      cp_.k = ws(batch * Tl * config_.n_kv_head * hd), cp_.dk = ws(batch * Tl * config_.n_kv_head * hd);
      cp_.v = ws(batch * Tl * config_.n_kv_head * hd), cp_.dv = ws(batch * Tl * config_.n_kv_head * hd);
      cp_.chunk = ws(batch * (Tl / 2) * config_.qkv_width());
    }
    if (cp_.work.dims.batch != batch || cp_.work.dims.local_seq != Tl) {
      cp_.work = allocate_cp_workspace(alloc, batch, Tl, config_.n_head, config_.n_kv_head, hd, cp_.comm->size(),
                                       cp_.ulysses);
    }
    seq_len = Tl;
  }
  const int64_t B = batch, T = seq_len;
  auto act = [&](Shape shape, DType dtype = DTYPE_F32) { return Tensor::empty(alloc, std::move(shape), dtype, MEM_ACTIVATIONS); };
  ActivationStore s;
  s.batch = B, s.seq_len = T;
  s.tokens = act({B, T}, DTYPE_I32);
  s.targets = act({B, T}, DTYPE_I32);
  const int64_t Ts = T / shards();  // the residual stream's positions on this rank
  s.blocks.resize(static_cast<size_t>(config_.n_layer));
  // An inference model's store (no gradients: no backward reads the records) shares one layer's
  // record among the layers, each keeping its own input (two alternating buffers) and qkv (the
  // engine stores it in the KV cache after the forward): a forward holds one layer's activations.
  // Decoding's rows too: a step of a prompt chunk's rows holds one layer's records of the chunk.
  const bool share = !grads_.defined() && !split_backward && first == 0 && !config_.mla() &&
                     config_.moe_experts == 0 && recompute_.empty();
  for (int64_t l = first; l < last; ++l) {
    if (share && l > 0 && blocks_[static_cast<size_t>(l)].plan().attention == blocks_.front().plan().attention &&
        blocks_[static_cast<size_t>(l)].plan().mlp == blocks_.front().plan().mlp) {
      BlockSaved b = s.blocks.front();
      b.input = l >= 2 ? s.blocks[static_cast<size_t>(l - 2)].input : act(b.input.shape(), b.input.dtype());
      if (b.attention.qkv.defined()) b.attention.qkv = act(b.attention.qkv.shape(), b.attention.qkv.dtype());
      s.blocks[static_cast<size_t>(l)] = b;
      continue;
    }
    const RecomputePolicy keep = recompute && !recompute_.empty() ? recompute_[l] : RECOMPUTE_NONE;
    const MemCategory where = keep != RECOMPUTE_NONE && recompute_offload_ ? MEM_OFFLOADED : MEM_ACTIVATIONS;
    LayerPlan plan = blocks_[static_cast<size_t>(l)].plan();
    if (!context_parallel && (plan.attention == AttentionKind::ring || plan.attention == AttentionKind::ulysses)) {
      plan.attention = AttentionKind::mha;  // a store of whole sequences (decoding) on a cp model
    }
    if (rows) plan.saved_bf16 = {}, plan.fc_bf16 = false;  // decoding's fp32 records
    if (rows || !grads_.defined()) plan.qkv_bf16 = false;  // the KV cache stores from a prompt's fp32 qkv
    s.blocks[l] = allocate_block_saved(alloc, config_, plan,
                                       {.batch = B, .seq_len = T, .seq_shards = shards(), .split_backward = split_backward,
                                        .keep = keep, .ep = ep_size(), .category = where});
  }
  if (last < config_.n_layer) {
    s.blocks[last].input = act({B, Ts, C});  // the stage's output: the next stage's input
  } else {
    s.final_input = act({B, Ts, C});
    s.final_norm = act({B, T, C});
    if (sp_) s.final_norm_shard = act({B, Ts, C});
    if (!config_.rmsnorm()) s.final_mean = act({B, Ts});
    s.final_rstd = act({B, Ts});
    s.last_logits = last_logits;
    if (head) s.logits = act({logit_rows > 0 ? std::min(logit_rows, B) : B, last_logits ? 1 : T, config_.vocab_size});
    s.losses = act({B, T});
    s.lse = act({B, T});
  }
  const bool any_recompute = recompute && std::any_of(recompute_.begin(), recompute_.end(),
                                                      [](RecomputePolicy p) { return p != RECOMPUTE_NONE; });
  LOOM_REFUSED(!any_recompute || (tp_ == nullptr && cp_.comm == nullptr), "activation checkpointing (train.recompute) "
               "with tensor or context parallelism is not supported yet");
  if (any_recompute && (!recompute_record_.input.defined() || recompute_record_.input.dim(0) != B ||
                        recompute_record_.input.dim(1) != T)) {
    recompute_record_ = allocate_block_saved(alloc, config_, recompute_record_plan(), {.batch = B, .seq_len = T});
    recompute_out_ = Tensor::empty(alloc, {B * T * std::max(C, config_.n_head * config_.head_dim())}, DTYPE_F32,
                                   MEM_ACTIVATIONS);
  }
  if (config_.moe_experts > 0 && B * T > moe_scratch_tokens_) {  // (decoding allocates its B tokens' too)
    moe_scratch_ = allocate_moe_scratch(alloc, config_, B * T, ep_size());
    moe_scratch_tokens_ = B * T;
  }
  if (B * T > scratch_tokens_) {
    scratch_ = allocate_block_scratch(alloc, config_, B, T);
    d_residual_ = Tensor::empty(alloc, {B, T, C}, DTYPE_F32, MEM_WORKSPACE);
    ce_sums_ = Tensor::empty(alloc, {B * T}, DTYPE_F32, MEM_WORKSPACE);
    if (sp_) {
      seq_.full = Tensor::empty(alloc, {B * T * C}, DTYPE_F32, MEM_WORKSPACE);
      seq_.staging = Tensor::empty(alloc, {B * T * C}, DTYPE_F32, MEM_COMMUNICATION);
    }
    scratch_tokens_ = B * T;
  }
  return s;
}

double Transformer::forward(ActivationStore& s, bool compute_loss) {
  return forward_stage(s, 0, config_.n_layer, compute_loss);
}

void Transformer::for_each_document(const ActivationStore& s, const Tensor& x,
                                    const std::function<void(const Tensor&)>& f) const {
  LOOM_REFUSED(!sp_ && cp_.comm == nullptr, "packed documents (data.document_mask) with learned positions and sequence "
               "or context parallelism are not supported yet");
  if (s.docs.empty()) {
    f(x);
    return;
  }
  const int64_t T = x.dim(1), C = x.dim(2);
  for (const DocumentSpan& d : s.docs) f(x.view((d.row * T + d.begin) * C, {1, d.length, C}));
}

void Transformer::set_documents(ActivationStore& s, int64_t first, int64_t last) {
  LOOM_REFUSED(s.docs.empty() || cp_.comm == nullptr, "packed documents (data.document_mask) with context parallelism "
               "(parallel.cp > 1) are not supported yet");
  for (int64_t l = first; l < last; ++l) {
    BlockSaved& b = s.blocks[static_cast<size_t>(l)];
    b.attention.docs = s.docs.empty() ? nullptr : &s.docs;
    LoraDropout d;  // the layer's four sites draw streams 16 l + 4 site (+ the adapter)
    if (s.dropout_pass != 0 && config_.lora_dropout > 0.0f) {
      d.p = config_.lora_dropout;
      d.draw = RoundingDraw{kLoraDropoutSeed, static_cast<uint32_t>(16 * l), s.dropout_pass};
    }
    d.off = s.adapters_off;
    b.attention.lora_dropout = b.mlp.lora_dropout = d;
  }
}

double Transformer::forward_stage(ActivationStore& s, int64_t first, int64_t last, bool compute_loss) {
  const auto use = [this](int unit) { if (hooks_.use) hooks_.use(unit, false); };
  const auto done = [this](int unit) { if (hooks_.done) hooks_.done(unit, false); };
  const int64_t L = config_.n_layer;
  set_documents(s, first, last);
  if (first == 0) {
    const Tensor& x0 = s.blocks.empty() ? s.final_input : s.blocks[0].input;
    use(0);
    // Learned positions, restarted at each packed document's start.
    const auto positions = [&](const Tensor& x) {
      for_each_document(s, x, [&](const Tensor& rows) { add_positions(backend_, rows, pos_w); });
    };
    if (sp_) {  // vocabulary-parallel embedding, reduced onto this rank's sequence shard, then positions
      LOOM_CHECK(s.docs.empty() || !pos_w.defined(), "packed documents (data.document_mask) with learned positions "
                 "and sequence parallelism are not supported yet");
      const Tensor full = seq_.full.view(0, {s.batch, s.seq_len, config_.d_model});
      vocab_parallel_embedding_forward(backend_, s.tokens, embed_w, vocab_.begin, vocab_.valid, full);
      sequence_reduce_scatter(backend_, *tp_, full, x0, seq_.staging);
      if (pos_w.defined()) add_positions(backend_, x0, pos_w, tp_->rank() * x0.dim(1));
    } else if (tp_ != nullptr) {  // vocabulary-parallel embedding, then g (all-reduce), then positions
      vocab_parallel_embedding_forward(backend_, s.tokens, embed_w, vocab_.begin, vocab_.valid, x0);
      tp_->all_reduce(x0);
      if (pos_w.defined() && cp_.comm != nullptr) {
        for_each_chunk(x0, [&](const Tensor& rows, int64_t start) { add_positions(backend_, rows, pos_w, start); });
      } else if (pos_w.defined()) {
        positions(x0);
      }
    } else if (cp_.comm != nullptr) {  // positions of this rank's two chunks
      backend_.embedding_forward(s.tokens, embed_w, nullptr, x0);
      if (pos_w.defined()) {
        for_each_chunk(x0, [&](const Tensor& rows, int64_t start) { add_positions(backend_, rows, pos_w, start); });
      }
    } else if (!s.docs.empty() && pos_w.defined()) {
      backend_.embedding_forward(s.tokens, embed_w, nullptr, x0);
      positions(x0);
    } else {
      backend_.embedding_forward(s.tokens, embed_w, pos_w.defined() ? &pos_w : nullptr, x0);
    }
    if (config_.embed_scale > 0.0f) backend_.scale_inplace(x0, config_.embed_scale);  // Gemma: sqrt(d_model) (llama: no positions)
  }
  for (int64_t l = first; l < last; ++l) {
    const Tensor& out = l + 1 < L ? s.blocks[l + 1].input : s.final_input;
    use(static_cast<int>(l) + 1);
    if (!recompute_.empty() && recompute_[l] != RECOMPUTE_NONE) {  // writes the unkept fields into the shared record
      BlockSaved through = with_kept(recompute_record_, s.blocks[l], recompute_[l]);
      blocks_[l].forward(backend_, through, out);
    } else {
      blocks_[l].forward(backend_, s.blocks[l], out);
    }
    done(static_cast<int>(l) + 1);
  }
  if (last < L) return 0.0;
  if (sp_) {  // the final norm on the shard, gathered for the vocabulary-parallel head
    norm_forward(backend_, config_, s.final_input, final_w, final_b, s.final_norm_shard, s.final_mean, s.final_rstd);
    sequence_all_gather(backend_, *tp_, s.final_norm_shard, s.final_norm, seq_.staging);
  } else {
    norm_forward(backend_, config_, s.final_input, final_w, final_b, s.final_norm, s.final_mean, s.final_rstd);
  }
  return head_and_loss(s, compute_loss);
}

// The head over the final norm's output and, when asked, the loss: the last stage's end of a
// forward. Releases unit 0 (the head's parameters) once the head has read them.
double Transformer::head_and_loss(ActivationStore& s, bool compute_loss) {
  const auto done = [this](int unit) { if (hooks_.done) hooks_.done(unit, false); };
  if (!s.logits.defined()) {  // a calibration store of the last block (allocate_block_store)
    LOOM_CHECK(!compute_loss, "a store without logits (allocate_block_store) cannot compute a loss");
    done(0);
    return 0.0;
  }
  if (s.last_logits) {  // a prompt's last position alone (allocate_prompt_store)
    LOOM_CHECK(!compute_loss && s.batch == 1 && !sp_ && tp_ == nullptr && cp_.comm == nullptr,
               "a store of last-position logits is one sequence's prompt, without a loss or tensor parallelism");
    const int64_t T = s.final_norm.dim(1), C = s.final_norm.dim(2);
    head_.forward(backend_, s.final_norm.view((T - 1) * C, {1, 1, C}), head_w, head16_, Tensor{}, s.logits, 0.0f, &ws_);
    done(0);
    return 0.0;
  }
  const float fused = s.fused_loss_weight;
  s.fused_loss_weight = 0.0f, s.dlogits = Tensor{}, s.dlogits_by_columns = false;
  const bool fuse = compute_loss && tp_ == nullptr && fused != 0.0f && s.row_weights.empty() &&
                    s.position_weights.empty() && !s.logit_grad.defined();
  const int64_t N = s.batch * s.seq_len, V = config_.vocab_size;
  // A plain head's fused loss: where the backend asks, it keeps the logits by columns, (V, B*T) =
  // W final_norm^T (the head's GEMMs on aligned rows); a bf16 head under precision.outputs = bf16
  // writes them in bf16, as autocast's linear returns them (the loss reads them widened and writes
  // d(logits) over them).
  const bool plain = fuse && s.logits.numel() == N * V && head_.computes_plainly(head16_);
  const bool by_columns = plain && backend_.logits_by_columns(N, V);
  const bool logits16 = plain && policy_.outputs_bf16 && head_.setup().recipe == RECIPE_BF16;
  const Shape shape = by_columns ? Shape{V, N} : s.logits.shape();
  const Tensor logits = logits16 ? ws_.bf16(LinearWorkspace::L, shape) : s.logits.view(0, shape);
  if (by_columns) head_.forward_columns(backend_, s.final_norm, head_w, head16_, logits, &ws_);
  else head_.forward(backend_, s.final_norm, head_w, head16_, Tensor{}, logits, 0.0f, &ws_);  // (B*T, C) @ (V, C)^T
  done(0);
  if (!compute_loss) return 0.0;
  if (tp_ != nullptr) {
    vocab_parallel_cross_entropy_forward(backend_, *tp_, logits, s.targets, vocab_.begin, vocab_.valid, s.losses,
                                         s.lse, ce_sums_.view(0, {N}));
  } else if (fuse) {
    // The loss and d(logits) together (the row in cache once), bf16 straight into the head's operand.
    const float scale = fused * s.ce_weight / static_cast<float>(N);
    const bool to_bf16 = !logits16 && head_.setup().recipe == RECIPE_BF16;
    s.dlogits = to_bf16 ? ws_.bf16(LinearWorkspace::L, logits.shape()) : logits;
    s.dlogits_weight = fused, s.dlogits_by_columns = by_columns;
    if (by_columns) backend_.cross_entropy_loss_and_grad_columns(logits, s.targets, s.losses, s.lse, scale, s.dlogits);
    else backend_.cross_entropy_loss_and_grad(logits, s.targets, s.losses, s.lse, scale, s.dlogits);
  } else {
    backend_.cross_entropy_forward(logits, s.targets, s.losses, s.lse);
  }
  return backend_.sum(s.losses) / static_cast<double>(N);
}

Tensor Transformer::stage_grad(int64_t batch, int64_t seq_len) const {
  LOOM_CHECK(batch * seq_len <= scratch_tokens_, "stage_grad: (", batch, ", ", seq_len, ") exceeds the allocated stores");
  return d_residual_.view(0, {batch, seq_len / shards(), config_.d_model});
}

ActivationStore Transformer::allocate_rows(int64_t n, int64_t logit_rows) {
  LOOM_CHECK(logit_rows >= 0, "allocate_rows: ", logit_rows, " logit rows");
  // never context parallel, no recompute
  return allocate_store_for(n, 1, 0, config_.n_layer, false, false, false, true, false, true, logit_rows);
}

void Transformer::forward_rows(ActivationStore& s, const std::vector<int32_t>& tokens, const std::vector<int64_t>& positions,
                               DecodeCache& cache, const std::vector<int64_t>* logit_rows, bool graph) {
  LOOM_CHECK(tp_ == nullptr, "decoding a tensor-parallel slice is not supported: gather the model first");
  const int64_t n = s.batch, C = config_.d_model;
  LOOM_CHECK(s.seq_len == 1 && static_cast<int64_t>(tokens.size()) == n && static_cast<int64_t>(positions.size()) == n,
             "forward_rows: ", tokens.size(), " tokens and ", positions.size(), " positions for a store of ", n, " rows");
  for (int64_t r = 0; r < n; ++r) {
    LOOM_CHECK(positions[r] >= 0 && positions[r] < config_.max_seq_len, "forward_rows: position ", positions[r],
               " outside [0, model.max_seq_len = ", config_.max_seq_len, ")");
  }
  backend_.write(s.tokens, tokens.data());
  if (pos_w.defined()) {  // learned positions: the rows' positions as ids, in the rows' targets (decoding has none)
    const std::vector<int32_t> ids(positions.begin(), positions.end());
    backend_.write(s.targets, ids.data());
  }
  LOOM_CHECK(!graph || step_graphs(), "forward_rows: this model's decoding step cannot be one graph");
  const int64_t graph_key = n * 65536 + (logit_rows ? static_cast<int64_t>(logit_rows->size()) : n);
  StepGraphScope recording(backend_, graph, graph_key);
  if (pos_w.defined()) {
    // Each row's token embedding, then its position's row of pos_w looked up the same way and
    // added: bitwise the one lookup with positions (one rounding of token + position), in three
    // ops whatever the rows (a lookup per row claimed an id-check slot each, which a step graph
    // cannot read back mid-capture when they run out).
    backend_.embedding_forward(s.tokens, embed_w, nullptr, s.blocks[0].input);
    backend_.embedding_forward(s.targets, pos_w, nullptr, s.final_input);
    backend_.add_inplace(s.blocks[0].input, s.final_input);
  } else {
    backend_.embedding_forward(s.tokens, embed_w, nullptr, s.blocks[0].input);
  }
  if (config_.embed_scale > 0.0f) backend_.scale_inplace(s.blocks[0].input, config_.embed_scale);
  for (size_t l = 0; l < blocks_.size(); ++l) {
    const Tensor& out = l + 1 < blocks_.size() ? s.blocks[l + 1].input : s.final_input;
    blocks_[l].forward_rows(backend_, s.blocks[l], out, positions, cache, static_cast<int64_t>(l));
  }
  norm_forward(backend_, config_, s.final_input, final_w, final_b, s.final_norm, s.final_mean, s.final_rstd);
  if (logit_rows == nullptr) {
    LOOM_CHECK(s.logits.dim(0) == n, "forward_rows: a store with logits for ", s.logits.dim(0), " of its ", n,
               " rows needs the rows named");
    head_.forward_plain(backend_, s.final_norm, head_w, Tensor{}, s.logits, 0.0f, &ws_);
    recording.launch();
    return;
  }
  // The named rows' normed states moved to the front (row r >= i to row i, in order), then the head on those.
  const int64_t k = static_cast<int64_t>(logit_rows->size()), V = config_.vocab_size;
  LOOM_CHECK(k >= 1 && k <= s.logits.dim(0), "forward_rows: ", k, " logit rows for a store with logits for ",
             s.logits.dim(0));
  for (int64_t i = 0; i < k; ++i) {
    const int64_t r = (*logit_rows)[static_cast<size_t>(i)];
    LOOM_CHECK(r < n && (i == 0 ? r >= 0 : r > (*logit_rows)[static_cast<size_t>(i - 1)]), "forward_rows: logit rows must "
               "increase within [0, ", n, "), got ", r, " at ", i);
    if (r != i) backend_.copy(s.final_norm.view(r * C, {1, 1, C}), s.final_norm.view(i * C, {1, 1, C}));
  }
  head_.forward_plain(backend_, s.final_norm.view(0, {k, 1, C}), head_w, Tensor{}, s.logits.view(0, {k, 1, V}), 0.0f, &ws_);
  recording.launch();
}

void Transformer::set_tensor_parallel(Communicator* tp, int64_t vocab_begin, int64_t vocab_valid, bool sequence_parallel) {
  LOOM_CHECK(tp == nullptr || (vocab_begin >= 0 && vocab_valid >= 0 && vocab_valid <= config_.vocab_size),
             "tensor parallel: vocabulary rows [", vocab_begin, ", +", vocab_valid, ") do not fit this slice's ",
             config_.vocab_size, " rows");
  LOOM_CHECK(scratch_tokens_ == 0, "set_tensor_parallel must come before the activation stores are allocated");
  LOOM_REFUSED(tp == nullptr || !sequence_parallel || config_.moe_experts == 0, "parallel.sequence_parallel with an "
               "MoE model (model.moe_experts = ", config_.moe_experts, ") is not supported yet");
  tp_ = tp;
  vocab_ = {vocab_begin, vocab_valid};
  sp_ = sequence_parallel && tp != nullptr;
  for (Block& b : blocks_) b.set_tensor_parallel(tp, sp_ ? &seq_ : nullptr);
}

void Transformer::set_expert_parallel(Communicator* ep) {
  if (ep != nullptr && ep->size() > 1) {
    LOOM_CHECK(scratch_tokens_ == 0, "set_expert_parallel must come before the activation stores are allocated");
    LOOM_CHECK(config_.moe_experts > 0, "parallel.ep = ", ep->size(), " needs an MoE model (model.moe_experts > 0)");
    LOOM_CHECK(config_.moe_experts % ep->size() == 0, "parallel.ep = ", ep->size(), " must divide model.moe_experts = ",
               config_.moe_experts);
  }
  ep_ = ep != nullptr && ep->size() > 1 ? ep : nullptr;
  for (Block& b : blocks_) b.set_expert_parallel(ep_);
}

std::vector<LayerPlan> Transformer::layer_plans() const {
  std::vector<LayerPlan> plans;
  for (const Block& b : blocks_) plans.push_back(b.plan());
  return plans;
}

RangeSet Transformer::expert_ranges(bool own) const {
  return ep_ == nullptr ? RangeSet{} : moe_expert_ranges(config_, layout_, ep_->rank(), ep_->size(), own);
}

void Transformer::set_context_parallel(Communicator* cp, bool ulysses) {
  LOOM_CHECK(scratch_tokens_ == 0, "set_context_parallel must come before the activation stores are allocated");
  LOOM_REFUSED(cp == nullptr || !sp_, "context parallel with sequence parallel is not supported yet");
  LOOM_REFUSED(cp == nullptr || config_.moe_experts == 0, "parallel.cp > 1 with an MoE model (model.moe_experts = ",
               config_.moe_experts, ") is not supported yet");
  cp_ = ContextParallel{};
  cp_.comm = cp;
  cp_.ulysses = ulysses;
  for (Block& b : blocks_) b.set_context_parallel(cp != nullptr ? &cp_ : nullptr);
}

void Transformer::for_each_chunk(const Tensor& x, const std::function<void(const Tensor&, int64_t)>& f) const {
  const int64_t B = x.dim(0), Tl = x.dim(1), C = x.dim(2), chunk = Tl / 2;
  for (int c = 0; c < 2; ++c) {
    for (int64_t b = 0; b < B; ++b) f(x.view((b * Tl + c * chunk) * C, {1, chunk, C}), cp_.chunk_starts[static_cast<size_t>(c)]);
  }
}

std::vector<std::pair<int64_t, int64_t>> Transformer::tp_partial_ranges() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  if (tp_ == nullptr || tp_->size() == 1) return out;
  const auto add = [&](const Tensor& t) {
    if (!t.defined()) return;
    const int64_t begin = (static_cast<const char*>(t.device_ptr()) - static_cast<const char*>(grads_.device_ptr())) /
                          static_cast<int64_t>(sizeof(float));
    // Frozen (LoRA's base: the norms' gradients go to a sink no one reads): nothing to sum.
    if (begin < frozen_end_ || begin + t.numel() > grads_.numel()) return;
    out.emplace_back(begin, begin + t.numel());
  };
  for (int64_t l = 0; l < config_.n_layer; ++l) {
    const BlockParams g = block_params_view(config_, layout_, grads_, l);
    if (sp_) {
      for (const Tensor& t : {g.attention.norm_w, g.attention.norm_b, g.mlp.norm_w, g.mlp.norm_b}) add(t);
    }
    // Weights shared by the heads the ranks split (per-head q/k norms, the gated DeltaNet's gated
    // norm): each rank's heads give part of their gradient.
    for (const Tensor& t : {g.attention.q_norm, g.attention.k_norm, g.linear.gate_norm_w}) add(t);
    // LoRA: each rank's output slice (q/k/v, gate/up) or input slice (o, down) gives part of the
    // gradient of the adapter matrix all ranks hold.
    for (const LoraAdapter& a : g.attention.qkv_lora) add(a.a);
    for (const LoraAdapter& a : g.mlp.fc_lora) add(a.a);
    for (const LoraAdapter& a : g.attention.proj_lora) add(a.b);
    for (const LoraAdapter& a : g.mlp.fc2_lora) add(a.b);
  }
  if (sp_) {
    for (const Tensor& t : {d_final_w, d_final_b, d_pos_w}) add(t);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void Transformer::backward(ActivationStore& s, float loss_weight, const std::function<void(int64_t)>& ready) {
  backward_stage(s, 0, config_.n_layer, loss_weight, BACKWARD_ALL, ready);
}

void Transformer::backward_stage(ActivationStore& s, int64_t first, int64_t last, float loss_weight, BackwardPart part,
                                 const std::function<void(int64_t)>& ready) {
  LOOM_CHECK(grads_.defined(), "backward of a model loaded for inference (no gradient buffers; ModelUse in "
             "model/transformer.h)");
  const int64_t B = s.batch, T = s.seq_len;
  const Tensor d_res = stage_grad(B, T);
  BlockScratch k = scratch_;
  for (Tensor* t : {&k.d_norm, &k.d_tmp, &k.d_qkv, &k.d_attn, &k.d_fc, &k.d_act}) {
    *t = t->view(0, {B, T, t->dim(-1)});
  }
  const auto use = [this](int unit) { if (hooks_.use) hooks_.use(unit, true); };
  const auto done = [this](int unit) { if (hooks_.done) hooks_.done(unit, true); };
  for (int64_t l = first; l < last; ++l) blocks_[l].set_loss_weight(loss_weight);  // MoE auxiliary losses
  set_documents(s, first, last);
  if (part == BACKWARD_WEIGHT) {  // zero-bubble W: the blocks' weight gradients, kept from the input pass
    for (int64_t l = last; l-- > first;) blocks_[l].backward(backend_, s.blocks[l], d_res, k, BACKWARD_WEIGHT);
    return;
  }
  // d_res rounded to bf16 for the fc2 of block l where its plan reads it so (nn/layer.h
  // residual_dy16), written by the norm backward that finalises d_res: the final norm's for the
  // last block, block l + 1's norm1 for the others (not across a stage's edges: none before `first`,
  // and a later stage's d_res comes from the caller).
  const auto fc2_dy16 = [&](int64_t l) {
    return l >= first ? residual_dy16(blocks_[l].plan(), LINEAR_MLP_OUT, part, &ws_, d_res.shape()) : Tensor{};
  };
  Tensor d_res16;
  if (last == config_.n_layer) {
    use(0);
    d_res16 = fc2_dy16(last - 1);
    head_and_loss_backward(s, loss_weight, k, d_res, d_res16);
    if (ready && frozen_end_ == 0) ready(final_offset_);  // LoRA: the adapters, last in the buffer, finish last
  }  // else d_res holds d(stage output), put there by the caller (stage_grad)
  for (int64_t l = last; l-- > first;) {
    use(static_cast<int>(l) + 1);
    const ResidualDy16 r16{d_res16, fc2_dy16(l - 1)};
    if (!recompute_.empty() && recompute_[l] != RECOMPUTE_NONE) {  // the kept fields, completed
      BlockSaved full = recompute_record_;
      blocks_[l].recompute(backend_, s.blocks[l], recompute_[l], full, recompute_out_);
      blocks_[l].backward(backend_, full, d_res, k, part, r16);
    } else {
      blocks_[l].backward(backend_, s.blocks[l], d_res, k, part, r16);
    }
    d_res16 = r16.out;
    done(static_cast<int>(l) + 1);
    if (ready && frozen_end_ == 0) ready(block_offset_[l]);
  }
  if (first > 0) return;  // d_res now holds d(stage input)
  if (d_embed_w.defined()) embedding_backward(s, d_res);  // (frozen embeddings, LoRA: none)
  done(0);
  if (ready) ready(0);
}

Tensor Transformer::logits_backward(ActivationStore& s, float loss_weight) {
  const int64_t B = s.batch, T = s.seq_len;
  // d(logits) replaces the logits in place: dL/dlogit = w/(B T) (softmax - onehot).
  const float scale = loss_weight * s.ce_weight / static_cast<float>(B * T);
  const Tensor dlogits = s.dlogits.defined() ? s.dlogits : s.logits;
  if (s.dlogits.defined()) {  // the loss pass computed it (ActivationStore::fused_loss_weight)
    LOOM_CHECK(s.dlogits_weight == loss_weight && s.position_weights.empty() && s.row_weights.empty() &&
               !s.logit_grad.defined(), "backward: the loss pass computed d(logits) with loss weight ",
               s.dlogits_weight, ", backward runs with ", loss_weight, " (or per-row / position weights or a logit "
               "gradient were set after the forward)");
  } else if (!s.position_weights.empty()) {  // each position its own weight (one op per position that has one)
    LOOM_CHECK(tp_ == nullptr && static_cast<int64_t>(s.position_weights.size()) == B * T, "per-position loss weights: ",
               s.position_weights.size(), " weights for ", B * T, " positions",
               tp_ != nullptr ? " (not with tensor parallelism)" : "");
    const int64_t V = s.logits.dim(-1);
    for (int64_t i = 0; i < B * T; ++i) {
      const Tensor logits = s.logits.view(i * V, {1, V});
      const float w = s.position_weights[static_cast<size_t>(i)];
      if (w == 0.0f) backend_.fill(logits, 0.0);  // a masked or weightless position: no gradient
      else backend_.cross_entropy_backward(logits, s.targets.view(i, {1}), s.lse.view(i, {1}), loss_weight * w, logits);
    }
  } else if (!s.row_weights.empty()) {  // a sequence-level objective: each row its own weight
    LOOM_CHECK(tp_ == nullptr && static_cast<int64_t>(s.row_weights.size()) == B, "per-row loss weights: ",
               s.row_weights.size(), " weights for ", B, " rows", tp_ != nullptr ? " (not with tensor parallelism)" : "");
    const int64_t V = s.logits.dim(-1);
    for (int64_t b = 0; b < B; ++b) {
      const Tensor logits = s.logits.view(b * T * V, {T, V});
      backend_.cross_entropy_backward(logits, s.targets.view(b * T, {T}), s.lse.view(b * T, {T}),
                                      loss_weight * s.row_weights[static_cast<size_t>(b)], logits);
    }
  } else if (tp_ != nullptr) {
    vocab_parallel_cross_entropy_backward(backend_, s.logits, s.targets, s.lse, vocab_.begin, vocab_.valid, scale,
                                          s.logits);
  } else {
    backend_.cross_entropy_backward(s.logits, s.targets, s.lse, scale, s.logits);
  }
  if (s.logit_grad.defined()) {  // a soft-target term (already scaled by its weight and 1/(B T))
    LOOM_CHECK(tp_ == nullptr && s.row_weights.empty() && s.position_weights.empty(), "a logit gradient (soft targets) "
               "with tensor parallelism or per-row weights is not supported");
    backend_.axpy(s.logits, s.logit_grad, loss_weight);
  }
  return dlogits;
}

void Transformer::head_and_loss_backward(ActivationStore& s, float loss_weight, BlockScratch& k, const Tensor& d_res,
                                         const Tensor& d_res16) {
  const Tensor dlogits = logits_backward(s, loss_weight);
  // d_norm = d_logits @ W (B*T, C); dW += d_logits^T @ final_norm (V, C)
  if (s.dlogits_by_columns) head_.backward_columns(backend_, s.final_norm, head_w, head16_, dlogits, k.d_norm, d_head_w, &ws_);
  else head_.backward(backend_, s.final_norm, head_w, head16_, dlogits, k.d_norm, d_head_w, Tensor{}, &ws_);
  s.dlogits = Tensor{}, s.dlogits_by_columns = false;
  Tensor dn = k.d_norm;
  if (sp_) {  // reduced onto the shard
    dn = k.d_tmp.view(0, d_res.shape());
    sequence_reduce_scatter(backend_, *tp_, k.d_norm, dn, seq_.staging);
  } else if (tp_ != nullptr) {
    tp_->all_reduce(k.d_norm);  // f: the vocabulary slices' partial d(final norm)
  }
  norm_backward(backend_, config_, dn, s.final_input, final_w, s.final_mean, s.final_rstd, d_res, d_final_w, d_final_b,
                false, d_res16);
}

void Transformer::embedding_backward(ActivationStore& s, const Tensor& d_res) {
  const int64_t B = s.batch, T = s.seq_len;
  if (config_.embed_scale > 0.0f) backend_.scale_inplace(d_res, config_.embed_scale);  // d(rows) = scale d(x0)
  const auto d_positions = [&](const Tensor& d) {  // learned positions, restarted at packed documents' starts
    for_each_document(s, d, [&](const Tensor& rows) { positions_backward(backend_, rows, d_pos_w); });
  };
  const auto chunk_positions = [&] {
    for_each_chunk(d_res, [&](const Tensor& rows, int64_t start) { positions_backward(backend_, rows, d_pos_w, start); });
  };
  if (sp_) {  // the shards' gradients gathered for the vocabulary-parallel embedding
    const Tensor full = seq_.full.view(0, {B, T, config_.d_model});
    sequence_all_gather(backend_, *tp_, d_res, full, seq_.staging);
    vocab_parallel_embedding_backward(backend_, s.tokens, full, d_embed_w, vocab_.begin, vocab_.valid);
    if (d_pos_w.defined()) positions_backward(backend_, d_res, d_pos_w, tp_->rank() * d_res.dim(1));
  } else if (tp_ != nullptr) {
    vocab_parallel_embedding_backward(backend_, s.tokens, d_res, d_embed_w, vocab_.begin, vocab_.valid);
    if (d_pos_w.defined() && cp_.comm != nullptr) chunk_positions();
    else if (d_pos_w.defined()) d_positions(d_res);
  } else if (cp_.comm != nullptr) {
    backend_.embedding_backward(s.tokens, d_res, d_embed_w, nullptr);
    if (d_pos_w.defined()) chunk_positions();
  } else if (!s.docs.empty() && d_pos_w.defined()) {
    backend_.embedding_backward(s.tokens, d_res, d_embed_w, nullptr);
    d_positions(d_res);
  } else {
    backend_.embedding_backward(s.tokens, d_res, d_embed_w, d_pos_w.defined() ? &d_pos_w : nullptr);
  }
}

}  // namespace loom
