#include "loom/precision/policy.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "loom/core/error.h"

namespace loom {

namespace {
constexpr const char* kRecipeNames[RECIPE_COUNT] = {"f32", "bf16", "fp16", "fp8-delayed", "fp8-current", "fp8-block"};
constexpr const char* kKindNames[LINEAR_KIND_COUNT] = {"attn_qkv", "attn_out", "mlp_in", "mlp_out", "head"};

void check_choice(const std::string& value, std::initializer_list<const char*> choices, const std::string& key) {
  std::string list;
  for (const char* c : choices) {
    if (value == c) return;
    list += list.empty() ? "" : " | ";
    list += c;
  }
  throw Error(str_cat(key, " must be ", list, ", got '", value, "'"));
}
}  // namespace

const char* recipe_name(LinearRecipe r) { return r < RECIPE_COUNT ? kRecipeNames[r] : "?"; }
const char* linear_kind_name(LinearKind k) { return k < LINEAR_KIND_COUNT ? kKindNames[k] : "?"; }

LinearRecipe parse_recipe(const std::string& name, const std::string& key) {
  std::string list;
  for (int r = 0; r < RECIPE_COUNT; ++r) {
    if (name == kRecipeNames[r]) return static_cast<LinearRecipe>(r);
    list += r ? " | " : "";
    list += kRecipeNames[r];
  }
  throw Error(str_cat(key, " must be ", list, ", got '", name, "'"));
}

void PrecisionConfig::validate() const {
  parse_recipe(compute, "precision.compute");
  const std::string* kinds[LINEAR_KIND_COUNT] = {&attn_qkv, &attn_out, &mlp_in, &mlp_out, &head};
  for (int k = 0; k < LINEAR_KIND_COUNT; ++k) {
    if (!kinds[k]->empty()) parse_recipe(*kinds[k], std::string("precision.") + kKindNames[k]);
  }
  if (!param.empty()) check_choice(param, {"f32", "bf16"}, "precision.param");
  check_choice(reduce, {"f32", "bf16"}, "precision.reduce");
  check_choice(master, {"f32", "bf16"}, "precision.master");
  check_choice(qat, {"none", "mxfp4", "nvfp4"}, "precision.qat");
  check_choice(activations, {"bf16", "f32"}, "precision.activations");
  check_choice(attention, {"f32", "bf16"}, "precision.attention");
  check_choice(outputs, {"bf16", "f32"}, "precision.outputs");
  check_choice(fp8.amax_compute, {"max", "most_recent"}, "precision.fp8_amax_compute");
  if (!fp8.backward.empty()) check_choice(fp8.backward, {"e5m2", "e4m3"}, "precision.fp8_backward");
  LOOM_CHECK(fp8.margin >= 0 && fp8.margin <= 64, "precision.fp8_margin must be in [0, 64], got ", fp8.margin);
  LOOM_CHECK(fp8.amax_history >= 1 && fp8.amax_history <= 1 << 20,
             "precision.fp8_amax_history must be in [1, 1048576], got ", fp8.amax_history);
  LOOM_CHECK(!stochastic_rounding || master == "bf16",
             "precision.stochastic_rounding applies to precision.master = bf16 (got master = ", master, ")");
}

bool PrecisionPolicy::any(LinearRecipe r) const { return std::find(recipe.begin(), recipe.end(), r) != recipe.end(); }
bool PrecisionPolicy::any_fp8() const { return any(RECIPE_FP8_DELAYED) || any(RECIPE_FP8_CURRENT) || any(RECIPE_FP8_BLOCK); }

std::string PrecisionPolicy::describe() const {
  std::ostringstream s;
  for (int k = 0; k < LINEAR_KIND_COUNT; ++k) s << kKindNames[k] << "=" << kRecipeNames[recipe[static_cast<size_t>(k)]] << " ";
  s << "param=" << (param_bf16 ? "bf16" : "f32") << " reduce=" << (reduce_bf16 ? "bf16" : "f32")
    << " master=" << (master_bf16 ? (stochastic_rounding ? "bf16(stochastic)" : "bf16") : "f32");
  if (!activations_bf16 && any(RECIPE_BF16)) s << " activations=f32";
  if (attention_bf16) s << " attention=bf16";
  if (!outputs_bf16 && any(RECIPE_BF16)) s << " outputs=f32";
  if (qat != QAT_NONE) s << " qat=" << (qat == QAT_MXFP4 ? "mxfp4" : "nvfp4");
  return s.str();
}

PrecisionPolicy resolve_policy(const PrecisionConfig& c) {
  c.validate();
  PrecisionPolicy p;
  const LinearRecipe base = parse_recipe(c.compute, "precision.compute");
  const std::string* kinds[LINEAR_KIND_COUNT] = {&c.attn_qkv, &c.attn_out, &c.mlp_in, &c.mlp_out, &c.head};
  for (int k = 0; k < LINEAR_KIND_COUNT; ++k) {
    LinearRecipe r = base;
    // DeepSeek-V3 and TransformerEngine keep the output head out of FP8: bf16 unless set.
    if (k == LINEAR_HEAD && is_fp8(base)) r = RECIPE_BF16;
    if (!kinds[k]->empty()) r = parse_recipe(*kinds[k], std::string("precision.") + kKindNames[k]);
    p.recipe[static_cast<size_t>(k)] = r;
  }
  p.param_bf16 = c.param.empty() ? base == RECIPE_BF16 : c.param == "bf16";
  p.reduce_bf16 = c.reduce == "bf16";
  p.master_bf16 = c.master == "bf16";
  p.stochastic_rounding = c.stochastic_rounding;
  p.activations_bf16 = c.activations == "bf16";
  p.attention_bf16 = c.attention == "bf16";
  p.outputs_bf16 = c.outputs == "bf16";
  p.qat = c.qat == "mxfp4" ? QAT_MXFP4 : c.qat == "nvfp4" ? QAT_NVFP4 : QAT_NONE;
  p.fp8_margin = c.fp8.margin;
  p.fp8_history = c.fp8.amax_history;
  p.fp8_most_recent = c.fp8.amax_compute == "most_recent";
  if (!c.fp8.backward.empty()) {
    const MiniFormat f = c.fp8.backward == "e4m3" ? FMT_E4M3 : FMT_E5M2;
    p.fp8_backward_delayed = p.fp8_backward_block = f;
  }
  return p;
}

DelayedScaling::DelayedScaling(int64_t length, int64_t margin, bool most_recent)
    : history_(static_cast<size_t>(std::max<int64_t>(length, 1)), 0.0f), margin_(margin), most_recent_(most_recent) {}

float DelayedScaling::scale(MiniFormat f) const {
  if (!(amax_ > 0.0f)) return 1.0f;
  // fp32 arithmetic, as TransformerEngine's update kernel: (fmax / amax) / 2^margin.
  return static_cast<float>(format_info(f).max) / amax_ / std::ldexp(1.0f, static_cast<int>(margin_));
}

void DelayedScaling::record(float amax) {
  if (std::isnan(amax) || std::isnan(history_[0])) history_[0] = NAN;
  else history_[0] = std::max(history_[0], amax);
}

void DelayedScaling::advance() {
  float amax = history_[0];
  if (!most_recent_) {
    for (float h : history_) amax = std::isnan(h) || std::isnan(amax) ? NAN : std::max(amax, h);
  }
  if (std::isfinite(amax) && amax > 0.0f) amax_ = amax;  // TE: keep the old scale otherwise
  // torch.roll(history, -1) as TransformerEngine does: slot 0 (this step) moves to the end,
  // slot 1 (the oldest) becomes slot 0 and is zeroed for the next step.
  std::rotate(history_.begin(), history_.begin() + 1, history_.end());
  history_[0] = 0.0f;
}

void DelayedScaling::restore(std::vector<float> history, float amax_used) {
  LOOM_CHECK(history.size() == history_.size(), "fp8 amax history of ", history.size(), " steps, expected ",
             history_.size(), " (precision.fp8_amax_history)");
  history_ = std::move(history);
  amax_ = amax_used;
}

}  // namespace loom
