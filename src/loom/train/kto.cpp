#include "loom/train/kto.h"

#include <algorithm>
#include <cmath>

#include "loom/core/error.h"
#include "loom/core/str_printf.h"
#include "loom/train/config.h"
#include "loom/train/dpo.h"
#include "loom/train/parallelize.h"

namespace loom {

namespace {

// (dpo.cpp has the same one.)
double sigmoid(double z) { return z >= 0 ? 1.0 / (1.0 + std::exp(-z)) : std::exp(z) / (1.0 + std::exp(z)); }

}  // namespace

KtoTerms kto_example(const KtoConfig& c, bool desirable, double logp, double ref_logp, double z0) {
  KtoTerms t;
  const double r = logp - ref_logp;
  t.reward = c.beta * r;
  // Eq. 7: lambda_y - v(x, y), v = lambda_D sigmoid(beta (r - z0)) or lambda_U sigmoid(beta (z0 - r)),
  // written lambda sigmoid(-x); d sigmoid(-x) / dx = -sigmoid(x) sigmoid(-x), dx / dr = +-beta.
  const double x = desirable ? c.beta * (r - z0) : c.beta * (z0 - r);
  const double weight = desirable ? c.desirable_weight : c.undesirable_weight;
  t.loss = weight * sigmoid(-x);
  t.d_logp = (desirable ? -1.0 : 1.0) * weight * c.beta * sigmoid(x) * sigmoid(-x);
  return t;
}

double kto_kl_estimate(std::span<const double> policy, std::span<const double> reference) {
  LOOM_CHECK(policy.size() == reference.size() && !policy.empty(), "kto_kl_estimate: ", policy.size(), " policy and ",
             reference.size(), " reference log-probabilities");
  double sum = 0.0;
  for (size_t i = 0; i < policy.size(); ++i) sum += policy[i] - reference[i];
  return std::max(0.0, sum / static_cast<double>(policy.size()));
}

KtoBatches::KtoBatches(std::vector<UnpairedExample> examples, int64_t seq_len, uint64_t seed, LoaderOrder order,
                       int32_t pad_token, const std::string& name)
    : seq_len_(seq_len),
      pad_(pad_token),
      order_(index_split(static_cast<int64_t>(examples.size()), name + " examples"), 1, seed, order) {
  for (UnpairedExample& e : examples) {
    const auto n = static_cast<int64_t>(e.sequence.tokens.size());
    LOOM_CHECK(n <= seq_len + 1, e.line, ": the prompt and the completion are ", n, " tokens, more than "
               "train.seq_len + 1 = ", seq_len + 1);
    examples_.push_back({std::move(e.sequence.tokens), n - e.sequence.counted, e.desirable});
  }
}

int64_t KtoBatches::desirable() const {
  return std::count_if(examples_.begin(), examples_.end(), [](const Example& e) { return e.desirable; });
}

void KtoBatches::fill(const Tensor& tokens, const Tensor& targets) {
  const int64_t T = seq_len_;
  LOOM_CHECK(tokens.ndim() == 2 && tokens.dim(1) == T && tokens.dim(0) % 2 == 0 && tokens.dim(0) >= 4 &&
                 targets.shape() == tokens.shape() && tokens.device() == DEVICE_CPU,
             "KtoBatches: tokens ", tokens.describe(), " must be host (2 x examples, ", T, ") with at least 2 examples "
             "(train.batch_size even and >= 4)");
  const int64_t n = tokens.dim(0) / 2;
  const std::vector<int64_t> ids = order_.next_windows(n);
  int32_t* x = tokens.data<int32_t>();
  int32_t* y = targets.data<int32_t>();
  rows_.assign(static_cast<size_t>(2 * n), RowInfo{});
  std::vector<int32_t> mismatched;
  for (int64_t i = 0; i < n; ++i) {
    const Example& e = examples_[static_cast<size_t>(ids[static_cast<size_t>(i)])];
    write_completion_row(e.tokens, e.prompt, T, pad_, x + i * T, y + i * T);
    rows_[static_cast<size_t>(i)] = {ids[static_cast<size_t>(i)], e.desirable, 0.0,
                                     static_cast<int64_t>(e.tokens.size()) - e.prompt};
    // TRL's rotation by one: example i's prompt with example i - 1's completion.
    const Example& other = examples_[static_cast<size_t>(ids[static_cast<size_t>((i + n - 1) % n)])];
    mismatched.assign(e.tokens.begin(), e.tokens.begin() + e.prompt);
    mismatched.insert(mismatched.end(), other.tokens.begin() + other.prompt, other.tokens.end());
    if (static_cast<int64_t>(mismatched.size()) > T + 1) mismatched.resize(static_cast<size_t>(T + 1));
    write_completion_row(mismatched, e.prompt, T, pad_, x + (n + i) * T, y + (n + i) * T);
    rows_[static_cast<size_t>(n + i)] = {ids[static_cast<size_t>(i)], false, 0.0,
                                         static_cast<int64_t>(mismatched.size()) - e.prompt};
  }
}

void KtoRowObjective::before_forward(Backend& backend, ActivationStore& store) {
  reference_logp_ = reference_.log_probs(backend, store);
}

double KtoRowObjective::weigh(Backend& backend, ActivationStore& store, const BatchSource& data) {
  const std::vector<RowInfo> rows = data.rows();
  const int64_t B = store.batch, n = B / 2;
  LOOM_CHECK(static_cast<int64_t>(rows.size()) == B && B % 2 == 0 && B >= 4, "train.objective = kto: the batch source "
             "gave ", rows.size(), " rows for ", B, " rows (examples and as many mismatched rows, at least 2 of each; "
             "data.format must be unpaired-preference-jsonl or preference-jsonl)");
  LOOM_CHECK(static_cast<int64_t>(reference_logp_.size()) == B, "train.objective = kto: no reference log-probabilities "
             "for this micro-batch (the reference runs in before_forward)");
  const std::vector<double> logp = row_log_probs(backend, store);
  const auto kl_rows = static_cast<size_t>(n);
  const double z0 = kto_kl_estimate(std::span<const double>(logp).subspan(kl_rows),
                                    std::span<const double>(reference_logp_).subspan(kl_rows));
  store.row_weights.assign(static_cast<size_t>(B), 0.0f);  // the mismatched rows: 0, no gradient
  double loss = 0.0;
  for (size_t i = 0; i < kl_rows; ++i) {
    LOOM_CHECK(rows[i].pair == rows[kl_rows + i].pair, "train.objective = kto: row ", kl_rows + i,
               " is not the mismatched row of example row ", i);
    const KtoTerms t = kto_example(config_, rows[i].chosen, logp[i], reference_logp_[i], z0);
    loss += t.loss;
    // d loss / d (row's summed cross-entropy) = -d loss / d log p, over the mean of the n examples.
    store.row_weights[i] = static_cast<float>(-t.d_logp / static_cast<double>(n));
    ++stats_.examples;
    if (rows[i].chosen) {
      ++stats_.desirable, stats_.reward_desirable += t.reward, stats_.logp_desirable += logp[i];
    } else {
      ++stats_.undesirable, stats_.reward_undesirable += t.reward, stats_.logp_undesirable += logp[i];
    }
  }
  reference_logp_.clear();  // consumed: each micro-batch runs its own reference pass
  loss /= static_cast<double>(n);
  ++stats_.batches;
  stats_.loss += loss;
  stats_.kl += z0;
  return loss;
}

KtoRowObjective::Stats KtoRowObjective::take_stats() {
  const Stats s = stats_;
  stats_ = Stats{};
  return s;
}

nlohmann::json kto_metrics(const KtoRowObjective::Stats& s) {
  const double batches = std::max<double>(1.0, static_cast<double>(s.batches));
  nlohmann::json j = {{"examples", s.examples}, {"desirable", s.desirable}, {"undesirable", s.undesirable},
                      {"loss", s.loss / batches}, {"kl", s.kl / batches}};
  const auto d = static_cast<double>(s.desirable), u = static_cast<double>(s.undesirable);
  if (s.desirable > 0) j["reward_chosen"] = s.reward_desirable / d, j["logps_chosen"] = s.logp_desirable / d;
  if (s.undesirable > 0) j["reward_rejected"] = s.reward_undesirable / u, j["logps_rejected"] = s.logp_undesirable / u;
  if (s.desirable > 0 && s.undesirable > 0) j["margin"] = s.reward_desirable / d - s.reward_undesirable / u;
  return j;
}

// ---- train.objective = kto -------------------------------------------------------------------

namespace {

std::string kto_line(const char* what, int64_t step, const KtoRowObjective::Stats& s) {
  const nlohmann::json j = kto_metrics(s);
  const auto mean = [&](const char* key) { return j.contains(key) ? str_printf("%.4f", j[key].get<double>()) : "-"; };
  return str_printf("step %lld: %s loss %.4f, kl %.4f, rewards chosen %s rejected %s, margin %s (%lld examples: %lld "
                    "desirable, %lld undesirable)",
                    static_cast<long long>(step), what, j["loss"].get<double>(), j["kl"].get<double>(),
                    mean("reward_chosen").c_str(), mean("reward_rejected").c_str(), mean("margin").c_str(),
                    static_cast<long long>(s.examples), static_cast<long long>(s.desirable),
                    static_cast<long long>(s.undesirable));
}

class Kto final : public Objective {
 public:
  explicit Kto(const LoomConfig& config) : config_(config.kto), loss_(config.kto) {}

