#include "loom/train/grpo.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/core/str_printf.h"
#include "loom/core/file_io.h"
#include "loom/core/signals.h"
#include "loom/core/targets.h"
#include "loom/infer/engine.h"
#include "loom/train/config.h"
#include "loom/train/objective.h"
#include "loom/train/parallelize.h"

namespace loom {

TokenTerms grpo_token(const GrpoConfig& c, double advantage, double logp, double old, double ref) {
  TokenTerms t;
  const double rho = std::exp(logp - old);
  const double clipped = std::clamp(rho, 1.0 - c.epsilon, 1.0 + c.epsilon);
  // min(rho A, clip(rho) A): the unclipped term carries the gradient (d rho / d logp = rho)
  // unless the clipped one is smaller.
  if (rho * advantage <= clipped * advantage) {
    t.objective = rho * advantage;
    t.d_logp = rho * advantage;
  } else {
    t.objective = clipped * advantage;
  }
  const double x = ref - logp;  // D = e^x - x - 1, dD/dlogp = 1 - e^x
  t.kl = std::exp(x) - x - 1.0;
  t.objective -= c.beta * t.kl;
  t.d_logp -= c.beta * (1.0 - std::exp(x));
  return t;
}

std::vector<double> group_advantages(const std::vector<double>& rewards, int64_t group) {
  LOOM_CHECK(group >= 2 && rewards.size() % static_cast<size_t>(group) == 0, "group_advantages: ", rewards.size(),
             " rewards in groups of ", group);
  std::vector<double> a(rewards.size());
  for (size_t g = 0; g < rewards.size(); g += static_cast<size_t>(group)) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < group; ++i) mean += rewards[g + static_cast<size_t>(i)];
    mean /= static_cast<double>(group);
    for (int64_t i = 0; i < group; ++i) var += std::pow(rewards[g + static_cast<size_t>(i)] - mean, 2);
    const double std = std::sqrt(var / static_cast<double>(group - 1));
    for (int64_t i = 0; i < group; ++i) a[g + static_cast<size_t>(i)] = (rewards[g + static_cast<size_t>(i)] - mean) / (std + 1e-4);
  }
  return a;
}

double exact_answer_reward(const std::string& completion, const std::string& answer) {
  size_t i = 0;
  while (i < completion.size() && !std::isdigit(static_cast<unsigned char>(completion[i]))) ++i;
  if (i == completion.size()) return 0.0;
  size_t begin = i > 0 && completion[i - 1] == '-' ? i - 1 : i;
  while (i < completion.size() && std::isdigit(static_cast<unsigned char>(completion[i]))) ++i;
  const size_t a = answer.find_first_not_of(" \t\n"), b = answer.find_last_not_of(" \t\n");
  const std::string want = a == std::string::npos ? "" : answer.substr(a, b - a + 1);
  return completion.substr(begin, i - begin) == want ? 1.0 : 0.0;
}

GrpoBatches::GrpoBatches(std::vector<PromptExample> prompts, Transformer& policy, GrpoConfig config, int64_t seq_len,
                         uint64_t seed, LoaderOrder order, std::function<std::string(const std::vector<int32_t>&)> decode,
                         std::vector<int32_t> stop, int32_t pad_token, const std::string& name)
    : prompts_(std::move(prompts)), policy_(policy), config_(std::move(config)), seq_len_(seq_len), seed_(seed),
      decode_(std::move(decode)), stop_(std::move(stop)), pad_(pad_token),
      order_(index_split(static_cast<int64_t>(prompts_.size()), name + " prompts"), 1, seed, order) {
  LOOM_CHECK(config_.group >= 2, "grpo.group must be >= 2 (advantages are relative to the group), got ", config_.group);
  for (const PromptExample& p : prompts_) {
    LOOM_CHECK(static_cast<int64_t>(p.prompt.size()) + config_.max_new_tokens <= seq_len + 1, p.line, ": the prompt (",
               p.prompt.size(), " tokens) and grpo.max_new_tokens = ", config_.max_new_tokens,
               " do not fit train.seq_len + 1 = ", seq_len + 1);
  }
  // The reference: the initial weights, frozen -- with LoRA the policy with its adapters off (the
  // base, as TRL with PEFT: no second copy), else a copy.
  if (config_.beta > 0.0 && !policy.config().lora()) {
    reference_ = std::make_unique<Transformer>(policy.backend(), policy.config());
    policy.backend().copy(policy.params(), reference_->params());
  }
}

GrpoBatches::~GrpoBatches() = default;

