// Hugging Face model folders in and out (transformers' `save_pretrained` layout):
//   config.json                        the architecture's keys (GPT2Config, LlamaConfig, MistralConfig)
//   model.safetensors                  the weights, or
//   model.safetensors.index.json       {"weight_map": {tensor: file}} over model-0000N-of-0000M.safetensors
//
// Families mapped so far, with the tensors as transformers names them:
//   gpt2     GPT2LMHeadModel: wte, wpe, h.N.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
//            mlp.c_proj}, ln_f, with or without a "transformer." prefix; Conv1D weights stored
//            (in, out) (Loom keeps (out, in)); the head tied to wte (an lm_head.weight that
//            differs from wte is refused); the attention-mask buffers attn.bias / masked_bias ignored.
//   llama    LlamaForCausalLM (Llama 2 / 3 shapes) and mistral (MistralForCausalLM, its
//            sliding_window as model.attn_window): model.embed_tokens, model.layers.N.
//            {input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
//            mlp.{gate,up,down}_proj}, model.norm, lm_head. Loom fuses q/k/v into qkv_proj and
//            gate/up into gate_up_proj (rows in that order); RoPE is rotate-half in both.
//   qwen2    Qwen2ForCausalLM: llama plus q/k/v biases (model.qkv_bias). A Llama-family head tied
//            to the embedding (tie_word_embeddings) sets model.tie_embeddings.
// F32, F16 and BF16 tensors load (widened exactly to f32); files are memory-mapped. A config key
// Loom does not know, or one whose value it does not implement (rope_scaling, attention_bias,
// a tied Llama head, ...), is refused naming config.json and the key; a missing, unexpected or
// misshapen tensor names the file and the tensor.
#pragma once
#include <string>

#include "loom/arch/config.h"
#include "loom/checkpoint/checkpoint.h"

namespace loom {

// Whether `dir` is a Hugging Face model folder (config.json and model.safetensors or its index).
bool is_hf_model_dir(const std::string& dir);

// The model config of the folder's config.json.
ModelConfig hf_model_config(const std::string& dir);

// Fills model.params (host, f32, build_param_layout(model.config) order) from the folder's
// safetensors; every parameter must be found and every tensor used (or a known buffer).
void load_hf_weights(const std::string& dir, const ModelState& model);

// Writes config.json and model.safetensors of `model` into `dir` (created; the files are
// written to temporary names, synced and renamed, so an interrupted export leaves no partial file).
void save_hf_model(const std::string& dir, const ModelState& model);

}  // namespace loom
