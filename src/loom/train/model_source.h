// Where a model's weights come from: a Loom checkpoint (a step, run or checkpoints folder), a
// quantized model folder or a Hugging Face model folder, with an optional PEFT adapter; and the
// run folder and memory plan a config names. Used by every command that reads a model and by the
// training run (train.init_from, distill.teacher).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "loom/memory/estimate.h"
#include "loom/model/transformer.h"
#include "loom/train/config.h"

namespace loom {

// runs/<name>
std::string run_dir(const LoomConfig& config);

// The memory estimate's plan (memory/estimate.h) of a config, with `ranks` data-parallel ranks.
MemoryPlan memory_plan(const LoomConfig& config, int ranks);

// A step folder, a run folder (its checkpoints/ is searched) or a checkpoints folder -> the
// newest valid step folder, reporting skipped corrupt ones on stderr.
std::string resolve_checkpoint(const std::string& path);

// The config a checkpoint was trained with (its resolved TOML), with its model config.
LoomConfig checkpoint_config(const std::string& step_dir);

// What `--checkpoint PATH` names: a Loom checkpoint (a step, run or checkpoints folder: the
// newest valid step, as resolve_checkpoint) or a Hugging Face model folder (config.json and
// safetensors, checkpoint/hf_model.h).
struct ModelSource {
  std::string path;   // the step folder, or the Hugging Face folder
  bool hf = false;
  LoomConfig config;  // the run's; for a Hugging Face folder the defaults with its model, and
                      // data.tokenizer = the folder (its tokenizer files)
  std::string adapter;  // a PEFT LoRA adapter folder loaded onto the weights (config.model has its peft.*)
  bool quantized = false;  // a quantized model folder (loom quantize): load it with load_model
};
// `adapter`, when given, is a PEFT LoRA folder (checkpoint/peft.h) applied to the weights.
ModelSource model_source(const std::string& path, const std::string& adapter = "");
// Fills `params` (the model's flat host f32 buffer, source.config.model's layout) from the source.
void load_weights(const ModelSource& source, const Tensor& params);
// The source's weights into `model`: load_weights, or for a quantized model folder its f32
// parameters and its integer weights (Transformer::set_int_weights). On a device (parameters
// the host cannot read) through a host staging copy and Backend::write.
void load_model(const ModelSource& source, Transformer& model);
// The model eval, generate, bench generate and serve run: an inference Transformer (no gradient
// buffers, ModelUse) on `backend` with the source's weights. The weights of a Hugging Face
// folder that stores them in BF16 (every block's four linear weights, the head and the token
// embedding; dense models without adapters) are used in place: copied as they are into bf16
// tensors the layers multiply with and the embedding looks up (Transformer::set_bf16_weights,
// Backend::bf16_weight_linear), their f32 elements never written (lazy parameter pages), so
// the weights' resident bytes are about the file's.
// Its attention is the flash kernels' (O(T) records; not MLA's), and a prompt's forward keeps
// only the last position's logits (Transformer::allocate_prompt_store, the engine's prefill).
// f32_weights (--f32-weights) widens everything to f32 as load_model does.
std::unique_ptr<Transformer> open_inference_model(const ModelSource& source, Backend& backend, bool f32_weights = false);
// The parameters open_inference_model would use in bf16 (empty: none).
std::vector<std::string> bf16_in_place_names(const ModelSource& source);
// The same weights of `model` (random or loaded in f32) rounded to bf16 (nearest even) and used
// in place as a bf16 checkpoint's are (`bench generate --bf16-weights`); the f32 elements stay.
void use_bf16_weights(Transformer& model);
// The backend eval, generate, bench generate and serve run the model on: `device` ("cpu" |
// "cuda"), or when empty the source's run config's `device` (a checkpoint trained on a GPU runs
// there; a Hugging Face folder on the CPU). Errors name --device.
std::unique_ptr<Backend> inference_backend(const ModelSource& source, const std::string& device);
// A Hugging Face folder as it is, or a Loom run / checkpoints / step folder -> its newest valid step.
std::string resolve_weights(const std::string& path);

}  // namespace loom
