#include "loom/arch/param_layout.h"

#include <algorithm>
#include <cmath>
#include <string_view>

#include "loom/core/error.h"

namespace loom {

const ParamSpec& ParamLayout::find(const std::string& name) const {
  for (const ParamSpec& p : params) {
    if (p.name == name) return p;
  }
  throw Error(str_cat("no parameter named '", name, "' in this model"));
}

namespace {

class LayoutBuilder {
 public:
  explicit LayoutBuilder(ParamLayout& layout) : layout_(layout) {}

  // A matrix whose segments are given (fused Q/K/V or gate/up); by default one segment.
  void matrix(std::string name, Shape shape, float std, ParamRole role = ROLE_HIDDEN,
              std::vector<ParamSegment> segments = {}) {
    if (segments.empty()) segments = {{shape[0], 1}};
    add(std::move(name), std::move(shape), role, std::move(segments), INIT_NORMAL, std);
  }
  void norm_weight(std::string name, int64_t c) { add(std::move(name), {c}, ROLE_VECTOR, {{1, 1}}, INIT_ONES, 0.0f); }
  void bias(std::string name, int64_t n) { add(std::move(name), {n}, ROLE_VECTOR, {{1, 1}}, INIT_ZEROS, 0.0f); }
  // DoRA's magnitude: ones here, set to the base rows' norms once the base is in place
  // (Transformer::init_dora_magnitudes).
  void magnitude(std::string name, int64_t n) { add(std::move(name), {n}, ROLE_VECTOR, {{1, 1}}, INIT_ONES, 0.0f); }
  void buffer(std::string name, int64_t n) { add(std::move(name), {n}, ROLE_BUFFER, {{1, 1}}, INIT_ZEROS, 0.0f); }
  void zero_matrix(std::string name, Shape shape) {
    const int64_t rows = shape[0];
    add(std::move(name), std::move(shape), ROLE_HIDDEN, {{rows, 1}}, INIT_ZEROS, 0.0f);
  }

