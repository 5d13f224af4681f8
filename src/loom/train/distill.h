// Knowledge distillation (train.objective = distill; Hinton, Vinyals, Dean 2015, "Distilling the
// Knowledge in a Neural Network"): the student minimises
//   (1 - alpha) CE(student, next token) + alpha T^2 KL(softmax(teacher / T) || softmax(student / T))
// per position (the mean over the batch's B T positions), the teacher (distill.teacher: any
// checkpoint `loom eval` reads, a quantized one too) run forward on the same tokens in the same
// step. The two models must share the tokenizer (the vocabulary is compared); the student may be
// of any other shape. docs/compression.md.
#pragma once
#include <memory>
#include <string>

#include "loom/model/transformer.h"
#include "loom/train/objective.h"
#include "loom/train/trainer.h"

namespace loom {

struct DistillConfig {
  std::string teacher;       // distill.teacher: the teacher's checkpoint
  double temperature = 2.0;  // distill.temperature: T
  double alpha = 0.5;        // distill.alpha: the KL term's weight
};

class DistillObjective : public RowObjective {
 public:
  DistillObjective(const DistillConfig& config, Transformer& teacher);
  // The teacher's logits for the micro-batch's tokens (before the student's forward).
  void before_forward(Backend& backend, ActivationStore& store) override;
  // After the student's forward: the KL term's losses and gradient into the store; returns the
  // combined loss (the mean over positions).
  double weigh(Backend& backend, ActivationStore& store, const BatchSource& data) override;
  bool evaluates_own_loss() const override { return false; }  // validation: the student's cross-entropy
  // The last weigh's parts: the student's cross-entropy and the T^2 KL term (means).
  double last_ce() const { return last_ce_; }
  double last_kl() const { return last_kl_; }

 private:
  DistillConfig config_;
  Transformer& teacher_;
  ActivationStore teacher_store_;
  Tensor kl_losses_, grad_;
  double last_ce_ = 0.0, last_kl_ = 0.0;
};

// train.objective = distill: the objective its registry row makes (train/objective.cpp).
std::unique_ptr<Objective> make_distill_objective(const LoomConfig& config);

}  // namespace loom
