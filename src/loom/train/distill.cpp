#include "loom/train/distill.h"

#include <memory>

#include "loom/core/error.h"
#include "loom/core/str_printf.h"
#include "loom/train/config.h"
#include "loom/train/lm_objective.h"
#include "loom/train/parallelize.h"
#include "loom/train/model_source.h"

namespace loom {

DistillObjective::DistillObjective(const DistillConfig& config, Transformer& teacher) : config_(config), teacher_(teacher) {}

void DistillObjective::before_forward(Backend& backend, ActivationStore& store) {
  if (teacher_store_.batch != store.batch || teacher_store_.seq_len != store.seq_len) {
    teacher_store_ = teacher_.allocate_store(store.batch, store.seq_len);
    kl_losses_ = Tensor::empty(backend.allocator(), {store.batch * store.seq_len}, DTYPE_F32, MEM_ACTIVATIONS);
    grad_ = Tensor::empty(backend.allocator(), store.logits.shape(), DTYPE_F32, MEM_ACTIVATIONS);
  }
  backend.copy(store.tokens, teacher_store_.tokens);
  backend.copy(store.targets, teacher_store_.targets);
  teacher_store_.docs = store.docs;
  const bool recording = teacher_.recording();
  teacher_.set_recording(false);
  teacher_.forward(teacher_store_, false);
  teacher_.set_recording(recording);
}

double DistillObjective::weigh(Backend& backend, ActivationStore& store, const BatchSource&) {
  const int64_t n = store.batch * store.seq_len;
  const double alpha = config_.alpha;
  last_ce_ = backend.sum(store.losses) / static_cast<double>(n);
  // The KL term's gradient, alpha / n per position (the backward adds it after the cross-entropy's).
  backend.soft_target_loss(store.logits, teacher_store_.logits, static_cast<float>(config_.temperature),
                       static_cast<float>(alpha / static_cast<double>(n)), kl_losses_, grad_);
  last_kl_ = backend.sum(kl_losses_) / static_cast<double>(n);
  store.ce_weight = static_cast<float>(1.0 - alpha);
  store.logit_grad = grad_;
  return (1.0 - alpha) * last_ce_ + alpha * last_kl_;
}

// ---- train.objective = distill --------------------------------------------------------------

namespace {

// The student trains on the language-modelling data; the teacher is loaded at set-up.
class Distill final : public LmObjective {
 public:
  void set_up(ObjectiveContext& ctx) override {
    const DistillConfig& c = ctx.config.distill;
    const ModelSource source = model_source(c.teacher);
    teacher_ = std::make_unique<Transformer>(ctx.backend, source.config.model);
    load_model(source, *teacher_);
    LOOM_CHECK(source.config.model.vocab_size == ctx.config.model.vocab_size, "distill.teacher = ", c.teacher, " has ",
               source.config.model.vocab_size, " tokens, the student ", ctx.config.model.vocab_size,
               ": the teacher must use the student's tokenizer");
    loss_ = std::make_unique<DistillObjective>(c, *teacher_);
    ctx.parts.trainer->set_objective(loss_.get());
    ctx.sink.line(str_printf("distill: teacher %s (%lld parameters), temperature %g, alpha %g", source.path.c_str(),
                             static_cast<long long>(teacher_->params().numel()), c.temperature, c.alpha));
  }

 private:
  std::unique_ptr<Transformer> teacher_;
  std::unique_ptr<DistillObjective> loss_;
};



}  // namespace

std::unique_ptr<Objective> make_distill_objective(const LoomConfig&) { return std::make_unique<Distill>(); }

}  // namespace loom
