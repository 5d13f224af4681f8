#include "loom/train/dpo.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "loom/core/error.h"
#include "loom/core/str_printf.h"
#include "loom/train/config.h"
#include "loom/train/objective.h"
#include "loom/train/parallelize.h"

namespace loom {

namespace {

double log_sigmoid(double z) { return z >= 0 ? -std::log1p(std::exp(-z)) : z - std::log1p(std::exp(z)); }
double sigmoid(double z) { return z >= 0 ? 1.0 / (1.0 + std::exp(-z)) : std::exp(z) / (1.0 + std::exp(z)); }

}  // namespace

PairTerms dpo_pair(const DpoConfig& c, double chosen, double rejected, double ref_chosen, double ref_rejected,
                   int64_t len_chosen, int64_t len_rejected) {
  PairTerms t;
  switch (c.loss) {
    case DpoLoss::sigmoid: {
      const double z = c.beta * ((chosen - ref_chosen) - (rejected - ref_rejected));
      t.loss = -log_sigmoid(z);
      t.d_chosen = -c.beta * sigmoid(-z);
      t.d_rejected = -t.d_chosen;
      break;
    }
    case DpoLoss::ipo: {
      const double h = (chosen - ref_chosen) - (rejected - ref_rejected), e = h - 1.0 / (2.0 * c.beta);
      t.loss = e * e;
      t.d_chosen = 2.0 * e;
      t.d_rejected = -t.d_chosen;
      break;
    }
    case DpoLoss::simpo: {
      const double wc = c.beta / static_cast<double>(len_chosen), wr = c.beta / static_cast<double>(len_rejected);
      const double z = wc * chosen - wr * rejected - c.gamma;
      t.loss = -log_sigmoid(z);
      t.d_chosen = -sigmoid(-z) * wc;
      t.d_rejected = sigmoid(-z) * wr;
      t.reward_chosen = wc * chosen;
      t.reward_rejected = wr * rejected;
      return t;
    }
  }
  t.reward_chosen = c.beta * (chosen - ref_chosen);
  t.reward_rejected = c.beta * (rejected - ref_rejected);
  return t;
}

PreferenceBatches::PreferenceBatches(std::vector<PreferencePair> pairs, int64_t seq_len, uint64_t seed,
                                     LoaderOrder order, int32_t pad_token, const std::string& name)
    : seq_len_(seq_len), pad_(pad_token), order_(index_split(static_cast<int64_t>(pairs.size()), name + " pairs"), 1, seed, order) {
  for (const PreferencePair& p : pairs) {
    std::array<Sequence, 2>& q = pairs_.emplace_back();
    for (int side = 0; side < 2; ++side) {
      const SftStream& s = side == 0 ? p.chosen : p.rejected;
      LOOM_CHECK(static_cast<int64_t>(s.tokens.size()) <= seq_len + 1, p.line, ": the prompt and the ",
                 side == 0 ? "chosen" : "rejected", " completion are ", s.tokens.size(), " tokens, more than "
                 "train.seq_len + 1 = ", seq_len + 1);
      q[side].tokens = s.tokens;  // the prompt (mask 0), then the completion and its end (mask 1)
      q[side].prompt = static_cast<int64_t>(s.tokens.size()) - s.counted;
      q[side].length = s.counted;
    }
  }
}

void PreferenceBatches::fill_pairs(const std::vector<int64_t>& ids, const Tensor& tokens, const Tensor& targets) {
  const int64_t T = seq_len_;
  LOOM_CHECK(tokens.ndim() == 2 && tokens.dim(1) == T && tokens.dim(0) == 2 * static_cast<int64_t>(ids.size()) &&
                 targets.shape() == tokens.shape() && tokens.device() == DEVICE_CPU,
             "PreferenceBatches: tokens ", tokens.describe(), " must be host (2 x pairs, ", T, ")");
  int32_t* x = tokens.data<int32_t>();
  int32_t* y = targets.data<int32_t>();
  rows_.clear();
  for (size_t i = 0; i < ids.size(); ++i) {
    for (int side = 0; side < 2; ++side) {
      const Sequence& s = pairs_[static_cast<size_t>(ids[i])][static_cast<size_t>(side)];
      const int64_t row = 2 * static_cast<int64_t>(i) + side;
      write_completion_row(s.tokens, s.prompt, T, pad_, x + row * T, y + row * T);
      rows_.push_back({ids[i], side == 0, s.reference, s.length});
    }
  }
}

void PreferenceBatches::fill(const Tensor& tokens, const Tensor& targets) {
  LOOM_CHECK(tokens.ndim() == 2 && tokens.dim(0) % 2 == 0, "PreferenceBatches: ", tokens.dim(0),
             " rows; preference batches hold pairs (train.batch_size must be even)");
  fill_pairs(order_.next_windows(tokens.dim(0) / 2), tokens, targets);
}

void PreferenceBatches::fill_from(int64_t first, const Tensor& tokens, const Tensor& targets) {
  std::vector<int64_t> ids(static_cast<size_t>(tokens.dim(0) / 2));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = (first + static_cast<int64_t>(i)) % pairs();
  fill_pairs(ids, tokens, targets);
}

void PreferenceBatches::set_reference(int64_t pair, double chosen, double rejected) {
  pairs_[static_cast<size_t>(pair)][0].reference = chosen;
  pairs_[static_cast<size_t>(pair)][1].reference = rejected;
}

std::vector<double> row_log_probs(Backend& backend, const ActivationStore& store) {
  const int64_t B = store.batch, T = store.seq_len;
  std::vector<float> losses(static_cast<size_t>(B * T));
  backend.read(store.losses, losses.data());
  std::vector<double> out(static_cast<size_t>(B), 0.0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) out[static_cast<size_t>(b)] -= losses[static_cast<size_t>(b * T + t)];
  }
  return out;
}

