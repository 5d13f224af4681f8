#include "loom/checkpoint/peft.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/arch/param_layout.h"
#include "loom/checkpoint/model_config_json.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/core/error.h"
#include "loom/core/file_io.h"
#include "loom/core/json_file.h"

namespace loom {

namespace fs = std::filesystem;

namespace {

constexpr const char* kAdapterConfig = "adapter_config.json";
constexpr const char* kAdapterWeights = "adapter_model.safetensors";
constexpr const char* kPrefix = "base_model.model.";
// Hugging Face's Llama-family module of each LoraTarget.
constexpr const char* kLlamaModules[LORA_TARGET_COUNT] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"};

// PEFT's target_modules for each Loom target (GPT-2: c_attn for q, k and v; c_proj is both the
// attention's and the MLP's output, told apart by its parent).
std::vector<std::string> target_modules(const ModelConfig& c) {
  const uint32_t mask = c.lora_target_mask();
  const auto on = [&](LoraTarget t) { return (mask & (1u << t)) != 0; };
  std::vector<std::string> out;
  if (c.arch == ARCH_GPT2) {
    if (on(LORA_Q) || on(LORA_K) || on(LORA_V)) out.push_back("attn.c_attn");
    if (on(LORA_O)) out.push_back("attn.c_proj");
    if (on(LORA_UP)) out.push_back("mlp.c_fc");
    if (on(LORA_DOWN)) out.push_back("mlp.c_proj");
    return out;
  }
  for (int t = 0; t < LORA_TARGET_COUNT; ++t) {
    if (on(static_cast<LoraTarget>(t))) out.push_back(kLlamaModules[t]);
  }
  return out;
}

// The Loom targets a PEFT module name selects (PEFT matches a name as a suffix of the module).
uint32_t targets_of_module(const ModelConfig& c, const std::string& module, const std::string& file) {
  const auto ends = [&](const char* s) {
    const std::string suffix(s);
    return module == suffix || (module.size() > suffix.size() &&
                                module.compare(module.size() - suffix.size(), suffix.size(), suffix) == 0 &&
                                module[module.size() - suffix.size() - 1] == '.');
  };
  const auto bit = [](LoraTarget t) { return 1u << t; };
  if (c.arch == ARCH_GPT2) {
    if (ends("c_attn")) return bit(LORA_Q) | bit(LORA_K) | bit(LORA_V);
    if (ends("attn.c_proj")) return bit(LORA_O);
    if (ends("mlp.c_proj")) return bit(LORA_DOWN);
    if (module == "c_proj") return bit(LORA_O) | bit(LORA_DOWN);
    if (ends("c_fc")) return bit(LORA_UP);
  } else {
    for (int t = 0; t < LORA_TARGET_COUNT; ++t) {
      if (ends(kLlamaModules[t])) return bit(static_cast<LoraTarget>(t));
    }
  }
  throw Error(str_cat(file, ": target_modules entry '", module, "' matches no linear layer Loom adapts in a ",
                      arch_name(c.arch), " model"));
}

// The tensor name PEFT stores a Loom adapter parameter under.
std::string peft_name(const ModelConfig& c, const std::string& loom_name) {
  return kPrefix + std::string(c.arch == ARCH_GPT2 ? "transformer." : "") + loom_name;
}

}  // namespace

bool is_peft_adapter_dir(const std::string& dir) {
  std::error_code ec;
  return fs::is_regular_file(fs::path(dir) / kAdapterConfig, ec);
}

ModelConfig peft_adapter_config(const std::string& dir, const ModelConfig& base) {
  const std::string file = (fs::path(dir) / kAdapterConfig).string();
  const nlohmann::json j = read_json_file(file);
  ModelConfig c = base;
  try {
    LOOM_CHECK(j.value("peft_type", std::string()) == "LORA", file, ": peft_type must be \"LORA\", got ",
               j.contains("peft_type") ? j.at("peft_type").dump() : std::string("nothing"));
    const auto refuse_if = [&](bool bad, const char* key, const char* why) {
      LOOM_CHECK(!bad, file, ": ", key, " = ", j.at(key).dump(), " is not supported (", why, ")");
    };
    if (j.contains("bias")) refuse_if(j.at("bias").get<std::string>() != "none", "bias", "Loom trains no biases with LoRA");
    for (const char* key : {"modules_to_save", "layers_to_transform", "layers_pattern"}) {
      if (j.contains(key)) refuse_if(!j.at(key).is_null() && !j.at(key).empty(), key, "every layer's targets only");
    }
    for (const char* key : {"rank_pattern", "alpha_pattern"}) {
      if (j.contains(key)) refuse_if(!j.at(key).is_null() && !j.at(key).empty(), key, "one rank and alpha for all");
    }
    LOOM_CHECK(j.contains("r") && j.contains("target_modules"), file, ": needs the keys r and target_modules");
    c.peft_method = PeftMethod::lora;
    c.lora_rank = j.at("r").get<int64_t>();
    c.lora_alpha = j.value("lora_alpha", 8.0f);
    c.lora_rslora = j.value("use_rslora", false);
    c.lora_dropout = j.value("lora_dropout", 0.0f);
    c.lora_dora = j.value("use_dora", false);
    std::vector<std::string> modules;
    if (j.at("target_modules").is_string()) modules.push_back(j.at("target_modules").get<std::string>());
    else modules = j.at("target_modules").get<std::vector<std::string>>();
    uint32_t mask = 0;
    for (const std::string& m : modules) mask |= targets_of_module(c, m, file);
    c.lora_targets.clear();
    for (int t = 0; t < LORA_TARGET_COUNT; ++t) {
      if ((mask & (1u << t)) == 0) continue;
      if (!c.lora_targets.empty()) c.lora_targets += ",";
      c.lora_targets += std::string(enum_name(static_cast<LoraTarget>(t)));
    }
    c.validate();
  } catch (const nlohmann::json::exception& e) {
    throw Error(str_cat(file, ": not a valid PEFT LoRA config (", e.what(), ")"));
  } catch (const Error& e) {
    const std::string what = e.what();
    throw Error(what.rfind(file, 0) == 0 ? what : str_cat(file, ": ", what));
  }
  return c;
}

void load_peft_adapter(const std::string& dir, const ModelState& model) {
  const ModelConfig& c = model.config;
  LOOM_CHECK(c.lora(), "load_peft_adapter: the model has no LoRA adapters (peft.method = none)");
  const std::string path = (fs::path(dir) / kAdapterWeights).string();
  LOOM_CHECK(fs::is_regular_file(path), dir, ": no ", kAdapterWeights, " (a PEFT adapter folder holds ",
             kAdapterConfig, " and ", kAdapterWeights, ")");
  const SafetensorsFile file = SafetensorsFile::read(path);
  const ParamLayout layout = build_param_layout(c);
  std::set<std::string> used;
  for (const ParamSpec& spec : layout.params) {
    if (spec.offset < lora_begin(c, layout)) continue;
    std::string name = peft_name(c, spec.name);
    if (!file.has(name) && c.arch == ARCH_GPT2) name = kPrefix + spec.name;  // saved without "transformer."
    if (!file.has(name) && file.has(name + ".weight")) name += ".weight";  // DoRA's magnitude, as a module's weight
    LOOM_CHECK(file.has(name), path, ": missing tensor '", peft_name(c, spec.name), "' (the adapter's targets are ",
               c.lora_targets, ", rank ", c.lora_rank, ")");
    LOOM_CHECK(file.shape(name) == spec.shape, path, ": tensor '", name, "' has shape ", shape_str(file.shape(name)),
               ", expected ", shape_str(spec.shape));
    const Tensor dst = model.params.view(spec.offset, spec.shape);
    file.copy_as_f32(name, dst);
    // Named here: a later check of the whole model would blame the base checkpoint.
    const float* w = dst.data<float>();
    for (int64_t i = 0; i < spec.numel; ++i) {
      LOOM_CHECK(std::isfinite(w[i]), path, ": tensor '", name, "' holds ", w[i], " at element ", i,
                 " (a diverged or corrupted adapter); refusing to use non-finite weights");
    }
    used.insert(name);
  }
  for (const std::string& name : file.names()) {
    LOOM_CHECK(used.count(name) != 0, path, ": tensor '", name, "' is not an adapter of this model's targets (",
               c.lora_targets, ")");
  }
}

void save_peft_adapter(const std::string& dir, const ModelState& model) {
  const ModelConfig& c = model.config;
  LOOM_CHECK(c.lora(), "save_peft_adapter: the model has no LoRA adapters (peft.method = none)");
  const ParamLayout layout = build_param_layout(c);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const ParamSpec& spec : layout.params) {
    if (spec.offset >= lora_begin(c, layout)) {
      tensors.emplace_back(peft_name(c, spec.name), model.params.view(spec.offset, spec.shape));
    }
  }
  nlohmann::json j = {{"peft_type", "LORA"},
                      {"task_type", "CAUSAL_LM"},
                      {"r", c.lora_rank},
                      {"lora_alpha", shortest_decimal(c.lora_alpha)},
                      {"use_rslora", c.lora_rslora},
                      {"use_dora", c.lora_dora},
                      {"lora_dropout", shortest_decimal(c.lora_dropout)},
                      {"bias", "none"},
                      {"fan_in_fan_out", c.arch == ARCH_GPT2},
                      {"target_modules", target_modules(c)},
                      {"modules_to_save", nullptr},
                      {"layers_to_transform", nullptr},
                      {"init_lora_weights", true},
                      {"inference_mode", true},
                      {"base_model_name_or_path", nullptr}};
  fs::create_directories(dir);
  write_safetensors((fs::path(dir) / kAdapterWeights).string(), tensors, {{"format", "pt"}});
  write_file_atomic((fs::path(dir) / kAdapterConfig).string(), j.dump(2) + "\n");
}

}  // namespace loom
