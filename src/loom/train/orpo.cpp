#include "loom/train/orpo.h"

#include <algorithm>
#include <cmath>

#include "loom/core/error.h"
#include "loom/core/str_printf.h"
#include "loom/core/targets.h"
#include "loom/train/config.h"
#include "loom/train/dpo.h"
#include "loom/train/parallelize.h"

namespace loom {

namespace {

// (dpo.cpp has the same two.)
double log_sigmoid(double z) { return z >= 0 ? -std::log1p(std::exp(-z)) : z - std::log1p(std::exp(z)); }
double sigmoid(double z) { return z >= 0 ? 1.0 / (1.0 + std::exp(-z)) : std::exp(z) / (1.0 + std::exp(z)); }

// log(1 - exp(x)) for x < 0 without cancellation (TRL's log1mexp; Maechler 2012, "Accurately
// Computing log(1 - exp(-|a|))"): log1p(-exp(x)) below -ln 2, log(-expm1(x)) above.
double log1mexp(double x) { return x < -std::log(2.0) ? std::log1p(-std::exp(x)) : std::log(-std::expm1(x)); }

// Each row's counted targets (those that are not kIgnoreTarget): |y|, as TRL's loss mask counts it.
std::vector<int64_t> counted_targets(Backend& backend, const ActivationStore& store) {
  const int64_t B = store.batch, T = store.seq_len;
  std::vector<int32_t> targets(static_cast<size_t>(B * T));
  backend.read(store.targets, targets.data());
  std::vector<int64_t> out(static_cast<size_t>(B), 0);
  for (int64_t i = 0; i < B * T; ++i) {
    out[static_cast<size_t>(i / T)] += targets[static_cast<size_t>(i)] != kIgnoreTarget;
  }
  return out;
}

}  // namespace

OrpoPairTerms orpo_pair(const OrpoConfig& c, double chosen, double rejected, int64_t len_chosen, int64_t len_rejected) {
  LOOM_CHECK(len_chosen > 0 && len_rejected > 0, "orpo_pair: a completion without counted targets (", len_chosen, ", ",
             len_rejected, ")");
  OrpoPairTerms t;
  const auto nw = static_cast<double>(len_chosen), nl = static_cast<double>(len_rejected);
  const double a = chosen / nw, b = rejected / nl;  // the length-averaged log-probabilities
  t.log_odds = (a - b) - (log1mexp(a) - log1mexp(b));
  t.log_sigmoid = log_sigmoid(t.log_odds);
  t.loss = -c.beta * t.log_sigmoid;
  // d L / d a = 1 + exp(a) / (1 - exp(a)) = -1 / expm1(a); likewise d L / d b = 1 / expm1(b).
  const double d_log_odds = -c.beta * sigmoid(-t.log_odds);
  t.d_chosen = d_log_odds * (-1.0 / std::expm1(a)) / nw;
  t.d_rejected = d_log_odds * (1.0 / std::expm1(b)) / nl;
  t.reward_chosen = c.beta * a;
  t.reward_rejected = c.beta * b;
  return t;
}

double OrpoRowObjective::weigh(Backend& backend, ActivationStore& store, const BatchSource& data) {
  const std::vector<RowInfo> rows = data.rows();
  const int64_t B = store.batch;
  LOOM_CHECK(static_cast<int64_t>(rows.size()) == B && B % 2 == 0, "train.objective = orpo: the batch source gave ",
             rows.size(), " preference rows for ", B, " rows (data.format must be preference-jsonl)");
  const std::vector<double> logp = row_log_probs(backend, store);
  const std::vector<int64_t> counted = counted_targets(backend, store);
  int64_t chosen_targets = 0;
  for (int64_t w = 0; w < B; w += 2) chosen_targets += counted[static_cast<size_t>(w)];
  LOOM_CHECK(chosen_targets > 0, "train.objective = orpo: the chosen rows have no counted targets");
  const auto pairs = static_cast<double>(B / 2), tokens = static_cast<double>(chosen_targets);
  store.row_weights.assign(static_cast<size_t>(B), 0.0f);
  double nll = 0.0, odds_ratio = 0.0;
  for (int64_t i = 0; i < B / 2; ++i) {
    const auto w = static_cast<size_t>(2 * i), l = w + 1;
    LOOM_CHECK(rows[w].chosen && !rows[l].chosen && rows[w].pair == rows[l].pair, "train.objective = orpo: rows ", w,
               " and ", l, " are not one pair's chosen and rejected sequences");
    const OrpoPairTerms t = orpo_pair(config_, logp[w], logp[l], counted[w], counted[l]);
    nll -= logp[w] / tokens;
    odds_ratio += t.loss;
    // d loss / d (row's summed cross-entropy) = -d loss / d log p: the NLL's 1 / tokens on a
    // chosen row, and the odds-ratio term's, over the micro-batch's mean.
    store.row_weights[w] = static_cast<float>(1.0 / tokens - t.d_chosen / pairs);
    store.row_weights[l] = static_cast<float>(-t.d_rejected / pairs);
    ++stats_.pairs;
    stats_.reward_chosen += t.reward_chosen;
    stats_.reward_rejected += t.reward_rejected;
    stats_.correct += t.reward_chosen > t.reward_rejected ? 1.0 : 0.0;
    stats_.log_sigmoid += t.log_sigmoid;
    stats_.log_odds += t.log_odds;
  }
  const double loss = nll + odds_ratio / pairs;
  ++stats_.batches;
  stats_.loss += loss;
  stats_.nll += nll;
  return loss;
}

OrpoRowObjective::Stats OrpoRowObjective::take_stats() {
  const Stats s = stats_;
  stats_ = Stats{};
  return s;
}

nlohmann::json orpo_metrics(const OrpoRowObjective::Stats& s) {
  const double n = std::max<double>(1.0, static_cast<double>(s.pairs));
  const double batches = std::max<double>(1.0, static_cast<double>(s.batches));
  return {{"pairs", s.pairs}, {"loss", s.loss / batches}, {"nll_loss", s.nll / batches},
          {"reward_chosen", s.reward_chosen / n}, {"reward_rejected", s.reward_rejected / n},
          {"margin", (s.reward_chosen - s.reward_rejected) / n}, {"accuracy", s.correct / n},
          {"log_odds_ratio", s.log_sigmoid / n}, {"log_odds_chosen", s.log_odds / n}};
}

// ---- train.objective = orpo ------------------------------------------------------------------

namespace {

std::string orpo_line(const char* what, int64_t step, const OrpoRowObjective::Stats& s) {
  const nlohmann::json j = orpo_metrics(s);
  return str_printf("step %lld: %s loss %.4f (nll %.4f, log odds ratio %.4f), rewards chosen %.4f rejected %.4f, "
                    "margin %.4f, accuracy %.3f (%lld pairs)",
                    static_cast<long long>(step), what, j["loss"].get<double>(), j["nll_loss"].get<double>(),
                    j["log_odds_ratio"].get<double>(), j["reward_chosen"].get<double>(),
                    j["reward_rejected"].get<double>(), j["margin"].get<double>(), j["accuracy"].get<double>(),
                    static_cast<long long>(s.pairs));
}

class Orpo final : public Objective {
 public:
  explicit Orpo(const LoomConfig& config) : config_(config.orpo), loss_(config.orpo) {}

