#include "loom/nn/plan.h"

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
  if (config.mla()) {
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

std::string describe_plans(const std::vector<LayerPlan>& plans) {
  std::map<std::string, int64_t> count;
  std::vector<std::string> order;  // first appearance
  for (const LayerPlan& p : plans) {
    std::string what = str_cat("attention ", attention_kind_name(p.attention), p.window > 0 ? str_cat(" (window ", p.window, ")") : "",
                               " + mlp ", mlp_kind_name(p.mlp),
                               p.sequence_parallel ? ", tp + sp" : p.tensor_parallel ? ", tp" : "",
                               p.recompute == RECOMPUTE_SELECTIVE ? ", recompute selective"
                               : p.recompute == RECOMPUTE_FULL    ? ", recompute full"
                                                                  : "");
    if (count[what]++ == 0) order.push_back(what);
  }
  std::string out;
  for (const std::string& w : order) out += str_cat(out.empty() ? "" : ", ", count[w], " x ", w);
  return out;
}

}  // namespace loom
