#include "loom/model/param_layout.h"

#include <cmath>

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
    layout_.total += spec.numel;
    layout_.params.push_back(std::move(spec));
  }
  ParamLayout& layout_;
};

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
    b.matrix(p + "mlp.c_fc.weight", {F, C}, std);
    b.bias(p + "mlp.c_fc.bias", F);
    b.matrix(p + "mlp.c_proj.weight", {C, F}, residual_std);
    b.bias(p + "mlp.c_proj.bias", C);
  }
  b.norm_weight("ln_f.weight", C);
  b.bias("ln_f.bias", C);
}

void add_llama(const ModelConfig& c, LayoutBuilder& b) {
  const int64_t C = c.d_model, F = c.d_ff, V = c.vocab_size;
  const float std = c.init_std, residual_std = c.init_std / std::sqrt(2.0f * static_cast<float>(c.n_layer));
  const int64_t hd = c.head_dim(), kv = c.n_kv_head * c.head_dim();
  b.matrix("model.embed_tokens.weight", {V, C}, std, ROLE_EMBEDDING);
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    b.norm_weight(p + "input_layernorm.weight", C);
    b.matrix(p + "self_attn.qkv_proj.weight", {c.qkv_width(), C}, std, ROLE_HIDDEN,
             {{c.n_head * hd, hd}, {kv, hd}, {kv, 1}});
    b.matrix(p + "self_attn.o_proj.weight", {C, c.n_head * c.head_dim()}, residual_std);
    b.norm_weight(p + "post_attention_layernorm.weight", C);
    b.matrix(p + "mlp.gate_up_proj.weight", {2 * F, C}, std, ROLE_HIDDEN, {{F, 1}, {F, 1}});
    b.matrix(p + "mlp.down_proj.weight", {C, F}, residual_std);
  }
  b.norm_weight("model.norm.weight", C);
  b.matrix("lm_head.weight", {V, C}, std, ROLE_HEAD);
}

}  // namespace

ParamLayout build_param_layout(const ModelConfig& config) {
  config.validate();
  ParamLayout layout;
  LayoutBuilder builder(layout);
  if (config.arch == ARCH_GPT2) add_gpt2(config, builder);
  else add_llama(config, builder);
  return layout;
}

}  // namespace loom