double DpoObjective::weigh(Backend& backend, ActivationStore& store, const BatchSource& data) {
  const std::vector<RowInfo> rows = data.rows();
  const int64_t B = store.batch;
  LOOM_CHECK(static_cast<int64_t>(rows.size()) == B && B % 2 == 0, "train.objective = dpo: the batch source gave ",
             rows.size(), " preference rows for ", B, " rows (data.format must be preference-jsonl)");
  const std::vector<double> logp = row_log_probs(backend, store);
  const auto pairs = static_cast<double>(B / 2);
  store.row_weights.assign(static_cast<size_t>(B), 0.0f);
  double loss = 0.0;
  for (int64_t i = 0; i < B / 2; ++i) {
    const auto w = static_cast<size_t>(2 * i), l = w + 1;
    LOOM_CHECK(rows[w].chosen && !rows[l].chosen && rows[w].pair == rows[l].pair, "train.objective = dpo: rows ", w,
               " and ", l, " are not one pair's chosen and rejected sequences");
    const bool live = !live_.empty() && !config_.reference_free();
    const double ref_w = live ? live_[w] : rows[w].reference, ref_l = live ? live_[l] : rows[l].reference;
    const PairTerms t = dpo_pair(config_, logp[w], logp[l], ref_w, ref_l, rows[w].length, rows[l].length);
    loss += t.loss;
    // d loss / d (row's summed cross-entropy) = -d loss / d log p, over the micro-batch's mean.
    store.row_weights[w] = static_cast<float>(-t.d_chosen / pairs);
    store.row_weights[l] = static_cast<float>(-t.d_rejected / pairs);
    ++stats_.pairs;
    stats_.loss += t.loss;
    stats_.reward_chosen += t.reward_chosen;
    stats_.reward_rejected += t.reward_rejected;
    stats_.correct += t.reward_chosen > t.reward_rejected ? 1.0 : 0.0;
  }
  return loss / pairs;
}

