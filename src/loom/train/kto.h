// KTO (train.objective = kto, docs/finetune.md "KTO"; Ethayarajh et al. 2024, "KTO: Model
// Alignment as Prospect Theoretic Optimization"): a policy learns from single completions
// labelled desirable or undesirable, against a frozen reference, with TRL KTOTrainer's default
// loss (loss_type "kto", eq. 7 of the paper):
//
//   r = l - l_ref                       the policy's summed log-probability of the completion
//                                       minus the reference's (the implied reward is beta r)
//   z0 = max(0, mean over the batch of (l'_i - l'_ref,i))     the KL estimate, no gradient
//   desirable:    lambda_D (1 - sigmoid(beta (r - z0)))
//   undesirable:  lambda_U (1 - sigmoid(beta (z0 - r)))
//   loss = the mean over the micro-batch's examples
//
// l'_i: the log-probability of a mismatched sequence, example i's prompt with another example's
// completion, as TRL builds them: the completions rotated by one within the batch, so example i's
// prompt goes with example i - 1's completion (example 0's with the last one's). z0 is TRL's:
// the mean of the policy's minus the reference's log-probabilities of those sequences, clamped at
// 0 and detached, the paper's biased estimate of the KL term from the microbatch's mismatched
// pairs, through which nothing is backpropagated.
// TRL's metrics: kl (z0), rewards beta r of the desirable and the undesirable examples, their
// margin, and the log-probabilities of each.
//
// The reference runs live, each micro-batch, on the same rows just before the policy's forward
// (RowObjective::before_forward): with LoRA the policy with its adapters off (the base, as TRL
// with PEFT), else a frozen copy of the initial weights in the policy's precision.
//
// Batches: train.batch_size rows = n examples and their n mismatched rows: rows 0 .. n-1 the
// examples (prompt, completion and its end-of-sequence token, only the completion counted),
// rows n .. 2n-1 the mismatched sequences (row n + i: example i's prompt, example i - 1's
// completion, cut to train.seq_len + 1 tokens when longer). The mismatched rows are in the batch
// only for their log-probabilities: their row weight is 0, so they get no gradient, as TRL
// computes them under no_grad. train.batch_size must be even and at least 4 (two examples, so
// that a mismatched sequence is one). The example order is a TokenLoader's window order over the
// example indices (windows of one), as DPO's pairs'.
//
// KTO runs on one process: z0 is a mean over the whole batch (TRL gathers it over processes),
// which data-parallel ranks would each compute over their own rows.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/data/loader.h"
#include "loom/data/sft.h"
#include "loom/train/dpo.h"
#include "loom/train/objective.h"
#include "loom/train/trainer.h"

namespace loom {

struct KtoConfig {
  double beta = 0.1;                // kto.beta (TRL KTOConfig's default)
  double desirable_weight = 1.0;    // kto.desirable_weight: lambda_D
  double undesirable_weight = 1.0;  // kto.undesirable_weight: lambda_U
};

// One example's weighted loss, its derivative with respect to l (the policy's summed
// log-probability; z0 is a constant), and its reward beta r.
struct KtoTerms {
  double loss = 0, d_logp = 0, reward = 0;
};
KtoTerms kto_example(const KtoConfig& config, bool desirable, double logp, double ref_logp, double z0);

// z0: max(0, mean of policy[i] - reference[i]) over the mismatched sequences.
double kto_kl_estimate(std::span<const double> policy, std::span<const double> reference);

// The examples as micro-batches (see above). Each example must fit train.seq_len + 1 tokens; a
// longer one is refused naming its line.
class KtoBatches final : public ResumableSource {
 public:
  KtoBatches(std::vector<UnpairedExample> examples, int64_t seq_len, uint64_t seed, LoaderOrder order,
             int32_t pad_token, const std::string& name);
  // The next B / 2 examples of the order and their mismatched sequences into B rows.
  void fill(const Tensor& tokens, const Tensor& targets) override;
  // Rows 0 .. n-1: {example, desirable, 0, counted targets}; row n + i: {example i's index,
  // false, 0, the mismatched completion's counted targets}.
  std::vector<RowInfo> rows() const override { return rows_; }
  int64_t examples() const { return static_cast<int64_t>(examples_.size()); }
  int64_t desirable() const;  // how many examples are desirable
  LoaderState state() const override { return order_.state(); }
  void restore(const LoaderState& state) override { order_.restore(state); }
  void rewind() override { order_.rewind(); }

 private:
  struct Example {
    std::vector<int32_t> tokens;  // the prompt, then the completion and its end
    int64_t prompt = 0;           // tokens before the completion (not counting)
    bool desirable = true;
  };
  std::vector<Example> examples_;
  int64_t seq_len_;
  int32_t pad_;
  TokenLoader order_;  // over the example indices, windows of one
  std::vector<RowInfo> rows_;
};

// The objective of train.objective = kto (Trainer::set_objective): the micro-batch's loss above
// and each example row's weight -d loss / d l (the mismatched rows' 0).
class KtoRowObjective final : public RowObjective {
 public:
  explicit KtoRowObjective(KtoConfig config) : config_(config) {}
  // The reference (see LiveReference); required before the first micro-batch.
  std::string set_live_reference(Transformer& policy) { return reference_.set(policy); }
  void before_forward(Backend& backend, ActivationStore& store) override;
  double weigh(Backend& backend, ActivationStore& store, const BatchSource& data) override;

  // Sums since the last take_stats(): per example (rewards and log-probabilities by label), per
  // micro-batch (loss, z0).
  struct Stats {
    int64_t examples = 0, desirable = 0, undesirable = 0, batches = 0;
    double loss = 0, kl = 0, reward_desirable = 0, reward_undesirable = 0, logp_desirable = 0, logp_undesirable = 0;
  };
  Stats take_stats();

 private:
  KtoConfig config_;
  Stats stats_;
  LiveReference reference_;
  std::vector<double> reference_logp_;  // this micro-batch's rows' reference log-probabilities
};

// The means of `s`: a metrics.jsonl record's "kto" / "val_kto" object (examples, desirable,
// undesirable, loss, kl, reward_chosen, reward_rejected, margin, logps_chosen, logps_rejected;
// TRL's names: chosen = desirable). A mean over no example is null.
nlohmann::json kto_metrics(const KtoRowObjective::Stats& s);

// train.objective = kto: the objective its registry row makes (train/objective.cpp).
std::unique_ptr<Objective> make_kto_objective(const LoomConfig& config);

}  // namespace loom
