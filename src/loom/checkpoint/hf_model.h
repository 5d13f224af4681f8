// Hugging Face model folders in and out (transformers' `save_pretrained` layout):
//   config.json                        the architecture's keys (GPT2Config, LlamaConfig, MistralConfig)
//   model.safetensors                  the weights, or
//   model.safetensors.index.json       {"weight_map": {tensor: file}} over model-0000N-of-0000M.safetensors
//
// The families and their config.json keys: checkpoint/hf_config.h. Tensors as transformers
// names them:
//   gpt2     wte, wpe, h.N.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}, ln_f, with
//            or without a "transformer." prefix; Conv1D weights stored (in, out) (Loom keeps
//            (out, in)); the head tied to wte (an lm_head.weight that differs from wte is
//            refused); the attention-mask buffers attn.bias / masked_bias ignored.
//   llama, mistral, qwen2, qwen3: model.embed_tokens, model.layers.N.{input_layernorm,
//            self_attn.{q,k,v,o}_proj (+ q/k/v biases, + q_norm / k_norm), post_attention_layernorm,
//            mlp.{gate,up,down}_proj}, model.norm, lm_head (absent when tied). Loom fuses q/k/v
//            into qkv_proj and gate/up into gate_up_proj (rows in that order); RoPE is
//            rotate-half in both.
//   mixtral  as llama with model.layers.N.block_sparse_moe.{gate, experts.E.{w1, w3, w2}} (gate,
//            up, down) in place of the MLP.
//   qwen3_moe  as qwen3 with mlp.{gate, experts.E.{gate,up,down}_proj}.
//   deepseek_v2 / _v3: MLA's self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj},
//            kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj (the RoPE rows permuted from
//            DeepSeek's interleaved pairs to rotate-half), mlp.{gate (+ e_score_correction_bias
//            in v3), experts.E.*, shared_experts.*} after the first_k_dense_replace dense
//            layers; V3's multi-token-prediction layers are skipped.
// F32, F16 and BF16 tensors load (widened exactly to f32); files are memory-mapped. A config key
// Loom does not know, or one whose value it does not implement (a yarn rope_scaling, attention_bias,
// a tied Llama head, ...), is refused naming config.json and the key; a missing, unexpected or
// misshapen tensor names the file and the tensor.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/arch/config.h"
#include "loom/checkpoint/checkpoint.h"
#include "loom/checkpoint/param_reader.h"

namespace loom {

// Whether `dir` is a Hugging Face model folder (config.json and model.safetensors or its index).
bool is_hf_model_dir(const std::string& dir);

// The model config of the folder's config.json.
ModelConfig hf_model_config(const std::string& dir);

// Fills model.params (host, f32, build_param_layout(model.config) order) from the folder's
// safetensors; every parameter must be found and every tensor used (or a known buffer).
void load_hf_weights(const std::string& dir, const ModelState& model);
// The same with the parameters named in `bf16` copied as they are stored (BF16) into those host
// bf16 tensors of the parameter's shape instead of model.params, whose elements there are left
// unwritten (weights used in place: train/model_source.h open_inference_model).
void load_hf_weights(const std::string& dir, const ModelState& model, const std::map<std::string, Tensor>& bf16);
// Whether every tensor the folder holds for each named parameter is stored as BF16.
bool hf_stored_as_bf16(const std::string& dir, const ModelConfig& config, const std::vector<std::string>& names);

// A folder's parameters read one at a time (streaming quantization holds one block at once;
// load_hf_weights reads them all). The constructor checks the config against the tensors and
// that every tensor of the folder belongs to a parameter (or is a known buffer), before anything
// is read; read() copies one parameter into a host tensor of its shape: f32 (widened exactly),
// or bf16 as stored (BF16 tensors only), dropping the pages of the file it read. A tied model's
// lm_head.weight, if the folder has one, is compared with the embedding when that is read.
class HfWeightReader {
 public:
  HfWeightReader(const std::string& dir, const ModelConfig& config);
  ~HfWeightReader();
  void read(const std::string& name, const Tensor& dst) const;
  // Whether every tensor of the parameter is stored as BF16.
  bool stored_as_bf16(const std::string& name) const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// The folder's parameters one at a time as f32 for an export (param_reader.h; HfWeightReader's
// checks first).
std::unique_ptr<ParamReader> hf_param_reader(const std::string& dir, const ModelConfig& config);

// Writes config.json and model.safetensors of `model` into `dir` (created; the files are
// written to temporary names, synced and renamed, so an interrupted export leaves no partial file).
void save_hf_model(const std::string& dir, const ModelState& model);
// The same from `params` read one parameter at a time (the peak is one parameter, not the
// model), in f32 or bf16 (rounded to nearest even).
void save_hf_model(const std::string& dir, ParamReader& params, DType dtype);

}  // namespace loom
