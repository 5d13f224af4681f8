// The MLP sub-layer of a block: out = mid + fc2(act(fc(norm2(mid)))) for a dense MLP (GELU or
// SwiGLU, ModelConfig), or out = mid + MoE(norm2(mid)) for a mixture of experts (nn/moe.h: its
// experts and router compute in fp32 whatever the precision policy). The plan's MLP kind picks.
#pragma once
#include <cstdint>
#include <vector>

#include "loom/arch/config.h"
#include "loom/backend/backend.h"
#include "loom/nn/layer.h"
#include "loom/nn/linear.h"
#include "loom/nn/lora.h"
#include "loom/nn/moe.h"
#include "loom/nn/plan.h"

namespace loom {

// The MLP sub-layer's parameters (or gradients) as views into a flat buffer: the dense MLP's fc
// and fc2, or (an MoE layer) moe's router and experts. Biases are undefined without them.
struct MlpParams {
  Tensor norm_w, norm_b;  // (C): the input's norm (not with model.post_norm)
  Tensor post_norm_w;     // (C): the output's norm (model.post_norm, model.sandwich_norm; RMSNorm)
  Tensor fc_w, fc_b;      // (F or 2F, C), (F or 2F)
  Tensor fc2_w, fc2_b;    // (C, F), (C)
  MoeParams moe;
  LoraAdapters fc_lora, fc2_lora;  // model.lora(): the adapters of gate/up and down (nn/lora.h)
};

// What the MLP sub-layer keeps for its backward, for one micro-batch.
struct MlpSaved {
  NormSaved norm;  // norm2 of mid (the residual stream's positions); not with model.post_norm
  Tensor post_in;  // the output's norm (ModelConfig::post_norms): its input, fc2's output (B,T,C)
  NormSaved post;  //   and its statistics
  Tensor fc;       // (B,T,F or 2F) pre-activation: dense
  Tensor act;      // (B,T,F): dense
  // Only for a split backward (zero-bubble pipelines), dense: fc2's and fc's output gradients
  // kept from the input pass for the weight pass (an MoE's weight gradients come in the input pass).
  Tensor dy_fc2, dy_fc;  // (B,T,C), (B,T,F or 2F)
  MoeSaved moe;          // moe: its routing and experts' activations (allocate_moe_saved)
  LoraDropout lora_dropout;  // peft.dropout in a training pass (the model sets it); p = 0 otherwise
};

// Each field the MLP sub-layer of `plan` allocates for `shape`, in allocation order (selective
// recompute: fc only; full: none), except an MoE's record, which allocate_moe_saved allocates.
void mlp_saved_fields(const ModelConfig& config, const LayerPlan& plan, const SavedShape& shape, MlpSaved& s,
                      const SavedFieldFn& field);

class MlpLayer {
 public:
  MlpLayer() = default;
  MlpLayer(const ModelConfig& config, MlpParams params, MlpParams grads)
      : config_(config), params_(std::move(params)), grads_(std::move(grads)) {}

  void set_plan(const LayerPlan& plan) { plan_ = plan; }
  void set_links(const LayerLinks& links) { links_ = links; }
  // The recipes of fc and fc2 and their weights' bf16 copies (empty without precision.param = bf16).
  void set_precision(const PrecisionPolicy& policy, MlpParams params16);

  // mid (B,Ts,C): the attention sub-layer's output; writes out = mid + mlp(norm2(mid)) and s.
  void forward(Backend& backend, const Tensor& mid, MlpSaved& s, const Tensor& out);
  // Decoding: one position of each of n sequences, fp32 (an MoE routes the n tokens; its
  // statistics are not recorded).
  void forward_rows(Backend& backend, const Tensor& mid, MlpSaved& s, const Tensor& out) const;
  // d_residual: gradient w.r.t. out on entry, w.r.t. mid on exit (BACKWARD_ALL / _INPUT);
  // BACKWARD_WEIGHT: fc2's and fc's weight gradients from the kept output gradients (an MoE's
  // came in the input pass). r16 (nn/layer.h ResidualDy16): d(out) in bf16 for fc2, and where
  // norm2's backward writes d(mid)'s rounding for the attention's proj.
  void backward(Backend& backend, const Tensor& mid, const MlpSaved& s, const Tensor& d_residual, BlockScratch& k,
                BackwardPart part, const ResidualDy16& r16 = {});
  // Selective recompute (dense, a whole layer): norm2 from mid and the activation from the kept fc.
  void recompute_selective(Backend& backend, const Tensor& mid, MlpSaved& s) const;

  LinearLayer* fc() { return &fc_; }
  LinearLayer* fc2() { return &fc2_; }

  // Mixture of experts (nn/moe.h): the scratch is shared by the layers; the loss weight scales
  // the auxiliary losses' gradients in backward (the cross-entropy's).
  bool is_moe() const { return plan_.mlp == MlpKind::moe; }
  void set_moe_scratch(MoeScratch* scratch) { moe_scratch_ = scratch; }
  // Expert parallel: this rank computes its share of the experts for the group's tokens.
  void set_expert_parallel(Communicator* ep) { ep_ = ep; }
  void set_loss_weight(float w) { loss_weight_ = w; }
  // Routing statistics accumulated over the forwards since the last reset (while recording).
  struct MoeStats {
    std::vector<double> load;  // [expert] assignments
    int64_t tokens = 0, dropped = 0, micro_batches = 0, dispatched = 0;
    double aux = 0, seq_aux = 0, z = 0, entropy = 0;  // sums over micro-batches
    void reset() {  // to no micro-batches, keeping load's capacity
      std::vector<double> kept = std::move(load);
      kept.clear();
      *this = MoeStats{};
      load = std::move(kept);
    }
  };
  MoeStats& moe_stats() { return moe_stats_; }
  void set_recording(bool on) { recording_ = on; }
  bool recording() const { return recording_; }
  const Tensor& moe_bias() const { return params_.moe.bias; }

 private:
  ModelConfig config_;
  MlpParams params_, grads_, params16_;
  LayerPlan plan_;
  LayerLinks links_;
  LinearLayer fc_, fc2_;
  // A training pass's adapters of gate/up (site 2) and down (site 3), with their dropout.
  LoraTerm fc_lora(const MlpSaved& s) const { return {&params_.fc_lora, config_.lora_scale(), s.lora_dropout.at_site(2)}; }
  LoraTerm fc2_lora(const MlpSaved& s) const {
    return {&params_.fc2_lora, config_.lora_scale(), s.lora_dropout.at_site(3)};
  }
  MoeScratch* moe_scratch_ = nullptr;
  Communicator* ep_ = nullptr;
  float loss_weight_ = 1.0f;
  MoeStats moe_stats_;
  bool recording_ = true;
  void forward_moe(Backend& backend, const Tensor& mid, MlpSaved& s, const Tensor& out);
  void activation(Backend& backend, const MlpSaved& s) const;
};

}  // namespace loom