 private:
  void add(std::string name, Shape shape, ParamRole role, std::vector<ParamSegment> segments, ParamInit init, float std) {
    ParamSpec spec;
    spec.name = std::move(name);
    spec.numel = shape_numel(shape);
    spec.shape = std::move(shape);
    spec.offset = layout_.total;
    spec.role = role;
    spec.segments = std::move(segments);
    spec.init = init;
    spec.init_std = std;
    LOOM_CHECK(!__builtin_add_overflow(layout_.total, spec.numel, &layout_.total), "the model's parameters (at ",
               spec.name, ") number more than an int64 holds");
    layout_.params.push_back(std::move(spec));
  }
  ParamLayout& layout_;
};

// An MoE block's MLP (nn/moe.h): names follow Hugging Face's DeepSeek/Qwen-MoE for Llama
// (mlp.gate.weight, mlp.gate.e_score_correction_bias, mlp.experts.{e}.gate_up_proj.weight, ...)
// and the GPT-2 block's for GPT-2 (mlp.router.weight, mlp.experts.{e}.c_fc.weight, ...). The
// experts have no biases.
void add_moe(const ModelConfig& c, LayoutBuilder& b, const std::string& p, float std, float residual_std) {
  const int64_t C = c.d_model, F = c.expert_ff(), S = c.moe_shared * F;
  const bool llama = c.gated_mlp();
  b.matrix(p + (llama ? "mlp.gate.weight" : "mlp.router.weight"), {c.moe_experts, C}, std);
  if (c.moe_router_bias) b.bias(p + "mlp.gate.bias", c.moe_experts);
  b.buffer(p + (llama ? "mlp.gate.e_score_correction_bias" : "mlp.router.bias_correction"), c.moe_experts);
  for (int64_t e = 0; e < c.moe_experts; ++e) {
    const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
    if (llama) {
      b.matrix(x + "gate_up_proj.weight", {2 * F, C}, std, ROLE_HIDDEN, {{F, 1}, {F, 1}});
      if (c.moe_expert_bias) b.bias(x + "gate_up_proj.bias", 2 * F);
      b.matrix(x + "down_proj.weight", {C, F}, residual_std);
      if (c.moe_expert_bias) b.bias(x + "down_proj.bias", C);
    } else {
      b.matrix(x + "c_fc.weight", {F, C}, std);
      b.matrix(x + "c_proj.weight", {C, F}, residual_std);
    }
  }
  if (S == 0) return;
  if (llama) {
    b.matrix(p + "mlp.shared_experts.gate_up_proj.weight", {2 * S, C}, std, ROLE_HIDDEN, {{S, 1}, {S, 1}});
    b.matrix(p + "mlp.shared_experts.down_proj.weight", {C, S}, residual_std);
    if (c.moe_shared_gate) b.matrix(p + "mlp.shared_expert_gate.weight", {1, C}, std);
  } else {
    b.matrix(p + "mlp.shared_experts.c_fc.weight", {S, C}, std);
    b.matrix(p + "mlp.shared_experts.c_proj.weight", {C, S}, residual_std);
  }
}

void add_gpt2(const ModelConfig& c, LayoutBuilder& b) {
  const int64_t C = c.d_model, F = c.d_ff, V = c.vocab_size;
  // GPT-2 scales the init of residual-output projections by 1/sqrt(2 L) (Radford et al. 2019).
  const float std = c.init_std, residual_std = c.init_std / std::sqrt(2.0f * static_cast<float>(c.n_layer));
  const int64_t hd = c.head_dim(), A = c.n_head * hd;  // A = C, but for a tensor-parallel slice
  b.matrix("wte.weight", {V, C}, std, ROLE_EMBEDDING);
  b.matrix("wpe.weight", {c.max_seq_len, C}, std, ROLE_EMBEDDING);
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const std::string p = "h." + std::to_string(i) + ".";
    b.norm_weight(p + "ln_1.weight", C);
    b.bias(p + "ln_1.bias", C);
    b.matrix(p + "attn.c_attn.weight", {3 * A, C}, std, ROLE_HIDDEN, {{A, hd}, {A, hd}, {A, 1}});
    b.bias(p + "attn.c_attn.bias", 3 * A);
    b.matrix(p + "attn.c_proj.weight", {C, A}, residual_std);
    b.bias(p + "attn.c_proj.bias", C);
    b.norm_weight(p + "ln_2.weight", C);
    b.bias(p + "ln_2.bias", C);
    if (c.moe_layer(i)) {
      add_moe(c, b, p, std, residual_std);
      continue;
    }
    b.matrix(p + "mlp.c_fc.weight", {F, C}, std);
    b.bias(p + "mlp.c_fc.bias", F);
    b.matrix(p + "mlp.c_proj.weight", {C, F}, residual_std);
    b.bias(p + "mlp.c_proj.bias", C);
  }
  b.norm_weight("ln_f.weight", C);
  b.bias("ln_f.bias", C);
}

// A block's MLA attention (nn/mla.h; DeepSeek-V2 §2.1) under Hugging Face DeepSeek-V2's names:
// the queries (q_proj, or q_a_proj, q_a_layernorm, q_b_proj), rows [q_n | q_r] per head; the
// latent and the decoupled RoPE key together (kv_a_proj_with_mqa: d_c + d_r rows), the latent's
// norm, the up-projection to [k_n | v] per head (kv_b_proj), and o_proj (C, H d_v).
void add_mla(const ModelConfig& c, LayoutBuilder& b, const std::string& p, float std, float residual_std) {
  const int64_t C = c.d_model, H = c.n_head, qk = c.mla_qk(), dc = c.mla_kv_rank, dq = c.mla_q_rank;
  if (dq > 0) {
    b.matrix(p + "self_attn.q_a_proj.weight", {dq, C}, std);
    b.norm_weight(p + "self_attn.q_a_layernorm.weight", dq);
    b.matrix(p + "self_attn.q_b_proj.weight", {H * qk, dq}, std, ROLE_HIDDEN, {{H * qk, qk}});
  } else {
    b.matrix(p + "self_attn.q_proj.weight", {H * qk, C}, std, ROLE_HIDDEN, {{H * qk, qk}});
  }
  b.matrix(p + "self_attn.kv_a_proj_with_mqa.weight", {dc + c.mla_rope_dim, C}, std, ROLE_HIDDEN,
           {{dc, 1}, {c.mla_rope_dim, c.mla_rope_dim}});
  b.norm_weight(p + "self_attn.kv_a_layernorm.weight", dc);
  b.matrix(p + "self_attn.kv_b_proj.weight", {H * (c.mla_nope() + c.mla_v()), dc}, std);
  b.matrix(p + "self_attn.o_proj.weight", {C, c.attn_width()}, residual_std);
}

// A gated DeltaNet block's token mixer (nn/linear_attention.h) under transformers' Qwen3-Next
// names, its projections' rows in Loom's order ([q | k | v | z] and [b | a], the Hub's key-head
// groups permuted on import): A_log starts at 0 (A = 1), dt_bias at 1 (transformers' init) and
// the gated norm's weight at 1.
void add_linear_attention(const ModelConfig& c, LayoutBuilder& b, const std::string& p, float std, float residual_std) {
  const int64_t C = c.d_model, Hv = c.linear_value_heads, Dq = c.linear_key_heads * c.linear_key_dim;
  const int64_t Dv = Hv * c.linear_value_dim;
  const std::string a = p + "linear_attn.";
  b.matrix(a + "in_proj_qkvz.weight", {2 * Dq + 2 * Dv, C}, std);
  b.matrix(a + "in_proj_ba.weight", {2 * Hv, C}, std);
  b.matrix(a + "conv1d.weight", {2 * Dq + Dv, c.linear_conv_taps}, std);
  b.bias(a + "A_log", Hv);
  b.norm_weight(a + "dt_bias", Hv);
  b.norm_weight(a + "norm.weight", c.linear_value_dim);
  b.matrix(a + "out_proj.weight", {C, Dv}, residual_std);
}

void add_llama(const ModelConfig& c, LayoutBuilder& b) {
  const int64_t C = c.d_model, F = c.d_ff, V = c.vocab_size;
  const float std = c.init_std, residual_std = c.init_std / std::sqrt(2.0f * static_cast<float>(c.n_layer));
  const int64_t hd = c.head_dim(), kv = c.n_kv_head * c.head_dim();
  b.matrix("model.embed_tokens.weight", {V, C}, std, ROLE_EMBEDDING);
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    // Each norm takes the transformers name of the norm it is (Llama's "post_attention_layernorm"
    // is the MLP's input norm; OLMo 2's and Gemma's the attention output's).
    if (c.pre_norms()) b.norm_weight(p + "input_layernorm.weight", C);
    if (c.linear_layer(i)) {
      add_linear_attention(c, b, p, std, residual_std);
    } else if (c.mla()) {
      add_mla(c, b, p, std, residual_std);
    } else {
      b.matrix(p + "self_attn.qkv_proj.weight", {c.qkv_width(), C}, std, ROLE_HIDDEN,
               {{c.n_head * hd, hd}, {kv, hd}, {kv, 1}});
      if (c.qkv_bias) b.bias(p + "self_attn.qkv_proj.bias", c.qkv_width());
      if (c.qk_norm) {
        b.norm_weight(p + "self_attn.q_norm.weight", c.q_norm_width());
        b.norm_weight(p + "self_attn.k_norm.weight", c.k_norm_width());
      }
      if (c.attn_output_gate) b.matrix(p + "self_attn.gate_proj.weight", {c.n_head * hd, C}, std, ROLE_HIDDEN, {{c.n_head * hd, hd}});
      if (c.attn_sinks) b.bias(p + "self_attn.sinks", c.n_head);
      b.matrix(p + "self_attn.o_proj.weight", {C, c.n_head * c.head_dim()}, residual_std);
      if (c.attn_out_bias) b.bias(p + "self_attn.o_proj.bias", C);
    }
    if (c.post_norms()) b.norm_weight(p + "post_attention_layernorm.weight", C);
    if (c.pre_norms()) b.norm_weight(p + (c.sandwich_norm ? "pre_feedforward_layernorm.weight" : "post_attention_layernorm.weight"), C);
    if (c.moe_layer(i)) {
      add_moe(c, b, p, std, residual_std);
      continue;
    }
    b.matrix(p + "mlp.gate_up_proj.weight", {2 * F, C}, std, ROLE_HIDDEN, {{F, 1}, {F, 1}});
    b.matrix(p + "mlp.down_proj.weight", {C, F}, residual_std);
    if (c.post_norms()) b.norm_weight(p + "post_feedforward_layernorm.weight", C);
  }
  b.norm_weight("model.norm.weight", C);
  if (!c.tie_embeddings) b.matrix("lm_head.weight", {V, C}, std, ROLE_HEAD);
}

}  // namespace

