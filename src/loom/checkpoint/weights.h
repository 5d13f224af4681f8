// A model's weights from wherever a user has them: a Loom checkpoint's step folder (its
// manifest, model.safetensors and model config, checkpoint.h) or a Hugging Face model folder
// (config.json and safetensors, hf_model.h). eval, generate, convert and train.init_from read
// weights through here.
#pragma once
#include <memory>
#include <string>

#include "loom/arch/config.h"
#include "loom/backend/backend.h"
#include "loom/checkpoint/checkpoint.h"
#include "loom/checkpoint/param_reader.h"

namespace loom {

// The model config the weights at `path` (a step folder or a Hugging Face folder) were made for.
ModelConfig weights_model_config(const std::string& path);

// Fills model.params (host f32) from `path`; the optimizer state, if any, is not read.
void load_weights_from(const std::string& path, const ModelState& model);

// The same into a model's parameters on `backend` (through a host copy when the backend's
// memory is not host-readable).
void load_weights_from(const std::string& path, const ModelConfig& config, const Tensor& params, Backend& backend);

// A Hugging Face model folder or a Loom checkpoint step folder (resolved: train/model_source.h)
// holding `config`'s parameters, read one at a time (param_reader.h); null for a sharded
// checkpoint (one file per rank: read it whole).
std::unique_ptr<ParamReader> open_param_reader(const std::string& path, const ModelConfig& config);

}  // namespace loom