std::string DpoObjective::set_live_reference(Transformer& policy) {
  LOOM_CHECK(config_.reference == DpoReference::live && !config_.reference_free(),
             "set_live_reference: dpo.reference = live with a loss that has a reference");
  return reference_.set(policy);
}

void DpoObjective::before_forward(Backend& backend, ActivationStore& store) {
  if (reference_.active()) live_ = reference_.log_probs(backend, store);
}

std::string LiveReference::set(Transformer& policy) {
  if (policy.config().lora()) {
    policy_ = &policy;
    return "live: the policy with its LoRA adapters off (the base)";
  }
  copy_ = std::make_unique<Transformer>(policy.backend(), policy.config());
  policy.backend().copy(policy.params(), copy_->params());
  copy_->set_precision(policy.precision());
  copy_->set_recording(false);
  return "live: a frozen copy of the initial weights";
}

std::vector<double> LiveReference::log_probs(Backend& backend, ActivationStore& store) {
  LOOM_CHECK(active(), "LiveReference: no reference model (set it before the first micro-batch)");
  if (policy_ != nullptr) {  // the same rows through the base: the policy's forward then overwrites the store
    const uint32_t pass = store.dropout_pass;
    store.adapters_off = true, store.dropout_pass = 0;
    const bool recording = policy_->recording();
    policy_->set_recording(false);  // (FP8 delayed scaling: the reference pass is not recorded)
    policy_->forward(store);
    policy_->set_recording(recording);
    store.adapters_off = false, store.dropout_pass = pass;
    return row_log_probs(backend, store);
  }
  if (store_ == nullptr || store_->batch != store.batch || store_->seq_len != store.seq_len) {
    store_ = std::make_unique<ActivationStore>(copy_->allocate_store(store.batch, store.seq_len));
  }
  backend.copy(store.tokens, store_->tokens);
  backend.copy(store.targets, store_->targets);
  copy_->forward(*store_);  // (its frozen bf16 copy, if any, was made by set_precision)
  return row_log_probs(backend, *store_);
}

void DpoObjective::compute_reference(Trainer& trainer, PreferenceBatches& pairs, int64_t rows) const {
  if (config_.reference_free() || config_.reference == DpoReference::live) return;
  // A source over pairs first, first + 1, ...: the reference pass's batches.
  class From final : public BatchSource {
   public:
    From(PreferenceBatches& p) : p_(p) {}
    void fill(const Tensor& tokens, const Tensor& targets) override { p_.fill_from(first, tokens, targets); }
    PreferenceBatches& p_;
    int64_t first = 0;
  } from(pairs);
  for (int64_t first = 0; first < pairs.pairs(); first += rows / 2) {
    from.first = first;
    const std::vector<double> logp = row_log_probs(trainer.backend(), trainer.forward_only(from));
    for (int64_t i = 0; i < rows / 2 && first + i < pairs.pairs(); ++i) {
      pairs.set_reference(first + i, logp[static_cast<size_t>(2 * i)], logp[static_cast<size_t>(2 * i + 1)]);
    }
  }
}

DpoObjective::Stats DpoObjective::take_stats() {
  const Stats s = stats_;
  stats_ = Stats{};
  return s;
}

TrainingSplits preference_splits(std::vector<PreferencePair> pairs, int32_t pad, const LoomConfig& config) {
  const int64_t T = config.train.seq_len;
  std::vector<PreferencePair> val = hold_out(pairs, config.data.val_fraction, config.data.input, "preference pairs");
  TrainingSplits s;
  s.train = std::make_unique<PreferenceBatches>(std::move(pairs), T, config.loop.seed, LOADER_ORDER_SHUFFLED, pad, "train");
  auto held = std::make_unique<PreferenceBatches>(std::move(val), T, config.loop.seed, LOADER_ORDER_SEQUENTIAL, pad, "val");
  const int64_t per_batch = config.train.batch_size / 2;  // each held-out pair once
  s.max_val_batches = (held->pairs() + per_batch - 1) / per_batch;
  s.val = std::move(held);
  s.whole_sequences = true;
  return s;
}