const char* embedding_param_name(const ModelConfig& config) {
  return config.arch == ARCH_GPT2 ? "wte.weight" : "model.embed_tokens.weight";
}

const char* head_param_name(const ModelConfig& config) {
  return config.tied_head() ? embedding_param_name(config) : "lm_head.weight";
}

bool is_gpt2_conv1d_weight(const std::string& name) {
  static const char* const kSuffixes[] = {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight",
                                          ".mlp.c_proj.weight"};
  if (name.rfind("h.", 0) != 0) return false;
  for (const char* suffix : kSuffixes) {
    const std::string_view s(suffix);
    if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0) return true;
  }
  return false;
}

std::vector<LoraSite> lora_sites(const ModelConfig& c, int64_t layer) {
  std::vector<LoraSite> sites;
  if (!c.lora()) return sites;
  const uint32_t mask = c.lora_target_mask();
  const auto on = [&](LoraTarget t) { return (mask & (1u << t)) != 0; };
  const int64_t C = c.d_model, F = c.d_ff, q = c.n_head * c.head_dim(), kv = c.n_kv_head * c.head_dim();
  const bool mlp = !c.moe_layer(layer);
  if (c.arch == ARCH_GPT2) {
    const std::string p = "h." + std::to_string(layer) + ".";
    // q, k and v are one matrix in Hugging Face's GPT-2 (c_attn): any of them adapts it whole.
    const auto add = [&](LoraLinear linear, const std::string& module, int64_t in, int64_t out) {
      sites.push_back({linear, p + module, p + module + ".weight", in, 0, out});
    };
    if (on(LORA_Q) || on(LORA_K) || on(LORA_V)) add(LORA_ON_QKV, "attn.c_attn", C, c.qkv_width());
    if (on(LORA_O)) add(LORA_ON_PROJ, "attn.c_proj", q, C);
    if (mlp && on(LORA_UP)) add(LORA_ON_FC, "mlp.c_fc", C, F);
    if (mlp && on(LORA_DOWN)) add(LORA_ON_FC2, "mlp.c_proj", F, C);
    return sites;
  }
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const std::string qkv = p + "self_attn.qkv_proj.weight", gate_up = p + "mlp.gate_up_proj.weight";
  const auto add = [&](LoraLinear linear, const std::string& module, const std::string& weight, int64_t in,
                       int64_t begin, int64_t out) { sites.push_back({linear, p + module, weight, in, begin, out}); };
  const bool attn = !c.linear_layer(layer);  // a gated DeltaNet block has no q/k/v/o (PEFT's names match none)
  if (attn && on(LORA_Q)) add(LORA_ON_QKV, "self_attn.q_proj", qkv, C, 0, q);
  if (attn && on(LORA_K)) add(LORA_ON_QKV, "self_attn.k_proj", qkv, C, q, kv);
  if (attn && on(LORA_V)) add(LORA_ON_QKV, "self_attn.v_proj", qkv, C, q + kv, kv);
  if (attn && on(LORA_O)) add(LORA_ON_PROJ, "self_attn.o_proj", p + "self_attn.o_proj.weight", q, 0, C);
  if (mlp && on(LORA_GATE)) add(LORA_ON_FC, "mlp.gate_proj", gate_up, C, 0, F);
  if (mlp && on(LORA_UP)) add(LORA_ON_FC, "mlp.up_proj", gate_up, C, F, F);
  if (mlp && on(LORA_DOWN)) add(LORA_ON_FC2, "mlp.down_proj", p + "mlp.down_proj.weight", F, 0, C);
  return sites;
}

