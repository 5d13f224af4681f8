// Preference optimisation (train.objective = dpo, docs/finetune.md "DPO"): a policy learns from
// pairs (prompt, chosen, rejected) which completion to prefer, against a frozen reference.
//
//   sigmoid  DPO (Rafailov et al. 2023, eq. 7): z = beta ((lw - rw) - (ll - rl)),
//            loss = -log sigmoid(z)
//   ipo      IPO (Azar et al. 2023, eq. 17): h = (lw - rw) - (ll - rl), loss = (h - 1 / (2 beta))^2
//   simpo    SimPO (Meng et al. 2024, eq. 6), no reference: z = beta lw / |yw| - beta ll / |yl| - gamma,
//            loss = -log sigmoid(z)
//
// lw, ll: the policy's log-probability of the chosen and the rejected completion (the sum over
// its tokens, the prompt's not counted: the loss mask of supervised data); rw, rl: the
// reference's, computed once before training from the initial weights (with LoRA the base, the
// adapters being zero). A micro-batch's loss is the mean over its pairs. The rewards reported are
// TRL's: beta (l - r) for each side (SimPO: beta l / |y|), the margin their difference, the
// accuracy the share of pairs whose chosen reward is the larger.
//
// Batches: row 2i is pair i's chosen sequence and row 2i + 1 its rejected one, each padded to
// train.seq_len with masked targets, so train.batch_size (rows) must be even; the pair order is
// a TokenLoader's window order over the pair indices (windows of one), so shuffling, epochs and
// the resumable position are the token loader's.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "loom/core/enum_names.h"
#include "loom/data/loader.h"
#include "loom/data/sft.h"
#include "loom/train/objective.h"
#include "loom/train/trainer.h"

namespace loom {

enum class DpoLoss : uint8_t { sigmoid, ipo, simpo };
template <>
struct EnumNames<DpoLoss> {  // dpo.loss
  static constexpr std::array<std::string_view, 3> names{"sigmoid", "ipo", "simpo"};
};

// Where the reference log-probabilities come from (dpo.reference): computed once before training
// for every pair, or live, each micro-batch, from a reference model beside the policy: with
// LoRA the policy itself with its adapters off (the base, as TRL with PEFT), else a frozen copy
// of the initial weights.
enum class DpoReference : uint8_t { once, live };
template <>
struct EnumNames<DpoReference> {  // dpo.reference
  static constexpr std::array<std::string_view, 2> names{"once", "live"};
};

struct DpoConfig {
  DpoLoss loss = DpoLoss::sigmoid;
  DpoReference reference = DpoReference::once;
  double beta = 0.1;   // TRL's default
  double gamma = 0.5;  // SimPO's target margin (TRL CPOTrainer's simpo_gamma default)
  bool reference_free() const { return loss == DpoLoss::simpo; }
};

// One pair's loss, its derivatives with respect to lw and ll, and its rewards.
struct PairTerms {
  double loss = 0, d_chosen = 0, d_rejected = 0, reward_chosen = 0, reward_rejected = 0;
};
PairTerms dpo_pair(const DpoConfig& config, double chosen, double rejected, double ref_chosen, double ref_rejected,
                   int64_t len_chosen, int64_t len_rejected);

// The preference pairs as micro-batches (see above). Each sequence must fit train.seq_len + 1
// tokens (its inputs and the target after them); a longer one is refused naming its line.
class PreferenceBatches final : public ResumableSource {
 public:
  PreferenceBatches(std::vector<PreferencePair> pairs, int64_t seq_len, uint64_t seed, LoaderOrder order,
                    int32_t pad_token, const std::string& name);
  // The next B/2 pairs of the order into B rows.
  void fill(const Tensor& tokens, const Tensor& targets) override;
  std::vector<RowInfo> rows() const override { return rows_; }
  // Pairs first, first + 1, ... (wrapping around) into the rows: the reference pass.
  void fill_from(int64_t first, const Tensor& tokens, const Tensor& targets);
  int64_t pairs() const { return static_cast<int64_t>(pairs_.size()); }
  // The reference log-probabilities of pair p's chosen and rejected completion.
  void set_reference(int64_t pair, double chosen, double rejected);
  LoaderState state() const override { return order_.state(); }
  void restore(const LoaderState& state) override { order_.restore(state); }
  void rewind() override { order_.rewind(); }

