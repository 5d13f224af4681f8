// The small training runs the device-memory tests (test_device_memory.cpp: the strict backend)
// and the CUDA feature tests (test_cuda_features.cpp) compare with the CPU backend's: a preset
// under a precision recipe, or under one of the optimizers, a few steps on a cyclic corpus.
#pragma once
#include <string>
#include <vector>

#include "loom/model/transformer.h"
#include "loom/train/trainer.h"
#include "test_util.h"

namespace loom::test {

// One recipe (the precision keys) on a preset.
struct TrainCase {
  const char* preset;
  const char* compute;
  const char* param;
  bool loss_scaling;
  const char* master;  // precision.master
  bool stochastic;     // precision.stochastic_rounding
  const char* qat;     // precision.qat
  const char* reduce;  // precision.reduce
};

// The loss and gradient norm of each of `steps` training steps.
inline std::vector<double> losses_and_norms(Trainer& trainer, BatchSource& data, int steps) {
  std::vector<double> out;
  for (int s = 0; s < steps; ++s) {
    const StepStats st = trainer.train_step(data);
    out.push_back(st.loss);
    out.push_back(st.grad_norm);
  }
  return out;
}

// preset_override: the model to train instead of c.preset's.
inline std::vector<double> train(Backend& backend, const TrainCase& c, std::vector<double>* final_params,
                                 const ModelConfig* preset_override = nullptr) {
  ModelConfig config = preset_override != nullptr ? *preset_override : model_preset(c.preset);
  Transformer model(backend, config);
  model.init_weights(5);
  TrainConfig tc;
  tc.batch_size = 2, tc.seq_len = 12, tc.steps = 4, tc.grad_accum = 2, tc.schedule.warmup = 1;
  tc.precision.compute = c.compute;
  tc.precision.param = c.param;
  tc.loss_scaling = c.loss_scaling;
  tc.precision.master = c.master;
  tc.precision.stochastic_rounding = c.stochastic;
  tc.precision.qat = c.qat;
  tc.precision.reduce = c.reduce;
  Trainer trainer(backend, model, tc);
  RandomWindowSource data(cyclic_tokens(600, static_cast<int32_t>(config.vocab_size)), 11);
  std::vector<double> out = losses_and_norms(trainer, data, 4);
  RandomWindowSource eval_data(cyclic_tokens(600, static_cast<int32_t>(config.vocab_size)), 12);
  out.push_back(trainer.evaluate(eval_data, 2));
  *final_params = test::values(backend, model.params());
  return out;
}

// The precision recipes: GPT-2 in fp32, Llama (GQA) with bf16 GEMMs, a kept bf16 weight copy with
// fp16-style dynamic loss scaling, fp16 GEMMs with loss scaling, FP8 with delayed and current
// scaling, FP8 block scaling, MXFP4 / NVFP4 QAT, bf16 master weights with a bf16 gradient
// reduction, bf16 master weights with stochastic rounding.
inline std::vector<TrainCase> precision_recipes() {
  return {
      TrainCase{"gpt2-tiny", "f32", "f32", false, "f32", false, "none", "f32"},
      TrainCase{"llama-tiny", "bf16", "f32", false, "f32", false, "none", "f32"},
      TrainCase{"llama-tiny", "bf16", "bf16", true, "f32", false, "none", "f32"},
      TrainCase{"gpt2-tiny", "fp16", "f32", true, "f32", false, "none", "f32"},
      TrainCase{"gpt2-tiny", "fp8-delayed", "f32", false, "f32", false, "none", "f32"},
      TrainCase{"llama-tiny", "fp8-current", "f32", false, "f32", false, "none", "f32"},
      TrainCase{"gpt2-tiny", "fp8-block", "f32", false, "f32", false, "none", "f32"},
      TrainCase{"llama-tiny", "bf16", "f32", false, "f32", false, "mxfp4", "f32"},
      TrainCase{"gpt2-tiny", "f32", "f32", false, "f32", false, "nvfp4", "f32"},
      TrainCase{"llama-tiny", "bf16", "f32", false, "bf16", false, "none", "bf16"},
      TrainCase{"gpt2-tiny", "f32", "f32", false, "bf16", true, "none", "f32"}
  };
}

// MoE and MLA models: a GPT-2 with 4 experts (top 2, the balance losses, capacity drops, the
// routing bias), the MoE preset with a shared expert, sigmoid scores and two groups, the MLA
// preset, and MLA with a query latent and a sliding window.
inline std::vector<ModelConfig> moe_and_mla_models() {
  ModelConfig gpt2_moe = model_preset("gpt2-tiny");
  gpt2_moe.moe_experts = 4, gpt2_moe.moe_top_k = 2, gpt2_moe.moe_aux_alpha = 1e-2f, gpt2_moe.moe_z_alpha = 1e-3f;
  gpt2_moe.moe_capacity_factor = 1.0f, gpt2_moe.moe_bias_gamma = 1e-2f;
  ModelConfig llama_moe = model_preset("moe-tiny");  // a shared expert, sigmoid scores, two groups
  llama_moe.moe_sigmoid = true, llama_moe.moe_groups = 2, llama_moe.moe_route_scale = 2.5f;
  llama_moe.moe_seq_aux_alpha = 1e-2f;
  ModelConfig mla_q = model_preset("mla-tiny");  // a query latent and a sliding window
  mla_q.mla_q_rank = 12, mla_q.mla_nope_dim = 6, mla_q.mla_v_dim = 10, mla_q.attn_window = 4;
  return {gpt2_moe, llama_moe, model_preset("mla-tiny"), mla_q};
}

// gpt2-tiny trained three steps with `optimizer` (its losses and gradient norms), and its final weights.
inline std::vector<double> train_with(Backend& backend, const std::string& optimizer, std::vector<double>* final_params) {
  const ModelConfig config = model_preset("gpt2-tiny");
  Transformer model(backend, config);
  model.init_weights(7);
  TrainConfig tc;
  tc.batch_size = 2, tc.seq_len = 8, tc.steps = 3, tc.schedule.warmup = 1;
  tc.optim.name = optimizer;
  tc.optim.rank = 4;  // LDAdam: a low-rank projector on gpt2-tiny's hidden matrices
  Trainer trainer(backend, model, tc);
  RandomWindowSource data(cyclic_tokens(400, static_cast<int32_t>(config.vocab_size)), 13);
  const std::vector<double> out = losses_and_norms(trainer, data, 3);
  *final_params = test::values(backend, model.params());
  return out;
}

}  // namespace loom::test