int64_t lora_begin(const ModelConfig& /*config*/, const ParamLayout& layout) {
  for (const ParamSpec& p : layout.params) {
    if (p.name.find(".lora_A.") != std::string::npos) return p.offset;
  }
  return layout.total;
}

ParamLayout build_param_layout(const ModelConfig& config) {
  config.validate();
  ParamLayout layout;
  LayoutBuilder builder(layout);
  if (config.arch == ARCH_GPT2) add_gpt2(config, builder);
  else add_llama(config, builder);
  // LoRA: A like PEFT's default (Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)),
  // here a normal of the same variance 1 / (3 in)), B zero, so the adapted model starts as the base.
  for (int64_t l = 0; l < config.n_layer; ++l) {
    for (const LoraSite& site : lora_sites(config, l)) {
      builder.matrix(site.module + ".lora_A.weight", {config.lora_rank, site.in},
                     static_cast<float>(1.0 / std::sqrt(3.0 * static_cast<double>(site.in))));
      builder.zero_matrix(site.module + ".lora_B.weight", {site.out_count, config.lora_rank});
      if (config.lora_dora) builder.magnitude(site.module + ".lora_magnitude_vector", site.out_count);
    }
  }
  return layout;
}

std::vector<RangeSet> layout_units(const ModelConfig& config, const ParamLayout& layout) {
  const int64_t base_end = lora_begin(config, layout);
  std::vector<int64_t> block_offset(static_cast<size_t>(config.n_layer), base_end);
  std::vector<RangeSet> adapters(static_cast<size_t>(config.n_layer));
  int64_t final_offset = base_end;
  const std::string block_prefix = config.arch == ARCH_GPT2 ? "h." : "model.layers.";
  for (const ParamSpec& p : layout.params) {
    if (p.offset >= base_end) {  // a block's adapters
      const size_t l = std::stoul(p.name.substr(block_prefix.size()));
      adapters[l] = adapters[l].unite(RangeSet::span(p.offset, p.offset + p.numel));
    } else if (p.name.rfind(block_prefix, 0) == 0) {
      const size_t l = std::stoul(p.name.substr(block_prefix.size()));
      block_offset[l] = std::min(block_offset[l], p.offset);
    } else if (p.name.find("ln_f") == 0 || p.name == "model.norm.weight" || p.name == "lm_head.weight") {
      final_offset = std::min(final_offset, p.offset);
    }
  }
  std::vector<RangeSet> units;
  const int64_t first_block = block_offset.empty() ? final_offset : block_offset[0];
  units.push_back({{0, first_block}, {final_offset, base_end}});
  for (size_t l = 0; l < block_offset.size(); ++l) {
    units.push_back(RangeSet::span(block_offset[l], l + 1 < block_offset.size() ? block_offset[l + 1] : final_offset)
                        .unite(adapters[l]));
  }
  return units;
}

}  // namespace loom
