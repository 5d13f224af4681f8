// A model config as the JSON a checkpoint's safetensors metadata keeps under "model_config",
// written and read through the model's one schema (arch/config.h visit_model_fields).
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "loom/arch/config.h"

namespace loom {

nlohmann::json model_config_json(const ModelConfig& config);
// The shortest decimal that reads back as `f` (0.02f -> 0.02, not 0.019999999552965164), for
// the JSON files that keep floats (checkpoints' model_config, Hugging Face config.json).
double shortest_decimal(float f);
// Parses and validates; errors name `path` and the metadata key.
ModelConfig model_config_from_json(const std::string& text, const std::string& path);

}  // namespace loom
