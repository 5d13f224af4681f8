// LoRA adapters in Hugging Face PEFT's layout (https://github.com/huggingface/peft, "LoraConfig"
// and `save_pretrained`), so that an adapter trained by Loom loads in PEFT and back:
//   adapter_config.json         {"peft_type": "LORA", "r", "lora_alpha", "use_rslora",
//                                "target_modules": [module names], "task_type": "CAUSAL_LM", ...}
//   adapter_model.safetensors   base_model.model.<the Hugging Face module>.lora_A.weight (r, in)
//                               and .lora_B.weight (out, r), f32 (F16 / BF16 widen on load)
//                               and, with use_dora, .lora_magnitude_vector (out) (also read
//                               with a .weight suffix)
// The module is the one transformers names (model.layers.N.self_attn.q_proj; GPT-2:
// transformer.h.N.attn.c_attn): arch/param_layout.h lora_sites. Loom's target names map to
// PEFT's target_modules: q, k, v, o, gate, up, down = q_proj, k_proj, v_proj, o_proj, gate_proj,
// up_proj, down_proj (GPT-2: c_attn for q, k, v together; attn.c_proj; c_fc; mlp.c_proj).
// What Loom does not implement is refused naming the file and key: bias
// training (bias != "none"), modules_to_save, layers_to_transform, rank_pattern / alpha_pattern.
// lora_dropout is read as peft.dropout (it has no effect outside training).
#pragma once
#include <string>

#include "loom/checkpoint/checkpoint.h"

namespace loom {

// Whether `dir` holds adapter_config.json.
bool is_peft_adapter_dir(const std::string& dir);

// `base` with the adapter's peft.* settings (method lora, rank, alpha, rslora, targets).
ModelConfig peft_adapter_config(const std::string& dir, const ModelConfig& base);

// Copies the adapter's tensors into model.params (model.config.lora(); every adapter of its
// layout must be in the file with its shape, and every tensor in the file used). A value that is
// not finite is an Error naming the file, the tensor and the element.
void load_peft_adapter(const std::string& dir, const ModelState& model);

// Writes adapter_config.json and adapter_model.safetensors of model's adapters into `dir`
// (created; each file through a temporary name, fsync and rename).
void save_peft_adapter(const std::string& dir, const ModelState& model);

}  // namespace loom
