// A Hugging Face model folder's config.json <-> Loom's ModelConfig, family by family
// (transformers' configuration classes; docs/models.md has the key tables):
//   gpt2          GPT2Config
//   llama         LlamaConfig (Llama 2 / 3 / 3.1 / 3.2: rope_scaling "llama3" or "linear",
//                 tie_word_embeddings)
//   mistral       MistralConfig (sliding_window)
//   qwen2, qwen3  Qwen2Config (q/k/v biases), Qwen3Config (q/k norm)
//   smollm3       SmolLM3Config: llama with RoPE skipped on every no_rope_layer_interval-th layer
//   phi3          Phi3Config (Phi-3 / Phi-3.5 / Phi-4 mini shapes): llama with q/k/v and gate/up stored
//                 fused (Loom's own layout) and a sliding window; LongRoPE refused
//   olmo2         Olmo2Config: llama with post-norms on the attention and MLP outputs and q/k
//                 norms over all heads at once
//   mixtral       MixtralConfig: every layer a softmax top-k MoE, gates renormalised
//   qwen3_moe     Qwen3MoeConfig: qwen3 attention, MoE with norm_topk_prob
//   deepseek_v2   DeepseekV2Config: MLA (kv_lora_rank, q_lora_rank, qk_nope/rope, v_head_dim),
//                 softmax "greedy" routing, shared experts, first_k_dense_replace dense layers
//   deepseek_v3   DeepseekV3Config: as v2 with sigmoid "noaux_tc" group-limited routing and the
//                 e_score_correction_bias
// Every key is mapped, known not to change the weights' arithmetic (metadata, dropout,
// generation defaults, training-only coefficients), required to have the one value Loom
// implements, or refused naming config.json and the key.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "loom/arch/config.h"
#include "loom/core/enum_names.h"

namespace loom {

enum class HfFamily {
  gpt2, llama, mistral, qwen2, qwen3, mixtral, qwen3_moe, deepseek_v2, deepseek_v3, smollm3, phi3, olmo2, gemma3_text,
  qwen3_next, gpt_oss
};

template <>
struct EnumNames<HfFamily> {  // config.json's model_type
  static constexpr std::array<std::string_view, 15> names{"gpt2",        "llama",   "mistral", "qwen2",      "qwen3",
                                                          "mixtral",     "qwen3_moe", "deepseek_v2", "deepseek_v3",
                                                          "smollm3",     "phi3",    "olmo2",   "gemma3_text", "qwen3_next",
                                                          "gpt_oss"};
};

// The family and model config of a config.json (path: for errors).
struct HfConfig {
  HfFamily family = HfFamily::llama;
  ModelConfig model;
};
HfConfig read_hf_config(const std::string& path);

// The family a Loom model exports to (refused naming the keys when none fits), and its config.json.
HfFamily hf_family_of(const ModelConfig& c);
nlohmann::json hf_config_json(const ModelConfig& c);

}  // namespace loom
