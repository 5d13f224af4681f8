#include "loom/arch/config.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>
#include <utility>

#include "loom/core/error.h"
#include "loom/arch/param_layout.h"

namespace loom {

namespace {
constexpr std::string_view kArchNames[] = {"gpt2", "llama"};
static_assert(sizeof(kArchNames) / sizeof(kArchNames[0]) == ARCH_COUNT);
// longrope's comma-separated factors (model.rope_short_factors / rope_long_factors), each > 0.
std::vector<float> parse_factors(const std::string& text, const char* key) {
  std::vector<float> out;
  size_t begin = 0;
  while (begin < text.size()) {
    const size_t end = std::min(text.find(',', begin), text.size());
    const std::string item = text.substr(begin, end - begin);
    char* stop = nullptr;
    const float v = std::strtof(item.c_str(), &stop);
    LOOM_CHECK(!item.empty() && stop != nullptr && *stop == '\0' && std::isfinite(v) && v > 0.0f, key, ": '", item,
               "' is not a positive number (expected head_dim / 2 comma-separated factors)");
    out.push_back(v);
    begin = end + 1;
  }
  return out;
}

constexpr int64_t kMaxLayers = 4096, kMaxExperts = 4096, kMaxExpertBlocks = int64_t{1} << 17;

}  // namespace

std::string_view arch_name(Arch arch) { return kArchNames[arch]; }

Arch arch_from_name(std::string_view name) {
  for (int a = 0; a < ARCH_COUNT; ++a) {
    if (kArchNames[a] == name) return static_cast<Arch>(a);
  }
  throw Error(str_cat("model.arch: unknown architecture '", name, "', expected one of: gpt2, llama"));
}

void ModelConfig::validate() const {
  auto positive = [](int64_t v, const char* key) { LOOM_CHECK(v > 0, key, " must be > 0, got ", v); };
  positive(vocab_size, "model.vocab_size");
  positive(max_seq_len, "model.max_seq_len");
  positive(n_layer, "model.n_layer");
  positive(n_head, "model.n_head");
  positive(n_kv_head, "model.n_kv_head");
  positive(d_model, "model.d_model");
  positive(d_ff, "model.d_ff");
  LOOM_CHECK(vocab_size <= INT32_MAX, "model.vocab_size must fit in int32, got ", vocab_size);
  // The parameter layout names every tensor of every block (and of every expert), so the block and
  // expert counts bound what describing a model costs before any weight is read: a config from a
  // file (a checkpoint's metadata, a config.json) is refused here rather than asking for gigabytes
  // of names. The bounds are far above published models (126 blocks, 384 experts, 61 x 384 expert
  // blocks for Kimi K2).
  LOOM_CHECK(n_layer <= kMaxLayers, "model.n_layer must be <= ", kMaxLayers, ", got ", n_layer);
  LOOM_CHECK(moe_experts <= kMaxExperts, "model.moe_experts must be <= ", kMaxExperts, ", got ", moe_experts);
  LOOM_CHECK(n_layer * moe_experts <= kMaxExpertBlocks, "model.n_layer x model.moe_experts must be <= ", kMaxExpertBlocks,
             ", got ", n_layer, " x ", moe_experts);
  LOOM_CHECK(head_size > 0 || d_model % n_head == 0, "model.d_model (", d_model, ") must be a multiple of model.n_head (",
             n_head, ")");
  LOOM_CHECK(head_size >= 0, "model head_size must be >= 0, got ", head_size);
  LOOM_CHECK(n_head % n_kv_head == 0, "model.n_head (", n_head, ") must be a multiple of model.n_kv_head (", n_kv_head,
             ")");
  LOOM_CHECK(arch != ARCH_GPT2 || n_kv_head == n_head, "model.n_kv_head must equal model.n_head for gpt2 (MHA), got ",
             n_kv_head, " vs ", n_head);
  LOOM_CHECK(arch != ARCH_LLAMA || mla_kv_rank > 0 || head_dim() % 2 == 0, "model.d_model / model.n_head must be even for RoPE, got ",
             head_dim());
  LOOM_CHECK(norm_eps > 0.0f, "model.norm_eps must be > 0, got ", norm_eps);
  LOOM_CHECK(rope_theta > 0.0f, "model.rope_theta must be > 0, got ", rope_theta);
  LOOM_CHECK(!qk_norm || (arch == ARCH_LLAMA && mla_kv_rank == 0), "model.qk_norm needs arch = llama without MLA");
  LOOM_CHECK(!qk_norm_whole || qk_norm, "model.qk_norm_whole needs model.qk_norm");
  LOOM_CHECK(!post_norm || (arch == ARCH_LLAMA && mla_kv_rank == 0 && moe_experts == 0),
             "model.post_norm (OLMo 2's output norms) needs arch = llama without MLA or MoE");
  LOOM_CHECK(!sandwich_norm || (arch == ARCH_LLAMA && mla_kv_rank == 0 && moe_experts == 0 && !post_norm),
             "model.sandwich_norm (Gemma's pre and post norms) needs arch = llama without MLA, MoE or model.post_norm");
  LOOM_CHECK(gate_activation == GateActivation::silu || arch == ARCH_LLAMA,
             "model.gate_activation needs arch = llama (gpt2's MLP is not gated)");
  LOOM_CHECK(embed_scale >= 0.0f && std::isfinite(embed_scale) && (embed_scale == 0.0f || arch == ARCH_LLAMA),
             "model.embed_scale must be >= 0 (0: none) and needs arch = llama, got ", embed_scale);
  LOOM_CHECK(window_pattern >= 0 && (window_pattern == 0 || (attn_window > 0 && mla_kv_rank == 0)),
             "model.window_pattern must be >= 0 and needs model.attn_window > 0 without MLA, got ", window_pattern);
  LOOM_CHECK(rope_local_theta >= 0.0f && (rope_local_theta == 0.0f || (window_pattern > 0 && arch == ARCH_LLAMA)),
             "model.rope_local_theta must be >= 0 and needs model.window_pattern > 0 (llama), got ", rope_local_theta);
  LOOM_CHECK(rope_fraction > 0.0f && rope_fraction <= 1.0f && (rope_fraction == 1.0f || (arch == ARCH_LLAMA && !mla())),
             "model.rope_fraction must be in (0, 1] (below 1: llama without MLA), got ", rope_fraction);
  LOOM_CHECK(rotary_dim() % 2 == 0 && (rope_fraction == 1.0f || rotary_dim() >= 2),
             "model.rope_fraction x head_dim (", rotary_dim(), ") must be an even number of dims >= 2");
  LOOM_CHECK(!attn_output_gate || (arch == ARCH_LLAMA && !mla()), "model.attn_output_gate needs arch = llama without MLA");
  LOOM_CHECK(linear_interval >= 0, "model.linear_interval must be >= 0 (0: no linear-attention blocks), got ", linear_interval);
  if (linear_interval > 0) {
    LOOM_CHECK(arch == ARCH_LLAMA && !mla() && pre_norms() && !post_norms(),
               "model.linear_interval (gated DeltaNet blocks) needs arch = llama with pre-norms, without MLA or "
               "post / sandwich norms");
    LOOM_CHECK(linear_key_heads >= 1 && linear_value_heads >= 1 && linear_value_heads % linear_key_heads == 0 &&
                   linear_key_dim >= 1 && linear_value_dim >= 1 && linear_conv_taps >= 1,
               "model.linear_interval: linear_key_heads (", linear_key_heads, ") and linear_value_heads (",
               linear_value_heads, ", a multiple of the key heads), linear_key_dim (", linear_key_dim,
               "), linear_value_dim (", linear_value_dim, ") and linear_conv_taps (", linear_conv_taps, ") must be >= 1");
  }
  LOOM_CHECK(!(attn_sinks || attn_out_bias) || (arch == ARCH_LLAMA && !mla()),
             "model.attn_sinks and model.attn_out_bias need arch = llama without MLA");
  LOOM_CHECK(!(moe_router_bias || moe_expert_bias) || (moe_experts > 0 && arch == ARCH_LLAMA),
             "model.moe_router_bias and model.moe_expert_bias need llama MoE blocks (model.moe_experts > 0)");
  LOOM_CHECK(!moe_shared_gate || (moe_experts > 0 && moe_shared > 0 && arch == ARCH_LLAMA),
             "model.moe_shared_gate needs llama MoE blocks with shared experts (moe_experts, moe_shared > 0)");
  LOOM_CHECK(nope_interval >= 0, "model.nope_interval must be >= 0 (0: RoPE on every block), got ", nope_interval);
  LOOM_CHECK(nope_interval == 0 || (arch == ARCH_LLAMA && mla_kv_rank == 0),
             "model.nope_interval (NoPE layers) needs arch = llama without MLA");
  LOOM_CHECK(rope_scaling == ROPE_SCALING_NONE || arch == ARCH_LLAMA, "model.rope_scaling needs arch = llama (gpt2 has learned positions)");
  LOOM_CHECK(rope_scaling == ROPE_SCALING_NONE || rope_factor > 0.0f, "model.rope_factor must be > 0, got ", rope_factor);
  LOOM_CHECK(rope_scaling != ROPE_SCALING_YARN ||
                 (rope_original_context > 0 && rope_beta_fast > rope_beta_slow && rope_beta_slow > 0.0f &&
                  rope_attention_factor > 0.0f),
             "model.rope_scaling = yarn needs rope_original_context > 0, rope_beta_fast (", rope_beta_fast,
             ") > rope_beta_slow (", rope_beta_slow, ") > 0 and rope_attention_factor > 0");
  if (rope_scaling == ROPE_SCALING_LONGROPE) {
    const int64_t pairs = head_dim() / 2;
    for (const auto& [text, key] : {std::pair{&rope_short_factors, "model.rope_short_factors"},
                                    std::pair{&rope_long_factors, "model.rope_long_factors"}}) {
      const size_t n = parse_factors(*text, key).size();
      LOOM_CHECK(static_cast<int64_t>(n) == pairs && pairs <= RopeSpec::kMaxPairs, key, " has ", n,
                 " factors, expected head_dim / 2 = ", pairs, " (at most ", RopeSpec::kMaxPairs, ")");
    }
    LOOM_CHECK(rope_original_context > 0 && rope_attention_factor > 0.0f && !mla(), "model.rope_scaling = longrope "
               "needs rope_original_context > 0 and rope_attention_factor > 0, without MLA");
  } else {
    LOOM_CHECK(rope_short_factors.empty() && rope_long_factors.empty(), "model.rope_short_factors / rope_long_factors "
               "need model.rope_scaling = longrope");
  }
  LOOM_CHECK(mla_score_scale > 0.0f, "model.mla_score_scale must be > 0, got ", mla_score_scale);
  LOOM_CHECK(rope_scaling != ROPE_SCALING_LLAMA3 ||
                 (rope_low_freq_factor > 0.0f && rope_high_freq_factor > rope_low_freq_factor && rope_original_context > 0),
             "model.rope_scaling = llama3 needs 0 < rope_low_freq_factor (", rope_low_freq_factor,
             ") < rope_high_freq_factor (", rope_high_freq_factor, ") and rope_original_context > 0 (",
             rope_original_context, ")");
  LOOM_CHECK(arch == ARCH_LLAMA || (!qkv_bias && !tie_embeddings), "model.qkv_bias and model.tie_embeddings are "
             "llama options (gpt2 always has biases and a tied head)");
  LOOM_CHECK(!qkv_bias || !mla(), "model.qkv_bias is not supported with model.mla_kv_rank > 0 (MLA has its own projections)");
  LOOM_CHECK(attn_window >= 0, "model.attn_window must be >= 0 (0: full causal attention), got ", attn_window);
  LOOM_CHECK(mla_kv_rank >= 0 && mla_rope_dim >= 0 && mla_nope_dim >= 0 && mla_v_dim >= 0 && mla_q_rank >= 0,
             "model.mla_kv_rank, mla_rope_dim, mla_nope_dim, mla_v_dim and mla_q_rank must be >= 0");
  if (mla()) {
    LOOM_CHECK(arch == ARCH_LLAMA, "model.mla_kv_rank = ", mla_kv_rank, ": MLA (multi-head latent attention) needs "
               "model.arch = llama, got ", arch_name(arch));
    LOOM_CHECK(mla_rope_dim > 0 && mla_rope_dim % 2 == 0, "model.mla_rope_dim must be even and > 0 with MLA "
               "(model.mla_kv_rank > 0), got ", mla_rope_dim);
  } else {
    LOOM_CHECK(mla_rope_dim == 0 && mla_nope_dim == 0 && mla_v_dim == 0 && mla_q_rank == 0, "model.mla_rope_dim, "
               "mla_nope_dim, mla_v_dim and mla_q_rank need MLA: set model.mla_kv_rank > 0");
  }
  LOOM_CHECK(lora() || !lora_dora, "peft.dora = true needs peft.method = lora");
  if (lora()) {
    LOOM_CHECK(lora_rank >= 1, "peft.rank must be >= 1, got ", lora_rank);
    LOOM_CHECK(lora_alpha > 0.0f, "peft.alpha must be > 0, got ", lora_alpha);
    LOOM_CHECK(lora_dropout >= 0.0f && lora_dropout < 1.0f, "peft.dropout must be in [0, 1), got ", lora_dropout);
    LOOM_CHECK(!lora_dora || !lora_quantize_base, "peft.dora with peft.quantize_base (QDoRA) is not supported yet: "
               "DoRA reads the fp32 base weight");
    LOOM_CHECK(!mla(), "peft.method = lora with MLA (model.mla_kv_rank > 0) is not supported yet: its projections "
               "have no adapters");
    const uint32_t mask = lora_target_mask();
    const uint32_t mlp = (1u << LORA_GATE) | (1u << LORA_UP) | (1u << LORA_DOWN);
    LOOM_CHECK(moe_experts == 0 || (mask & mlp) == 0, "peft.targets = '", lora_targets, "' adapts the MLP of an MoE "
               "model (model.moe_experts = ", moe_experts, "), which is not supported yet: adapt q, k, v, o only");
    if (arch == ARCH_GPT2) {
      LOOM_CHECK((mask & (1u << LORA_GATE)) == 0, "peft.targets = '", lora_targets, "': GPT-2's MLP has no gate (use up, down)");
    }
    // (in, out) of each target; the rank may not exceed the smaller.
    const int64_t C = d_model, F = d_ff, q = n_head * head_dim(), kv = n_kv_head * head_dim();
    const std::array<std::pair<int64_t, int64_t>, LORA_TARGET_COUNT> dims{
        {{C, arch == ARCH_GPT2 ? 3 * C : q}, {C, kv}, {C, kv}, {q, C}, {C, F}, {C, F}, {F, C}}};
    for (int t = 0; t < LORA_TARGET_COUNT; ++t) {
      if ((mask & (1u << t)) == 0) continue;
      const int64_t smaller = std::min(dims[static_cast<size_t>(t)].first, dims[static_cast<size_t>(t)].second);
      LOOM_CHECK(lora_rank <= smaller, "peft.rank = ", lora_rank, " is larger than the '",
                 enum_name(static_cast<LoraTarget>(t)), "' layer it adapts (", dims[static_cast<size_t>(t)].first,
                 " in, ", dims[static_cast<size_t>(t)].second, " out): use a rank <= ", smaller);
    }
  }
  LOOM_CHECK(init_std > 0.0f, "model.init_std must be > 0, got ", init_std);
  LOOM_CHECK(moe_experts >= 0, "model.moe_experts must be >= 0, got ", moe_experts);
  if (moe_experts > 0) {
    LOOM_CHECK(moe_top_k >= 1 && moe_top_k <= std::min<int64_t>(moe_experts, 64), "model.moe_top_k must be in [1, "
               "min(64, model.moe_experts = ", moe_experts, ")], got ", moe_top_k);
    LOOM_CHECK(moe_d_ff >= 0, "model.moe_d_ff must be >= 0, got ", moe_d_ff);
    LOOM_CHECK(moe_shared >= 0, "model.moe_shared must be >= 0, got ", moe_shared);
    LOOM_CHECK(moe_dense_layers >= 0 && moe_dense_layers <= n_layer, "model.moe_dense_layers must be in [0, model.n_layer = ",
               n_layer, "], got ", moe_dense_layers);
    LOOM_CHECK(moe_groups >= 1 && moe_experts % moe_groups == 0, "model.moe_groups must divide model.moe_experts (",
               moe_experts, "), got ", moe_groups);
    LOOM_CHECK(moe_topk_groups >= 1 && moe_topk_groups <= moe_groups, "model.moe_topk_groups must be in [1, model.moe_groups = ",
               moe_groups, "], got ", moe_topk_groups);
    LOOM_CHECK(moe_topk_groups * (moe_experts / moe_groups) >= moe_top_k, "model.moe_topk_groups (", moe_topk_groups,
               ") groups of ", moe_experts / moe_groups, " experts hold fewer than model.moe_top_k = ", moe_top_k);
    LOOM_CHECK(moe_route_scale > 0.0f, "model.moe_route_scale must be > 0, got ", moe_route_scale);
    LOOM_CHECK(moe_capacity_factor >= 0.0f, "model.moe_capacity_factor must be >= 0 (0: dropless), got ", moe_capacity_factor);
    LOOM_CHECK(moe_aux_alpha >= 0.0f && moe_seq_aux_alpha >= 0.0f && moe_z_alpha >= 0.0f && moe_bias_gamma >= 0.0f,
               "model.moe_aux_alpha, moe_seq_aux_alpha, moe_z_alpha and moe_bias_gamma must be >= 0");
  }
}

ModelConfig model_preset(std::string_view name) {
  ModelConfig c;
  if (name == "gpt2-124m") return c;
  if (name == "gpt2-default") {  // the model of configs/default.toml with its 4096-token BPE
    c.vocab_size = 4096, c.n_layer = 6, c.n_head = 4, c.n_kv_head = 4, c.d_model = 256, c.d_ff = 1024, c.max_seq_len = 128;
    return c;
  }
  if (name == "gpt2-small") {
    c.n_layer = 6, c.n_head = 6, c.n_kv_head = 6, c.d_model = 384, c.d_ff = 1536, c.max_seq_len = 256;
    return c;
  }
  if (name == "gpt2-tiny") {
    c.vocab_size = 97, c.max_seq_len = 16, c.n_layer = 2, c.n_head = 4, c.n_kv_head = 4, c.d_model = 32, c.d_ff = 128;
    return c;
  }
  if (name == "llama-tiny") {
    c.arch = ARCH_LLAMA;
    c.vocab_size = 101, c.max_seq_len = 16, c.n_layer = 2, c.n_head = 6, c.n_kv_head = 2, c.d_model = 48, c.d_ff = 80;
    return c;
  }
  if (name == "moe-tiny") {  // llama-tiny with 4 experts (top-2) and a shared expert from layer 1 on
    c = model_preset("llama-tiny");
    c.moe_experts = 4, c.moe_top_k = 2, c.moe_d_ff = 32, c.moe_shared = 1, c.moe_dense_layers = 1;
    return c;
  }
  if (name == "mla-tiny") {  // llama-tiny with Multi-head Latent Attention (d_c 16, d_r 4, d_n 8, d_v 8)
    c = model_preset("llama-tiny");
    c.n_kv_head = c.n_head, c.mla_kv_rank = 16, c.mla_rope_dim = 4, c.mla_nope_dim = 8, c.mla_v_dim = 8;
    return c;
  }
  if (name == "gemma-tiny") {  // llama-tiny as Gemma 3: sandwich and q/k norms, GeGLU, scaled tied embedding,
    c = model_preset("llama-tiny");  // layer 0 within a window of 3 (local RoPE base 100), layer 1 global (linear x2)
    c.sandwich_norm = c.qk_norm = c.tie_embeddings = true;
    c.gate_activation = GateActivation::gelu_tanh;
    c.embed_scale = std::sqrt(static_cast<float>(c.d_model));
    c.attn_window = 3, c.window_pattern = 2, c.rope_local_theta = 100.0f;
    c.rope_scaling = ROPE_SCALING_LINEAR, c.rope_factor = 2.0f;
    return c;
  }
  if (name == "qwen3-next-tiny") {  // llama-tiny as Qwen3-Next: layer 0 gated DeltaNet (2 key, 4 value heads of 8),
    c = model_preset("llama-tiny");   // layer 1 gated attention (q/k norms, RoPE on half of each head); MoE with a gated shared expert
    c.linear_interval = 2, c.linear_key_heads = 2, c.linear_value_heads = 4, c.linear_key_dim = 8, c.linear_value_dim = 8;
    c.attn_output_gate = c.qk_norm = true;
    c.rope_fraction = 0.5f;
    c.moe_experts = 4, c.moe_top_k = 2, c.moe_d_ff = 32, c.moe_shared = 1, c.moe_shared_gate = true;
    return c;
  }
  if (name == "gpt-oss-tiny") {  // llama-tiny as GPT-OSS: attention sinks, q/k/v and o_proj biases, layer 0 within a
    c = model_preset("llama-tiny");  // window of 3, layer 1 global; MoE (4 experts, top 2) with biases and the clamped SwiGLU
    c.attn_sinks = c.qkv_bias = c.attn_out_bias = true;
    c.attn_window = 3, c.window_pattern = 2;
    c.gate_activation = GateActivation::swiglu_oai;
    c.moe_experts = 4, c.moe_top_k = 2, c.moe_d_ff = 32, c.moe_router_bias = c.moe_expert_bias = true;
    return c;
  }
  throw Error(str_cat("unknown model preset '", name, "', expected one of: gpt2-tiny, gpt2-default, gpt2-small, gpt2-124m, "
                      "llama-tiny, moe-tiny, mla-tiny, gemma-tiny, qwen3-next-tiny, gpt-oss-tiny"));
}

ModelConfig with_peft_of(ModelConfig base, const ModelConfig& from) {
  base.peft_method = from.peft_method;
  base.lora_rank = from.lora_rank;
  base.lora_alpha = from.lora_alpha;
  base.lora_rslora = from.lora_rslora;
  base.lora_targets = from.lora_targets;
  base.lora_quantize_base = from.lora_quantize_base;
  base.lora_dropout = from.lora_dropout;
  base.lora_dora = from.lora_dora;
  return base;
}


RopeSpec ModelConfig::rope() const {
  RopeSpec r{rope_theta,     rope_scaling,   rope_factor,           rope_low_freq_factor, rope_high_freq_factor,
             static_cast<double>(rope_original_context), rope_beta_fast, rope_beta_slow, rope_attention_factor};
  if (rope_scaling == ROPE_SCALING_LONGROPE) {
    const std::vector<float> s = parse_factors(rope_short_factors, "model.rope_short_factors");
    const std::vector<float> l = parse_factors(rope_long_factors, "model.rope_long_factors");
    std::copy(s.begin(), s.begin() + std::min<size_t>(s.size(), RopeSpec::kMaxPairs), r.short_factor);
    std::copy(l.begin(), l.begin() + std::min<size_t>(l.size(), RopeSpec::kMaxPairs), r.long_factor);
  }
  r.rotary_dim = rotary_dim();
  r.yarn_truncate = rope_yarn_truncate;
  return r;
}

float ModelConfig::lora_scale() const {
  const double r = static_cast<double>(lora_rank);
  return static_cast<float>(static_cast<double>(lora_alpha) / (lora_rslora ? std::sqrt(r) : r));
}

uint32_t ModelConfig::lora_target_mask() const {
  uint32_t mask = 0;
  size_t begin = 0;
  while (begin <= lora_targets.size()) {
    const size_t end = std::min(lora_targets.find(',', begin), lora_targets.size());
    std::string name = lora_targets.substr(begin, end - begin);
    while (!name.empty() && name.front() == ' ') name.erase(name.begin());
    while (!name.empty() && name.back() == ' ') name.pop_back();
    const std::optional<LoraTarget> t = enum_from_name<LoraTarget>(name);
    LOOM_CHECK(t.has_value(), "peft.targets = '", lora_targets, "': '", name, "' matches no layer (expected a "
               "comma-separated list of ", enum_choices<LoraTarget>(), ")");
    mask |= 1u << *t;
    begin = end + 1;
  }
  return mask;
}

int64_t param_count(const ModelConfig& config) { return build_param_layout(config).total; }

int64_t kv_cache_width(const ModelConfig& config) {
  if (config.mla()) return config.mla_kv_rank + config.mla_rope_dim;
  return 2 * config.n_kv_head * config.head_dim();
}

namespace {
// One block's attention weights that take part in matmuls (a gated DeltaNet block's projections).
int64_t attention_matmul_params(const ModelConfig& config, int64_t layer) {
  const int64_t c = config.d_model, H = config.n_head;
  if (config.linear_layer(layer)) {
    const int64_t Dq = config.linear_key_heads * config.linear_key_dim;
    const int64_t Dv = config.linear_value_heads * config.linear_value_dim;
    return (2 * Dq + 2 * Dv + 2 * config.linear_value_heads) * c + c * Dv;
  }
  const int64_t gate = config.attn_output_gate ? H * config.head_dim() * c : 0;
  if (!config.mla()) return config.qkv_width() * c + c * H * config.head_dim() + gate;
  const int64_t q = H * config.mla_qk(), dc = config.mla_kv_rank, dq = config.mla_q_rank;
  const int64_t queries = dq > 0 ? dq * c + q * dq : q * c;
  return queries + (dc + config.mla_rope_dim) * c + H * (config.mla_nope() + config.mla_v()) * dc +
         c * config.attn_width();
}
}  // namespace

int64_t matmul_param_count(const ModelConfig& config) {
  const int64_t c = config.d_model;
  const int64_t dense = config.mlp_in_width() * c + c * config.d_ff;
  const int64_t expert = config.expert_in_width() * c + c * config.expert_ff();
  int64_t total = config.vocab_size * c;
  for (int64_t l = 0; l < config.n_layer; ++l) {
    total += attention_matmul_params(config, l) + (config.moe_layer(l) ? config.moe_experts * c + (config.moe_top_k + config.moe_shared) * expert
                                              : dense);
  }
  return total;
}

double train_flops_per_token(const ModelConfig& config, int64_t seq_len) {
  // A sliding window of W < T keys per query: each token's scores and values span W positions.
  const int64_t span = config.attn_window > 0 ? std::min(seq_len, config.attn_window) : seq_len;
  if (config.mla()) {  // per key: q.k over d_n + d_r and p v over d_v, per head
    return 6.0 * static_cast<double>(matmul_param_count(config)) +
           6.0 * static_cast<double>(config.n_layer * span * config.n_head * (config.mla_qk() + config.mla_v()));
  }
  // Gated DeltaNet blocks: no scores over keys; per token and value head three d_k x d_v
  // matrix-vector products of the state (S^T k, k delta^T, S^T q), 2 FLOPs each, times 3 for
  // training (the conv's K taps per channel are left out: under 1% at Qwen3-Next's widths).
  const int64_t linear = config.linear_layer_count();
  const double state = static_cast<double>(config.linear_value_heads * config.linear_key_dim * config.linear_value_dim);
  return 6.0 * static_cast<double>(matmul_param_count(config)) +
         12.0 * static_cast<double>((config.n_layer - linear) * config.d_model * span) +
         18.0 * static_cast<double>(linear) * state;
}


double forward_flops_per_position(const ModelConfig& config, int64_t keys) {
  const int64_t span = config.attn_window > 0 ? std::min(keys, config.attn_window) : keys;
  const double attention = config.mla() ? 2.0 * static_cast<double>(config.n_head * (config.mla_qk() + config.mla_v()))
                                        : 4.0 * static_cast<double>(config.d_model);
  const int64_t linear = config.linear_layer_count();  // their state's products, as train_flops_per_token
  return 2.0 * static_cast<double>(matmul_param_count(config)) +
         attention * static_cast<double>((config.n_layer - linear) * span) +
         6.0 * static_cast<double>(linear * config.linear_value_heads * config.linear_key_dim * config.linear_value_dim);
}

}  // namespace loom