std::vector<std::vector<int32_t>> GrpoBatches::generate(const std::vector<int64_t>& ids, int64_t n, double temperature,
                                                        uint64_t seed) {
  EngineConfig ec;
  ec.max_batch = std::max<int64_t>(1, std::min<int64_t>(64, static_cast<int64_t>(ids.size()) * n));
  GenerationEngine engine(policy_, ec);
  for (size_t p = 0; p < ids.size(); ++p) {
    GenerationRequest r;
    r.prompt = prompts_[static_cast<size_t>(ids[p])].prompt;
    r.sampling.temperature = static_cast<float>(temperature);
    r.sampling.seed = seed + static_cast<uint64_t>(p) * static_cast<uint64_t>(n);
    r.max_new_tokens = config_.max_new_tokens;
    r.stop_tokens = stop_;
    r.n = n;
    engine.submit(std::move(r));
  }
  std::vector<std::vector<int32_t>> out;
  for (GenerationResult& g : engine.run()) out.push_back(std::move(g.tokens));
  return out;
}

std::vector<double> GrpoBatches::rewards(const std::vector<int64_t>& ids,
                                         const std::vector<std::vector<int32_t>>& completions) const {
  const size_t per = completions.size() / ids.size();
  std::vector<double> r(completions.size());
  if (config_.reward_command.empty()) {
    for (size_t i = 0; i < completions.size(); ++i) {
      r[i] = exact_answer_reward(decode_(completions[i]), prompts_[static_cast<size_t>(ids[i / per])].answer);
    }
    return r;
  }
  // The command: one JSON object per completion on stdin, one number per line on stdout.
  const std::string input = (std::filesystem::temp_directory_path() /
                             ("loom_grpo_" + std::to_string(::getpid()) + ".jsonl")).string();
  {
    std::ofstream f(input);
    for (size_t i = 0; i < completions.size(); ++i) {
      const PromptExample& p = prompts_[static_cast<size_t>(ids[i / per])];
      // A completion may end inside a multi-byte character: invalid bytes become U+FFFD.
      const nlohmann::json line = {{"prompt", p.text}, {"completion", decode_(completions[i])}, {"answer", p.answer}};
      f << line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    }
    LOOM_CHECK(f.good(), "grpo.reward_command: cannot write ", input);
  }
  FILE* pipe = nullptr;
  {
    const OriginalSignalMask mask;  // the command gets the signals loom's threads block (core/signals.h)
    pipe = ::popen((config_.reward_command + " < '" + input + "'").c_str(), "r");
  }
  std::string output;
  if (pipe != nullptr) {
    char buffer[4096];
    for (size_t got; (got = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0;) output.append(buffer, got);
  }
  const int status = pipe != nullptr ? ::pclose(pipe) : -1;
  std::filesystem::remove(input);
  LOOM_CHECK(pipe != nullptr && status == 0, "grpo.reward_command '", config_.reward_command, "' failed (status ",
             status, ")");
  std::istringstream lines(output);
  std::string line;
  size_t got = 0;
  while (std::getline(lines, line) && got < r.size()) {
    char* end = nullptr;
    r[got] = std::strtod(line.c_str(), &end);
    LOOM_CHECK(end != line.c_str() && std::isfinite(r[got]), "grpo.reward_command: line ", got + 1, " of its output is '",
               line, "', expected a finite number");
    ++got;
  }
  LOOM_CHECK(got == r.size(), "grpo.reward_command printed ", got, " rewards for ", r.size(), " completions");
  return r;
}

void GrpoBatches::fill(const Tensor& tokens, const Tensor& targets) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t B = tokens.dim(0), T = seq_len_, G = config_.group;
  LOOM_CHECK(tokens.ndim() == 2 && tokens.dim(1) == T && B % G == 0 && tokens.device() == DEVICE_CPU,
             "train.objective = grpo: train.batch_size (", B, ") must be a multiple of grpo.group (", G, ")");
  const int64_t P = B / G;
  const LoaderState at = order_.state();
  const std::vector<int64_t> ids = order_.next_windows(P);
  // The rollout's seeds follow the position in the prompt order: a resumed run draws the same.
  const uint64_t draw = at.epoch * at.windows_per_epoch + at.index;
  const std::vector<std::vector<int32_t>> completions = generate(ids, G, config_.temperature, seed_ ^ (draw * 0x9E3779B97F4A7C15ull));
  rollout_.rewards = rewards(ids, completions);
  rollout_.advantages = group_advantages(rollout_.rewards, G);
  rollout_.lengths.assign(static_cast<size_t>(B), 0);
  int32_t* x = tokens.data<int32_t>();
  int32_t* y = targets.data<int32_t>();
  for (int64_t row = 0; row < B; ++row) {
    const std::vector<int32_t>& prompt = prompts_[static_cast<size_t>(ids[static_cast<size_t>(row / G)])].prompt;
    const std::vector<int32_t>& completion = completions[static_cast<size_t>(row)];
    std::vector<int32_t> seq = prompt;
    seq.insert(seq.end(), completion.begin(), completion.end());
    write_completion_row(seq, static_cast<int64_t>(prompt.size()), T, pad_, x + row * T, y + row * T);
    rollout_.lengths[static_cast<size_t>(row)] = static_cast<int64_t>(completion.size());
    stats_.reward += rollout_.rewards[static_cast<size_t>(row)];
    stats_.tokens += static_cast<int64_t>(completion.size());
  }
  stats_.completions += B;
  rollout_.reference.clear();
  if (config_.beta > 0.0) {  // the reference's log-probabilities of the completions' tokens
    Transformer& reference = reference_ != nullptr ? *reference_ : policy_;
    if (reference_store_.batch != B) reference_store_ = reference.allocate_store(B, T);
    reference.backend().write(reference_store_.tokens, x);
    reference.backend().write(reference_store_.targets, y);
    reference_store_.adapters_off = reference_ == nullptr;  // LoRA: the base
    const bool recording = reference.recording();
    reference.set_recording(false);
    reference.forward(reference_store_);
    reference.set_recording(recording);
    rollout_.reference.resize(static_cast<size_t>(B * T));
    reference.backend().read(reference_store_.losses, rollout_.reference.data());
    for (float& v : rollout_.reference) v = -v;
  }
  stats_.rollout_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double GrpoBatches::greedy_reward(int64_t limit) {
  const int64_t n = limit > 0 ? std::min(limit, prompts()) : prompts();
  std::vector<int64_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = i;
  const std::vector<double> r = rewards(ids, generate(ids, 1, 0.0, seed_));
  double sum = 0;
  for (double v : r) sum += v;
  return n > 0 ? sum / static_cast<double>(n) : 0.0;
}

GrpoBatches::Stats GrpoBatches::take_stats() {
  const Stats s = stats_;
  stats_ = Stats{};
  return s;
}

double GrpoObjective::weigh(Backend& backend, ActivationStore& store, const BatchSource&) {
  const Rollout& r = batches_.rollout();
  const int64_t B = store.batch, T = store.seq_len;
  LOOM_CHECK(static_cast<int64_t>(r.advantages.size()) == B, "train.objective = grpo: ", r.advantages.size(),
             " rollout rows for ", B, " rows");
  std::vector<float> losses(static_cast<size_t>(B * T));
  backend.read(store.losses, losses.data());
  std::vector<int32_t> y(static_cast<size_t>(B * T));
  backend.read(store.targets, y.data());
  store.position_weights.assign(static_cast<size_t>(B * T), 0.0f);
  double loss = 0;
  for (int64_t b = 0; b < B; ++b) {
    const double len = static_cast<double>(std::max<int64_t>(1, r.lengths[static_cast<size_t>(b)]));
    for (int64_t t = 0; t < T; ++t) {
      const auto i = static_cast<size_t>(b * T + t);
      if (y[i] == kIgnoreTarget) continue;
      const double logp = -static_cast<double>(losses[i]);
      const double ref = r.reference.empty() ? logp : static_cast<double>(r.reference[i]);
      // One gradient step per rollout: the sampling policy is this one (rho = 1).
      const TokenTerms k = grpo_token(config_, r.advantages[static_cast<size_t>(b)], logp, logp, ref);
      loss -= k.objective / (len * static_cast<double>(B));
      // loss = -(1 / B) sum_b 1/|o_b| sum_t j_t and CE_t = -logp_t: d loss / d CE_t = (dj/dlogp) / (B |o_b|).
      store.position_weights[i] = static_cast<float>(k.d_logp / (len * static_cast<double>(B)));
      kl_ += k.kl;
      ++kl_tokens_;
    }
  }
  return loss;
}

double GrpoObjective::take_kl() {
  const double mean = kl_tokens_ > 0 ? kl_ / static_cast<double>(kl_tokens_) : 0.0;
  kl_ = 0;
  kl_tokens_ = 0;
  return mean;
}

// ---- train.objective = grpo -----------------------------------------------------------------

namespace {

// What ends a rollout's completion: the end-of-text token and the end-of-sequence one.
std::vector<int32_t> stop_tokens(const Tokenizer& tokenizer) {
  std::vector<int32_t> stop = {tokenizer.eot_token()};
  if (tokenizer.eos_token() && *tokenizer.eos_token() != tokenizer.eot_token()) stop.push_back(*tokenizer.eos_token());
  return stop;
}

class Grpo final : public Objective {
 public:
  void read_data(LoomConfig& config) override {
    tokenizer_ = objective_tokenizer(config);
    prompts_ = read_prompt_file(config.data.input, *tokenizer_);
  }

  TrainingSplits make_splits(const LoomConfig& config, Transformer& policy) override {
    const int64_t T = config.train.seq_len;
    std::vector<PromptExample> val = hold_out(prompts_, config.data.val_fraction, config.data.input, "prompts");
    GrpoConfig held_out_config = config.grpo;
    held_out_config.beta = 0.0;  // the held-out prompts are only decoded greedily: no reference model
    const std::shared_ptr<Tokenizer> tokenizer = tokenizer_;
    auto decode = [tokenizer](const std::vector<int32_t>& t) { return tokenizer->decode(t); };
    const int32_t pad = tokenizer_->eot_token();
    auto train = std::make_unique<GrpoBatches>(std::move(prompts_), policy, config.grpo, T, config.loop.seed,
                                               LOADER_ORDER_SHUFFLED, decode, stop_tokens(*tokenizer_), pad, "train");
    auto held = std::make_unique<GrpoBatches>(std::move(val), policy, held_out_config, T, config.loop.seed,
                                              LOADER_ORDER_SEQUENTIAL, decode, stop_tokens(*tokenizer_), pad, "val");
    train_ = train.get(), val_ = held.get();
    return {std::move(train), std::move(held), true};
  }

  void set_up(ObjectiveContext& ctx) override {
    const GrpoConfig& c = ctx.config.grpo;
    loss_ = std::make_unique<GrpoObjective>(c, *train_);
    ctx.parts.trainer->set_objective(loss_.get());
    ctx.sink.line(str_printf("grpo: %lld training prompts, %lld held out; %lld completions per prompt, up to %lld tokens, "
                             "temperature %g; beta %g, epsilon %g; reward: %s",
                             static_cast<long long>(train_->prompts()), static_cast<long long>(val_->prompts()),
                             static_cast<long long>(c.group), static_cast<long long>(c.max_new_tokens), c.temperature, c.beta,
                             c.epsilon, c.reward_command.empty() ? "exact answer (built in)" : c.reward_command.c_str()));
  }

  // The curve's start: the initial weights' greedy reward.
  std::optional<Validation> at_start(ObjectiveContext& ctx) override { return validate(ctx); }

  // Each step's rollouts; the printed line has the means since the last one.
  void after_step(ObjectiveContext& ctx, const StepStats& stats, bool logged) override {
    const GrpoBatches::Stats g = train_->take_stats();
    window_.completions += g.completions, window_.reward += g.reward, window_.tokens += g.tokens;
    window_.rollout_seconds += g.rollout_seconds, window_seconds_ += stats.seconds;
    const double n = std::max<double>(1.0, static_cast<double>(g.completions));
    const double kl = loss_->take_kl();
    ctx.sink.record({stats.step + 1, "grpo",
                     {{"reward", g.reward / n}, {"completions", g.completions},
                      {"mean_length", static_cast<double>(g.tokens) / n}, {"kl", kl},
                      {"rollout_seconds", g.rollout_seconds}, {"train_seconds", stats.seconds - g.rollout_seconds}}});
    if (!logged) return;
    const double w = std::max<double>(1.0, static_cast<double>(window_.completions));
    ctx.sink.line(str_printf("step %lld: grpo reward %.3f over the last %lld completions (mean length %.1f), KL %.4f (this "
                             "step); rollouts %.2f s, training %.2f s", static_cast<long long>(stats.step + 1),
                             window_.reward / w, static_cast<long long>(window_.completions),
                             static_cast<double>(window_.tokens) / w, kl, window_.rollout_seconds,
                             window_seconds_ - window_.rollout_seconds));
    window_ = GrpoBatches::Stats{};
    window_seconds_ = 0.0;
  }

  // The greedy reward on the held-out prompts.
  Validation validate(ObjectiveContext&) override { return {val_->greedy_reward(0), true}; }
  void after_validation(ObjectiveContext& ctx, int64_t step, const Validation& v) override {
    ctx.sink.line(str_printf("step %lld: validation greedy reward %.4f (%lld prompts)", static_cast<long long>(step), v.value,
                             static_cast<long long>(val_->prompts())));
  }
  std::string validation_name() const override { return "greedy reward"; }

 private:
  std::shared_ptr<Tokenizer> tokenizer_;
  std::vector<PromptExample> prompts_;
  GrpoBatches *train_ = nullptr, *val_ = nullptr;
  std::unique_ptr<GrpoObjective> loss_;
  GrpoBatches::Stats window_;  // the rollouts since the last printed line
  double window_seconds_ = 0.0;
};




}  // namespace

std::unique_ptr<Objective> make_grpo_objective(const LoomConfig&) { return std::make_unique<Grpo>(); }

}  // namespace loom