// ---- train.objective = dpo ------------------------------------------------------------------

namespace {

// The means of the stats: TRL's loss, rewards, margin and accuracy.
nlohmann::json dpo_json(const DpoObjective::Stats& s) {
  const double n = std::max<double>(1.0, static_cast<double>(s.pairs));
  return {{"pairs", s.pairs}, {"loss", s.loss / n}, {"reward_chosen", s.reward_chosen / n},
          {"reward_rejected", s.reward_rejected / n}, {"margin", (s.reward_chosen - s.reward_rejected) / n},
          {"accuracy", s.correct / n}};
}

std::string dpo_line(const char* what, int64_t step, const DpoObjective::Stats& s) {
  const nlohmann::json j = dpo_json(s);
  return str_printf("step %lld: %s loss %.4f, rewards chosen %.4f rejected %.4f, margin %.4f, accuracy %.3f (%lld pairs)",
                    static_cast<long long>(step), what, j["loss"].get<double>(), j["reward_chosen"].get<double>(),
                    j["reward_rejected"].get<double>(), j["margin"].get<double>(), j["accuracy"].get<double>(),
                    static_cast<long long>(s.pairs));
}

class Dpo final : public Objective {
 public:
  explicit Dpo(const LoomConfig& config) : loss_(config.dpo) {}

  void read_data(LoomConfig& config) override {
    tokenizer_ = objective_tokenizer(config);
    pairs_ = read_preference_file(config.data.input, *tokenizer_);
  }

  TrainingSplits make_splits(const LoomConfig& config, Transformer&) override {
    TrainingSplits s = preference_splits(std::move(pairs_), tokenizer_->eot_token(), config);
    train_ = static_cast<PreferenceBatches*>(s.train.get()), val_ = static_cast<PreferenceBatches*>(s.val.get());
    return s;
  }

  // The reference: the initial weights (before a resume loads later ones).
  void set_up(ObjectiveContext& ctx) override {
    const DpoConfig& c = ctx.config.dpo;
    Trainer& trainer = *ctx.parts.trainer;
    trainer.set_objective(&loss_);
    const auto start = std::chrono::steady_clock::now();
    for (PreferenceBatches* split : {train_, val_}) loss_.compute_reference(trainer, *split, ctx.config.train.batch_size);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::string reference =
        c.reference_free() ? "no reference model" : str_cat("reference log-probabilities of the initial weights: ", seconds, " s");
    if (c.reference == DpoReference::live && !c.reference_free()) reference = "reference " + loss_.set_live_reference(*ctx.parts.model);
    ctx.sink.line(str_printf("dpo (%s, beta %g): %lld training pairs, %lld held out; %s", std::string(enum_name(c.loss)).c_str(),
                             c.beta, static_cast<long long>(train_->pairs()), static_cast<long long>(val_->pairs()),
                             reference.c_str()));
  }

  void after_step(ObjectiveContext& ctx, const StepStats& stats, bool logged) override {
    const DpoObjective::Stats s = loss_.take_stats();
    ctx.sink.record({stats.step + 1, "dpo", dpo_json(s)});
    if (logged) ctx.sink.line(dpo_line("dpo", stats.step + 1, s));
  }

  void after_validation(ObjectiveContext& ctx, int64_t step, const Validation&) override {
    const DpoObjective::Stats held = loss_.take_stats();
    ctx.sink.record({step, "val_dpo", dpo_json(held)});
    ctx.sink.line(dpo_line("validation dpo", step, held));
  }

  std::string validation_name() const override { return "DPO loss"; }

 private:
  DpoObjective loss_;
  std::shared_ptr<Tokenizer> tokenizer_;
  std::vector<PreferencePair> pairs_;
  PreferenceBatches *train_ = nullptr, *val_ = nullptr;
};




}  // namespace

std::unique_ptr<Objective> make_dpo_objective(const LoomConfig& config) { return std::make_unique<Dpo>(config); }

}  // namespace loom