  void read_data(LoomConfig& config) override {
    tokenizer_ = objective_tokenizer(config);
    if (config.data.format == SftFormat::preference_jsonl) {
      pairs_ = read_preference_file(config.data.input, *tokenizer_);
    } else {
      examples_ = read_unpaired_preference_file(config.data.input, *tokenizer_);
    }
  }

  TrainingSplits make_splits(const LoomConfig& config, Transformer&) override {
    const int64_t T = config.train.seq_len;
    const int32_t pad = tokenizer_->eot_token();
    std::vector<UnpairedExample> val;
    if (!pairs_.empty()) {  // the last pairs held out, then both splits unpaired (a pair's sides stay together)
      std::vector<PreferencePair> held_pairs =
          hold_out(pairs_, config.data.val_fraction, config.data.input, "preference pairs");
      examples_ = unpair_preferences(std::move(pairs_));
      val = unpair_preferences(std::move(held_pairs));
    } else {
      val = hold_out(examples_, config.data.val_fraction, config.data.input, "examples");
    }
    auto train =
        std::make_unique<KtoBatches>(std::move(examples_), T, config.loop.seed, LOADER_ORDER_SHUFFLED, pad, "train");
    auto held = std::make_unique<KtoBatches>(std::move(val), T, config.loop.seed, LOADER_ORDER_SEQUENTIAL, pad, "val");
    train_examples_ = train->examples(), train_desirable_ = train->desirable(), val_examples_ = held->examples();
    TrainingSplits s{std::move(train), std::move(held), true};
    const int64_t per_batch = config.train.batch_size / 2;  // each held-out example once
    s.max_val_batches = (val_examples_ + per_batch - 1) / per_batch;
    return s;
  }

