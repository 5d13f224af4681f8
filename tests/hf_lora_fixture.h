// A Hugging Face fixture folder's model with LoRA adapters on `targets` (rank `rank`): the base
// weights loaded from the folder, the adapters initialised (A random, B zero), so the adapted
// model starts as the base. Used by the families' LoRA tests (test_gpt_oss.cpp, test_qwen3_next.cpp).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "loom/backend/backend.h"
#include "loom/checkpoint/hf_model.h"
#include "loom/model/transformer.h"
#include "loom/nn/lora.h"

namespace loom::test {

struct HfLora {
  ModelConfig config;  // the folder's, with peft.method = lora
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Transformer> model;
  int64_t begin = 0;  // the adapters' first element in the flat parameters
};

inline HfLora hf_lora(const std::string& dir, const std::string& targets, int64_t rank) {
  const ModelConfig base = hf_model_config(dir);
  HfLora f;
  f.config = base;
  f.config.peft_method = PeftMethod::lora;
  f.config.lora_rank = rank;
  f.config.lora_targets = targets;
  f.backend = make_cpu_backend();
  f.model = std::make_unique<Transformer>(*f.backend, f.config);
  f.begin = lora_begin(f.config, f.model->layout());
  f.model->init_weights(7, f.begin);
  load_hf_weights(dir, ModelState{base, f.model->params().view(0, {f.begin})});
  return f;
}

}  // namespace loom::test
