#include "loom/memory/recompute.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "loom/core/error.h"

namespace loom {

std::string_view recompute_name(RecomputePolicy p) {
  switch (p) {
    case RECOMPUTE_NONE: return "none";
    case RECOMPUTE_SELECTIVE: return "selective";
    case RECOMPUTE_FULL: return "full";
    case RECOMPUTE_COUNT: break;
  }
  return "?";
}

int64_t block_kept_bytes(const ModelConfig& c, int64_t B, int64_t T, RecomputePolicy policy, const PlanChoices& choices) {
  // A dense block without model parallelism (the blocks that recompute); MLA's sizes with MLA.
  PlanChoices whole = choices;
  whole.context = PlanChoices::NONE, whole.tensor_parallel = whole.sequence_parallel = false;
  LayerPlan plan = resolve_layer_plan(c, 0, whole);
  plan.mlp = MlpKind::dense;
  return block_saved_bytes(c, plan, {.batch = B, .seq_len = T, .keep = policy});
}

std::vector<RecomputePolicy> recompute_plan(const std::string& name, int64_t n_layer) {
  auto all = [n_layer](RecomputePolicy p) { return std::vector<RecomputePolicy>(static_cast<size_t>(n_layer), p); };
  if (name == "none") return all(RECOMPUTE_NONE);
  if (name == "full") return all(RECOMPUTE_FULL);
  if (name == "selective") return all(RECOMPUTE_SELECTIVE);
  if (name.rfind("every:", 0) == 0) {
    char* end = nullptr;
    const long k = std::strtol(name.c_str() + 6, &end, 10);
    LOOM_CHECK(end != name.c_str() + 6 && *end == '\0' && k >= 1, "train.recompute: '", name,
               "' needs a positive block interval, e.g. every:2");
    std::vector<RecomputePolicy> plan = all(RECOMPUTE_NONE);
    for (int64_t l = 0; l < n_layer; l += k) plan[static_cast<size_t>(l)] = RECOMPUTE_FULL;
    return plan;
  }
  throw Error(str_cat("train.recompute: unknown policy '", name, "', expected none, selective, full, every:K or budget"));
}

int64_t plan_bytes(const RecomputeCosts& costs, const std::vector<RecomputePolicy>& plan) {
  int64_t bytes = 0;
  bool scratch = false;
  for (size_t l = 0; l < plan.size(); ++l) {
    bytes += costs.bytes[l][plan[l]];
    scratch |= plan[l] != RECOMPUTE_NONE;
  }
  return bytes + (scratch ? costs.scratch_bytes : 0);
}

double plan_seconds(const RecomputeCosts& costs, const std::vector<RecomputePolicy>& plan) {
  double s = 0.0;
  for (size_t l = 0; l < plan.size(); ++l) s += costs.seconds[l][plan[l]];
  return s;
}

std::vector<RecomputePolicy> budget_recompute_plan(const RecomputeCosts& costs, int64_t budget) {
  const size_t L = costs.bytes.size();
  LOOM_CHECK(costs.seconds.size() == L, "recompute costs: ", L, " layers of bytes, ", costs.seconds.size(), " of seconds");
  // No recomputation at all needs no shared record: take it when it fits.
  const std::vector<RecomputePolicy> none(L, RECOMPUTE_NONE);
  if (plan_bytes(costs, none) <= budget) return none;
  const int64_t left = budget - costs.scratch_bytes;  // with the shared record
  const std::vector<RecomputePolicy> full(L, RECOMPUTE_FULL);
  LOOM_CHECK(left >= 0 && plan_bytes(costs, full) <= budget, "train.recompute_budget_mb: ", budget,
             " bytes of activations do not fit even full recomputation of every block (", plan_bytes(costs, full),
             " bytes)");
  // Multiple-choice knapsack over bytes in units of left / 4096, each layer's bytes rounded up
  // (the chosen plan's true bytes are then at most its rounded sum): best[u] = least seconds
  // with u units used so far.
  const double unit = std::max(1.0, static_cast<double>(left) / 4096.0);
  const int64_t units = static_cast<int64_t>(std::floor(static_cast<double>(left) / unit));
  auto cost_units = [&](int64_t bytes) { return static_cast<int64_t>(std::ceil(static_cast<double>(bytes) / unit)); };
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> best(static_cast<size_t>(units + 1), inf), next;
  std::vector<std::vector<int8_t>> choice(L, std::vector<int8_t>(static_cast<size_t>(units + 1), -1));
  best[0] = 0.0;
  for (size_t l = 0; l < L; ++l) {
    next.assign(static_cast<size_t>(units + 1), inf);
    for (int64_t u = 0; u <= units; ++u) {
      if (best[u] == inf) continue;
      for (int p = 0; p < RECOMPUTE_COUNT; ++p) {
        const int64_t v = u + cost_units(costs.bytes[l][p]);
        if (v > units) continue;
        const double s = best[u] + costs.seconds[l][p];
        if (s < next[v]) next[v] = s, choice[l][v] = static_cast<int8_t>(p);
      }
    }
    best.swap(next);
  }
  int64_t at = std::min_element(best.begin(), best.end()) - best.begin();
  LOOM_CHECK(best[at] < inf, "train.recompute_budget_mb: no plan fits ", budget, " bytes");
  std::vector<RecomputePolicy> plan(L);
  for (size_t l = L; l-- > 0;) {
    const int8_t p = choice[l][at];
    plan[l] = static_cast<RecomputePolicy>(p);
    at -= cost_units(costs.bytes[l][p]);
  }
  return plan;
}

}  // namespace loom
