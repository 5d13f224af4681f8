// ORPO (train.objective = orpo, docs/finetune.md "ORPO"; Hong, Lee, Thorne 2024, "ORPO: Monolithic
// Preference Optimization without Reference Model"): one stage of supervised fine-tuning and
// preference learning on pairs (prompt, chosen, rejected), with no reference model. Per micro-batch:
//
//   a = lw / |yw|, b = ll / |yl|          the length-averaged log-probabilities (the paper's P(y|x))
//   log odds(y) = a - log(1 - exp(a))     eq. 4: odds(y|x) = P(y|x) / (1 - P(y|x))
//   L = log odds(yw) - log odds(yl)       the log odds ratio
//   loss = NLL - beta mean over pairs of log sigmoid(L)     eq. 6 with eq. 7's L_OR, lambda = beta
//
// lw, ll: the policy's summed log-probability of the chosen and the rejected completion, |y| its
// counted targets (the completion and its end-of-sequence token: the loss mask leaves the prompt
// and the padding out); NLL: the chosen rows' cross-entropy, the mean over all of their counted
// targets in the micro-batch (TRL's CrossEntropyLoss over the chosen rows). log(1 - exp(a)) is
// computed as TRL's log1mexp (log1p(-exp(a)) below -ln 2, log(-expm1(a)) above). TRL ORPOTrainer's
// metrics: rewards beta a and beta b, their margin, the accuracy (share of pairs whose chosen
// reward is the larger), log_odds_ratio (the mean of log sigmoid(L)), log_odds_chosen (the mean of
// L) and nll_loss.
//
// One difference from TRL: TRL's NLL also counts the prompt's tokens (its chosen labels are the
// whole input, a choice kept since TRL PR #2527); here it counts the completion only, the
// supervised loss of the chosen completion as the loss mask defines it everywhere in Loom.
//
// Batches are DPO's (train/dpo.h PreferenceBatches): row 2i pair i's chosen sequence, row 2i + 1
// its rejected one, so train.batch_size must be even.
#pragma once
#include <cstdint>

#include <nlohmann/json.hpp>

#include "loom/train/objective.h"
#include "loom/train/trainer.h"

namespace loom {

struct OrpoConfig {
  double beta = 0.1;  // orpo.beta: lambda, the odds-ratio term's weight (TRL ORPOConfig's default)
};

// One pair's odds-ratio term -beta log sigmoid(L), its derivatives with respect to lw and ll (the
// summed log-probabilities), and what TRL reports of it.
struct OrpoPairTerms {
  double loss = 0, d_chosen = 0, d_rejected = 0;
  double log_odds = 0;     // L
  double log_sigmoid = 0;  // log sigmoid(L)
  double reward_chosen = 0, reward_rejected = 0;  // beta a, beta b
};
OrpoPairTerms orpo_pair(const OrpoConfig& config, double chosen, double rejected, int64_t len_chosen,
                        int64_t len_rejected);

// The trainer's objective (Trainer::set_objective): the micro-batch's loss above, and each row's
// weight d loss / d (its summed cross-entropy): 1 / (the chosen rows' counted targets) - d_chosen
// / pairs on a chosen row, -d_rejected / pairs on a rejected one. |y| is counted from the targets.
class OrpoRowObjective final : public RowObjective {
 public:
  explicit OrpoRowObjective(OrpoConfig config) : config_(config) {}
  double weigh(Backend& backend, ActivationStore& store, const BatchSource& data) override;

  // Sums since the last take_stats(): per pair, and per micro-batch (loss, nll).
  struct Stats {
    int64_t pairs = 0, batches = 0;
    double loss = 0, nll = 0, reward_chosen = 0, reward_rejected = 0, correct = 0, log_sigmoid = 0, log_odds = 0;
  };
  Stats take_stats();

 private:
  OrpoConfig config_;
  Stats stats_;
};

// The means of `s`: a metrics.jsonl record's "orpo" / "val_orpo" object (pairs, loss, nll_loss,
// reward_chosen, reward_rejected, margin, accuracy, log_odds_ratio, log_odds_chosen).
nlohmann::json orpo_metrics(const OrpoRowObjective::Stats& s);

// train.objective = orpo: the objective its registry row makes (train/objective.cpp).
std::unique_ptr<Objective> make_orpo_objective(const LoomConfig& config);

}  // namespace loom
