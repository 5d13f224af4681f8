// Group Relative Policy Optimization (train.objective = grpo, docs/finetune.md "GRPO"; Shao et
// al. 2024, "DeepSeekMath", sec. 4.1): for each prompt, G completions are sampled from the
// current weights with the generation engine (paged KV cache, continuous batching, the G samples
// forked from one prefill), each gets a verifiable reward, and each completion's advantage is its
// reward normalised within its group, A_i = (r_i - mean(r)) / (std(r) + 1e-4) (std with Bessel's
// correction, as TRL computes it). The objective (eq. 3) over a micro-batch of P prompts:
//
//   J = 1/P sum_groups 1/G sum_i 1/|o_i| sum_t [ min(rho_t A_i, clip(rho_t, 1 - eps, 1 + eps) A_i) - beta D_t ]
//   rho_t = pi(o_t) / pi_old(o_t),  D_t = pi_ref(o_t) / pi(o_t) - log(pi_ref(o_t) / pi(o_t)) - 1
//
// (D_t: the unbiased KL estimator of eq. 4), and the loss is -J. pi_old is the policy that
// sampled: with one gradient step per rollout (TRL's default, num_iterations = 1) rho_t = 1 and
// the clipping never binds, but grpo_token states the general terms. pi_ref is a frozen copy of
// the initial weights (with LoRA: the base, the adapters being zero), run on each rollout.
//
// Rewards: the built-in exact-answer reward (1 when the first integer in the completion equals
// the prompt's "answer", else 0), or grpo.reward_command: a shell command that reads one JSON
// object per completion ({"prompt", "completion", "answer"}) on stdin and writes one number per
// line on stdout.
//
// Batches: train.batch_size rows = P prompts x G completions, row p G + i being prompt p's
// completion i: prompt and completion (with its stop token) one after another, only the
// completion's tokens counted, padded to train.seq_len. The rollout runs inside fill(), so
// the trainer's step time holds it; rollout_seconds says how much.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "loom/data/loader.h"
#include "loom/data/sft.h"
#include "loom/model/transformer.h"
#include "loom/train/objective.h"
#include "loom/train/trainer.h"

namespace loom {

struct GrpoConfig {
  int64_t group = 4;          // G completions per prompt
  int64_t max_new_tokens = 16;
  double temperature = 1.0;   // of the rollouts (top-k, top-p off)
  double beta = 0.04;         // the KL term's weight (DeepSeekMath's value); 0: no reference model
  double epsilon = 0.2;       // the clipping range
  std::string reward_command;  // "": the built-in exact-answer reward
};

// One completion token's term of J and its derivative with respect to logp (the policy's
// log-probability of the token); old and ref: the sampling policy's and the reference's.
struct TokenTerms {
  double objective = 0, d_logp = 0, kl = 0;
};
TokenTerms grpo_token(const GrpoConfig& config, double advantage, double logp, double old, double ref);

// (r_i - mean) / (std + 1e-4) within each consecutive group of `group` rewards.
std::vector<double> group_advantages(const std::vector<double>& rewards, int64_t group);

// 1 when the first integer in `completion` (an optional '-' and digits) equals `answer` (its
// text, spaces trimmed), else 0.
double exact_answer_reward(const std::string& completion, const std::string& answer);

// What the completions of a rollout are, for the objective.
struct Rollout {
  std::vector<double> rewards, advantages;  // [row]
  std::vector<int64_t> lengths;             // [row] completion tokens (counted targets)
  std::vector<float> reference;             // [row * T + t] the reference's log-probability of target t
};

class GrpoBatches final : public ResumableSource {
 public:
  // decode: tokens -> text (for the reward); stop: the tokens that end a completion. The
  // reference model (when config.beta > 0) is a copy of `policy`'s weights now, or with LoRA the
  // policy itself with its adapters off (the base, no copy).
  GrpoBatches(std::vector<PromptExample> prompts, Transformer& policy, GrpoConfig config, int64_t seq_len,
              uint64_t seed, LoaderOrder order, std::function<std::string(const std::vector<int32_t>&)> decode,
              std::vector<int32_t> stop, int32_t pad_token, const std::string& name);
  ~GrpoBatches() override;

  // The next B / G prompts' rollouts into B rows.
  void fill(const Tensor& tokens, const Tensor& targets) override;
  const Rollout& rollout() const { return rollout_; }
  LoaderState state() const override { return order_.state(); }
  void restore(const LoaderState& state) override { order_.restore(state); }
  void rewind() override { order_.rewind(); }
  int64_t prompts() const { return static_cast<int64_t>(prompts_.size()); }
  // The mean reward of greedy completions of the first `limit` prompts (all when <= 0).
  double greedy_reward(int64_t limit);

  struct Stats {
    int64_t completions = 0, tokens = 0;
    double reward = 0, rollout_seconds = 0;
  };
  Stats take_stats();

 private:
  std::vector<double> rewards(const std::vector<int64_t>& ids, const std::vector<std::vector<int32_t>>& completions) const;
  std::vector<std::vector<int32_t>> generate(const std::vector<int64_t>& ids, int64_t n, double temperature, uint64_t seed);

  std::vector<PromptExample> prompts_;
  Transformer& policy_;
  GrpoConfig config_;
  int64_t seq_len_;
  uint64_t seed_;
  std::function<std::string(const std::vector<int32_t>&)> decode_;
  std::vector<int32_t> stop_;
  int32_t pad_;
  TokenLoader order_;  // over the prompt indices, windows of one
  std::unique_ptr<Transformer> reference_;  // grpo.beta > 0 without LoRA: the initial weights (with LoRA: the policy, adapters off)
  ActivationStore reference_store_;
  Rollout rollout_;
  Stats stats_;
};

// The objective of train.objective = grpo (Trainer::set_objective) over `batches`' rollouts.
class GrpoObjective final : public RowObjective {
 public:
  GrpoObjective(GrpoConfig config, GrpoBatches& batches) : config_(std::move(config)), batches_(batches) {}
  double weigh(Backend& backend, ActivationStore& store, const BatchSource& data) override;
  double take_kl();  // mean KL estimate per counted token since the last call

 private:
  GrpoConfig config_;
  GrpoBatches& batches_;
  double kl_ = 0;
  int64_t kl_tokens_ = 0;
};

// train.objective = grpo: the objective its registry row makes (train/objective.cpp).
std::unique_ptr<Objective> make_grpo_objective(const LoomConfig& config);

}  // namespace loom