  // The reference: the initial weights (before a resume loads later ones).
  void set_up(ObjectiveContext& ctx) override {
    ctx.parts.trainer->set_objective(&loss_);
    const std::string reference = loss_.set_live_reference(*ctx.parts.model);
    const int64_t d = train_desirable_, u = train_examples_ - train_desirable_;
    ctx.sink.line(str_printf("kto (beta %g, desirable weight %g, undesirable weight %g): %lld training examples (%lld "
                             "desirable, %lld undesirable), %lld held out; reference %s; z0 from %lld mismatched rows "
                             "a micro-batch",
                             config_.beta, config_.desirable_weight, config_.undesirable_weight,
                             static_cast<long long>(train_examples_), static_cast<long long>(d),
                             static_cast<long long>(u), static_cast<long long>(val_examples_), reference.c_str(),
                             static_cast<long long>(ctx.config.train.batch_size / 2)));
    // The paper's advice (eq. 8), as TRL warns: lambda_D n_D / (lambda_U n_U) in [1, 4/3].
    const auto nd = static_cast<double>(std::max<int64_t>(d, 1)), nu = static_cast<double>(std::max<int64_t>(u, 1));
    const double wd = config_.desirable_weight, wu = config_.undesirable_weight, ratio = wd * nd / (wu * nu);
    if (d != u && wd > 0.0 && wu > 0.0 && (ratio < 1.0 || ratio > 4.0 / 3.0)) {
      ctx.sink.line(str_printf("note: kto: desirable_weight x desirable / (undesirable_weight x undesirable) = %.3f; "
                               "the KTO paper advises 1 to 4/3 (e.g. kto.desirable_weight = %.3g)",
                               ratio, wu * nu / nd));
    }
  }

  void after_step(ObjectiveContext& ctx, const StepStats& stats, bool logged) override {
    const KtoRowObjective::Stats s = loss_.take_stats();
    ctx.sink.record({stats.step + 1, "kto", kto_metrics(s)});
    if (logged) ctx.sink.line(kto_line("kto", stats.step + 1, s));
  }

  // validate: the base's (the trainer's evaluate with this objective: the mean KTO loss over the
  // held-out batches, each with its own mismatched rows and reference pass).
  void after_validation(ObjectiveContext& ctx, int64_t step, const Validation&) override {
    const KtoRowObjective::Stats held = loss_.take_stats();
    ctx.sink.record({step, "val_kto", kto_metrics(held)});
    ctx.sink.line(kto_line("validation kto", step, held));
  }

  std::string validation_name() const override { return "KTO loss"; }

 private:
  KtoConfig config_;
  KtoRowObjective loss_;
  std::shared_ptr<Tokenizer> tokenizer_;
  std::vector<PreferencePair> pairs_;      // data.format = preference-jsonl
  std::vector<UnpairedExample> examples_;  // data.format = unpaired-preference-jsonl
  int64_t train_examples_ = 0, train_desirable_ = 0, val_examples_ = 0;
};



}  // namespace

std::unique_ptr<Objective> make_kto_objective(const LoomConfig& config) { return std::make_unique<Kto>(config); }

}  // namespace loom