 private:
  void fill_pairs(const std::vector<int64_t>& ids, const Tensor& tokens, const Tensor& targets);
  struct Sequence {
    std::vector<int32_t> tokens;
    int64_t prompt = 0;  // tokens before the completion (not counting)
    int64_t length = 0;  // completion tokens (counting)
    double reference = 0.0;
  };
  std::vector<std::array<Sequence, 2>> pairs_;
  int64_t seq_len_;
  int32_t pad_;
  TokenLoader order_;  // over the pair indices, windows of one
  std::vector<RowInfo> rows_;
};

// A frozen reference beside a policy, run on a micro-batch's rows before the policy's forward:
// with LoRA the policy itself with its adapters off (no copy), else a copy of the policy's
// weights as they are when set() is called (the initial ones), in its precision.
class LiveReference {
 public:
  // Returns what the reference is, in words.
  std::string set(Transformer& policy);
  bool active() const { return policy_ != nullptr || copy_ != nullptr; }
  // Each row's summed log-probability of its counted targets under the reference. With LoRA the
  // reference forward uses `store` itself (the policy's forward then overwrites it); no dropout,
  // nothing recorded for FP8 scaling.
  std::vector<double> log_probs(Backend& backend, ActivationStore& store);

 private:
  Transformer* policy_ = nullptr;       // LoRA: the policy, run with its adapters off
  std::unique_ptr<Transformer> copy_;   // otherwise: the frozen initial weights
  std::unique_ptr<ActivationStore> store_;
};

// The objective of train.objective = dpo (Trainer::set_objective).
class DpoObjective final : public RowObjective {
 public:
  explicit DpoObjective(DpoConfig config) : config_(config) {}
  double weigh(Backend& backend, ActivationStore& store, const BatchSource& data) override;

  // The reference log-probabilities of every pair, from the trainer's model as it is now (before
  // any step): rows / 2 pairs at a time. Nothing to do for a reference-free loss or a live one.
  void compute_reference(Trainer& trainer, PreferenceBatches& pairs, int64_t rows) const;
  // dpo.reference = live: the reference is `policy` with its adapters off (LoRA) or a copy of its
  // weights as they are now (the initial ones), in its precision. Returns what it is, in words.
  std::string set_live_reference(Transformer& policy);
  void before_forward(Backend& backend, ActivationStore& store) override;

  // Sums over the pairs weighed since the last take_stats() (this rank's pairs).
  struct Stats {
    int64_t pairs = 0;
    double loss = 0, reward_chosen = 0, reward_rejected = 0, correct = 0;
  };
  Stats take_stats();

 private:
  DpoConfig config_;
  Stats stats_;
  LiveReference reference_;   // dpo.reference = live
  std::vector<double> live_;  // live: this micro-batch's rows' reference log-probabilities
};

// Each row's summed log-probability of its counted targets: -(sum of its positions' losses).
std::vector<double> row_log_probs(Backend& backend, const ActivationStore& store);

// Preference pairs as an objective's splits (DPO, ORPO): the last data.val_fraction held out
// (hold_out), the training pairs shuffled, each held-out pair validated once; rows padded with
// `pad`. The sources are PreferenceBatches.
TrainingSplits preference_splits(std::vector<PreferencePair> pairs, int32_t pad, const LoomConfig& config);

// train.objective = dpo: the objective its registry row makes (train/objective.cpp).
std::unique_ptr<Objective> make_dpo_objective(const LoomConfig& config);

}  // namespace loom
