#include "loom/nn/plan.h"

#include <algorithm>
#include <map>
#include <vector>

#include "loom/arch/param_layout.h"
#include "loom/core/error.h"

namespace loom {

const char* attention_kind_name(AttentionKind kind) {
  static constexpr const char* kNames[] = {"mha", "flash", "ring", "ulysses", "mla", "linear"};
  return kNames[static_cast<int>(kind)];
}

const char* mlp_kind_name(MlpKind kind) { return kind == MlpKind::moe ? "moe" : "dense"; }

void choose_precision(PlanChoices& choices, const PrecisionPolicy& policy) {
  for (size_t k = 0; k < choices.linears.size(); ++k) choices.linears[k] = policy.recipe[k];
  choices.qat = policy.qat;
  choices.activations_bf16 = policy.activations_bf16;
  choices.outputs_bf16 = policy.outputs_bf16;
  choices.attention_bf16 = policy.attention_bf16;
}

namespace {

// LayerPlan::saved_bf16's rule.
std::array<bool, 4> saved_bf16(const ModelConfig& config, int64_t layer, const LayerPlan& plan, bool wanted) {
  std::array<bool, 4> on{};
  if (!wanted) return on;
  for (size_t k = 0; k < on.size(); ++k) on[k] = plan.linears[k] == RECIPE_BF16;
  for (const LoraSite& site : lora_sites(config, layer)) {  // adapters read the layer's input in fp32
    on[site.linear == LORA_ON_QKV ? LINEAR_ATTN_QKV : site.linear == LORA_ON_PROJ ? LINEAR_ATTN_OUT
       : site.linear == LORA_ON_FC ? LINEAR_MLP_IN : LINEAR_MLP_OUT] = false;
  }
  if (plan.sequence_parallel) on[LINEAR_ATTN_QKV] = on[LINEAR_MLP_IN] = false;
  if (plan.attention == AttentionKind::mla) on[LINEAR_ATTN_QKV] = false;
  // O in bf16: the plain attention's (staged), or the bf16 flash kernels' own (they write it rounded).
  const bool flash_o16 = plan.attention == AttentionKind::flash && plan.attention_bf16 && !plan.sinks;
  if ((plan.attention != AttentionKind::mha && !flash_o16) || plan.output_gate) on[LINEAR_ATTN_OUT] = false;
  if (plan.attention == AttentionKind::linear || plan.output_gate) on[LINEAR_ATTN_QKV] = false;  // read in fp32 by their own projections
  if (plan.mlp != MlpKind::dense) on[LINEAR_MLP_IN] = on[LINEAR_MLP_OUT] = false;
  if (!config.pre_norms()) on[LINEAR_ATTN_QKV] = on[LINEAR_MLP_IN] = false;  // they read the residual stream, not a norm's output
  return on;
}

bool has_lora_on(const ModelConfig& config, int64_t layer, LoraLinear linear) {
  for (const LoraSite& site : lora_sites(config, layer)) {
    if (site.linear == linear) return true;
  }
  return false;
}

// LayerPlan::mlp_in_dy_bf16's and fc_bf16's rule (each its own choice): the MLP's first layer in bf16
// around its GEMMs.
bool mlp_in_bf16(const ModelConfig& config, int64_t layer, const LayerPlan& plan, bool wanted) {
  if (!wanted || plan.mlp != MlpKind::dense || plan.linears[LINEAR_MLP_IN] != RECIPE_BF16) return false;
  for (const LoraSite& site : lora_sites(config, layer)) {
    if (site.linear == LORA_ON_FC) return false;
  }
  return true;
}

// LayerPlan::qkv_dy_bf16's rule: the QKV projection's bf16 GEMMs take the bf16 flash attention's
// d(qkv) with nothing between them.
bool qkv_dy_bf16(const ModelConfig& config, int64_t layer, const LayerPlan& plan, bool wanted) {
  if (!wanted || plan.attention != AttentionKind::flash || !plan.attention_bf16 || plan.rope || config.qk_norm ||
      plan.sinks || plan.output_gate || plan.linears[LINEAR_ATTN_QKV] != RECIPE_BF16) {
    return false;
  }
  for (const LoraSite& site : lora_sites(config, layer)) {
    if (site.linear == LORA_ON_QKV) return false;
  }
  return true;
}

// LayerPlan::attn_dy_bf16's rule.
bool attn_dy_bf16(const ModelConfig& config, int64_t layer, const LayerPlan& plan, bool wanted) {
  if (!wanted || plan.attention != AttentionKind::flash || !plan.attention_bf16 || plan.sinks || plan.output_gate ||
      plan.linears[LINEAR_ATTN_OUT] != RECIPE_BF16) {
    return false;
  }
  for (const LoraSite& site : lora_sites(config, layer)) {
    if (site.linear == LORA_ON_PROJ) return false;
  }
  return true;
}

// LayerPlan::proj_dy_bf16's and fc2_dy_bf16's rule: the block's output layer `kind` (attn_out or
// mlp_out) reads the residual stream's gradient in bf16 from the norm backward that finalises it.
bool residual_dy_bf16(const ModelConfig& config, int64_t layer, const LayerPlan& plan, LinearKind kind, bool wanted) {
  if (!wanted || plan.linears[kind] != RECIPE_BF16 || config.post_norms() || plan.sequence_parallel ||
      plan.mlp != MlpKind::dense || (kind == LINEAR_ATTN_OUT && plan.attention == AttentionKind::linear)) {
    return false;
  }
  const LoraLinear adapted = kind == LINEAR_ATTN_OUT ? LORA_ON_PROJ : LORA_ON_FC2;
  for (const LoraSite& site : lora_sites(config, layer)) {
    if (site.linear == adapted) return false;
  }
  return true;
}

}  // namespace

LayerPlan resolve_layer_plan(const ModelConfig& config, int64_t layer, const PlanChoices& choices) {
  LayerPlan plan;
  plan.window = config.layer_window(layer);
  plan.rope = config.rope_layer(layer);
  plan.rope_spec = config.rope(layer);
  plan.tensor_parallel = choices.tensor_parallel;
  plan.sequence_parallel = choices.tensor_parallel && choices.sequence_parallel;
  plan.recompute = choices.recompute;
  plan.mlp = config.moe_layer(layer) ? MlpKind::moe : MlpKind::dense;
  plan.linears = choices.linears;
  plan.qat = choices.qat;
  // Output norms (OLMo 2, Gemma): the sub-layers' outputs are normalised before the residual add;
  // the layer runs whole on one rank, keeping its whole record (nn/attention.h, nn/mlp.h).
  LOOM_CHECK(!config.post_norms() || (!choices.tensor_parallel && choices.recompute == RECOMPUTE_NONE),
             config.post_norm ? "model.post_norm (OLMo 2's output norms)" : "model.sandwich_norm (Gemma's output norms)",
             " is not supported with tensor or sequence parallelism or activation recompute yet");
  plan.output_gate = config.attn_output_gate;
  LOOM_CHECK(!config.attn_output_gate || (!choices.sequence_parallel && choices.recompute == RECOMPUTE_NONE),
             "model.attn_output_gate (gated attention) is not supported with sequence parallelism or activation "
             "recompute yet");
  if (config.linear_layer(layer)) {
    // A gated DeltaNet block (nn/linear_attention.h): its own projections in fp32, split by heads
    // under tensor parallelism (parallel/tensor_parallel.h).
    LOOM_CHECK(!choices.sequence_parallel && choices.recompute == RECOMPUTE_NONE,
               "model.linear_interval (gated DeltaNet blocks) is not supported with sequence parallelism or "
               "activation recompute yet");
    plan.context_parallel = choices.context != PlanChoices::NONE;
    LOOM_CHECK(choices.linears[LINEAR_ATTN_QKV] == RECIPE_F32 && choices.linears[LINEAR_ATTN_OUT] == RECIPE_F32 &&
                   choices.qat == QAT_NONE,
               "model.linear_interval: the gated DeltaNet blocks compute their projections in fp32: set "
               "precision.attn_qkv and precision.attn_out = f32 (got ", recipe_name(choices.linears[LINEAR_ATTN_QKV]),
               ", ", recipe_name(choices.linears[LINEAR_ATTN_OUT]), ") and precision.qat = none");
    plan.attention = AttentionKind::linear;
    plan.rope = false, plan.window = 0, plan.output_gate = false;
  } else if (config.mla()) {
    // MLA's projections (nn/mla.h) compute in fp32; its output projection follows precision.attn_out.
    LOOM_CHECK(choices.linears[LINEAR_ATTN_QKV] == RECIPE_F32 && choices.qat == QAT_NONE,
               "model.mla_kv_rank > 0 (MLA) computes its projections in fp32: set precision.attn_qkv = f32 (got ",
               recipe_name(choices.linears[LINEAR_ATTN_QKV]), ") and precision.qat = none");
    LOOM_CHECK(!choices.flash, "train.flash_attention is not supported with model.mla_kv_rank > 0 (MLA computes its own "
               "attention)");
    LOOM_CHECK(choices.context == PlanChoices::NONE && !choices.tensor_parallel, "model.mla_kv_rank > 0 (MLA) is not "
               "supported with tensor, sequence or context parallelism");
    plan.attention = AttentionKind::mla;
  } else if (choices.context != PlanChoices::NONE) {
    LOOM_CHECK(!config.attn_sinks, "model.attn_sinks (GPT-OSS's attention sinks) is not supported with context "
               "parallelism (parallel.cp > 1) yet");
    LOOM_CHECK(!choices.flash, "train.flash_attention is not supported with context parallelism (parallel.cp > 1 runs "
               "ring or Ulysses attention)");
    LOOM_CHECK(config.attn_window == 0, "model.attn_window (sliding-window attention) is not supported with context "
               "parallelism (parallel.cp > 1)");
    plan.attention = choices.context == PlanChoices::RING ? AttentionKind::ring : AttentionKind::ulysses;
  } else {
    // Attention sinks need each row's log-sum-exp: flash attention keeps it.
    plan.attention = choices.flash || config.attn_sinks ? AttentionKind::flash : AttentionKind::mha;
    plan.sinks = config.attn_sinks;
  }
  plan.attention_bf16 = choices.attention_bf16 && (plan.attention == AttentionKind::mha || plan.attention == AttentionKind::flash) &&
                        plan.window == 0;
  plan.saved_bf16 = saved_bf16(config, layer, plan, choices.activations_bf16);
  plan.mlp_in_dy_bf16 = mlp_in_bf16(config, layer, plan, choices.activations_bf16);
  plan.fc_bf16 = mlp_in_bf16(config, layer, plan, choices.outputs_bf16);
  const bool gelu = plan.fc_bf16 && !config.gated_mlp();
  // (selective recompute takes the activation again from fc's kept output: the forward does too)
  plan.fc_gelu = gelu && plan.saved_bf16[LINEAR_MLP_OUT] && plan.recompute != RECOMPUTE_SELECTIVE;
  plan.fc2_dgelu = gelu && plan.mlp_in_dy_bf16 && plan.linears[LINEAR_MLP_OUT] == RECIPE_BF16 &&
                   !has_lora_on(config, layer, LORA_ON_FC2);
  plan.qkv_dy_bf16 = qkv_dy_bf16(config, layer, plan, choices.activations_bf16);
  plan.qkv_bf16 = choices.outputs_bf16 && plan.attention == AttentionKind::flash && plan.attention_bf16;
  plan.attn_dy_bf16 = attn_dy_bf16(config, layer, plan, choices.outputs_bf16);
  plan.proj_dy_bf16 = residual_dy_bf16(config, layer, plan, LINEAR_ATTN_OUT, choices.activations_bf16);
  plan.fc2_dy_bf16 = residual_dy_bf16(config, layer, plan, LINEAR_MLP_OUT, choices.activations_bf16);
  return plan;
}

namespace {

// ", linears bf16" (one recipe) or ", linears attn_qkv fp8-delayed, attn_out bf16, ..."; "" when all f32.
std::string describe_linears(const LayerPlan& p) {
  std::string out;
  const bool same = std::all_of(p.linears.begin(), p.linears.end(), [&](LinearRecipe r) { return r == p.linears[0]; });
  if (same && p.linears[0] != RECIPE_F32) out = str_cat(", linears ", recipe_name(p.linears[0]));
  if (!same) {
    out = ", linears";
    for (size_t k = 0; k < p.linears.size(); ++k) {
      out += str_cat(k == 0 ? " " : ", ", linear_kind_name(static_cast<LinearKind>(k)), " ", recipe_name(p.linears[k]));
    }
  }
  if (p.qat != QAT_NONE) out += p.qat == QAT_MXFP4 ? ", qat mxfp4" : ", qat nvfp4";
  if (p.attention_bf16) out += ", attention GEMMs bf16";
  const auto saved = std::count(p.saved_bf16.begin(), p.saved_bf16.end(), true);
  if (saved == static_cast<int64_t>(p.saved_bf16.size())) out += ", inputs saved in bf16";
  if (saved > 0 && saved < static_cast<int64_t>(p.saved_bf16.size())) {
    out += ", bf16-saved inputs of";
    for (size_t k = 0; k < p.saved_bf16.size(); ++k) {
      if (p.saved_bf16[k]) out += str_cat(" ", linear_kind_name(static_cast<LinearKind>(k)));
    }
  }
  return out;
}

}  // namespace

std::string describe_plans(const std::vector<LayerPlan>& plans) {
  std::map<std::string, int64_t> count;
  std::vector<std::string> order;  // first appearance
  for (const LayerPlan& p : plans) {
    std::string what = str_cat("attention ", attention_kind_name(p.attention), p.window > 0 ? str_cat(" (window ", p.window, ")") : "",
                               " + mlp ", mlp_kind_name(p.mlp),
                               p.sequence_parallel ? ", tp + sp" : p.tensor_parallel ? ", tp" : "",
                               p.recompute == RECOMPUTE_SELECTIVE ? ", recompute selective"
                               : p.recompute == RECOMPUTE_FULL    ? ", recompute full"
                                                                  : "",
                               describe_linears(p));
    if (count[what]++ == 0) order.push_back(what);
  }
  std::string out;
  for (const std::string& w : order) out += str_cat(out.empty() ? "" : ", ", count[w], " x ", w);
  return out;
}

}  // namespace loom
