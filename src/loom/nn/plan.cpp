#include "loom/nn/plan.h"

#include <algorithm>
#include <map>
#include <vector>

#include "loom/core/error.h"

namespace loom {

const char* attention_kind_name(AttentionKind kind) {
  static constexpr const char* kNames[] = {"mha", "flash", "ring", "ulysses", "mla"};
  return kNames[static_cast<int>(kind)];
}

const char* mlp_kind_name(MlpKind kind) { return kind == MlpKind::moe ? "moe" : "dense"; }

LayerPlan resolve_layer_plan(const ModelConfig& config, int64_t layer, const PlanChoices& choices) {
  LayerPlan plan;
  plan.window = config.attn_window;
  plan.tensor_parallel = choices.tensor_parallel;
  plan.sequence_parallel = choices.tensor_parallel && choices.sequence_parallel;
  plan.recompute = choices.recompute;
  plan.mlp = config.moe_layer(layer) ? MlpKind::moe : MlpKind::dense;
  plan.linears = choices.linears;
  plan.qat = choices.qat;
  if (config.mla()) {
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
    LOOM_CHECK(!choices.flash, "train.flash_attention is not supported with context parallelism (parallel.cp > 1 runs "
               "ring or Ulysses attention)");
    LOOM_CHECK(config.attn_window == 0, "model.attn_window (sliding-window attention) is not supported with context "
               "parallelism (parallel.cp > 1)");
    plan.attention = choices.context == PlanChoices::RING ? AttentionKind::ring : AttentionKind::ulysses;
  } else {
    plan.attention = choices.flash ? AttentionKind::flash : AttentionKind::mha;
  }
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