  void read_data(LoomConfig& config) override {
    tokenizer_ = objective_tokenizer(config);
    pairs_ = read_preference_file(config.data.input, *tokenizer_);
  }

  TrainingSplits make_splits(const LoomConfig& config, Transformer&) override {
    TrainingSplits s = preference_splits(std::move(pairs_), tokenizer_->eot_token(), config);
    train_pairs_ = static_cast<PreferenceBatches*>(s.train.get())->pairs();
    val_pairs_ = static_cast<PreferenceBatches*>(s.val.get())->pairs();
    return s;
  }

  void set_up(ObjectiveContext& ctx) override {
    ctx.parts.trainer->set_objective(&loss_);
    ctx.sink.line(str_printf("orpo (beta %g): %lld training pairs, %lld held out; no reference model", config_.beta,
                             static_cast<long long>(train_pairs_), static_cast<long long>(val_pairs_)));
  }

  void after_step(ObjectiveContext& ctx, const StepStats& stats, bool logged) override {
    const OrpoRowObjective::Stats s = loss_.take_stats();
    ctx.sink.record({stats.step + 1, "orpo", orpo_metrics(s)});
    if (logged) ctx.sink.line(orpo_line("orpo", stats.step + 1, s));
  }

  // validate: the base's (the trainer's evaluate with this objective: the mean ORPO loss over
  // the held-out batches).
  void after_validation(ObjectiveContext& ctx, int64_t step, const Validation&) override {
    const OrpoRowObjective::Stats held = loss_.take_stats();
    ctx.sink.record({step, "val_orpo", orpo_metrics(held)});
    ctx.sink.line(orpo_line("validation orpo", step, held));
  }

  std::string validation_name() const override { return "ORPO loss"; }

 private:
  OrpoConfig config_;
  OrpoRowObjective loss_;
  std::shared_ptr<Tokenizer> tokenizer_;
  std::vector<PreferencePair> pairs_;
  int64_t train_pairs_ = 0, val_pairs_ = 0;
};



}  // namespace

std::unique_ptr<Objective> make_orpo_objective(const LoomConfig& config) { return std::make_unique<Orpo>(config); }

}  // namespace loom
