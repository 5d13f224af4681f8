#include "loom/train/model_source.h"

#include <filesystem>
#include <iostream>
#include <map>
#include <set>

#include "loom/arch/param_layout.h"
#include "loom/checkpoint/checkpoint.h"
#include "loom/checkpoint/hf_model.h"
#include "loom/checkpoint/param_reader.h"
#include "loom/checkpoint/peft.h"
#include "loom/checkpoint/weights.h"
#include "loom/core/error.h"
#include "loom/core/json_file.h"
#include "loom/nn/lora.h"
#include "loom/train/objective.h"

namespace loom {

namespace fs = std::filesystem;

std::string run_dir(const LoomConfig& config) { return (fs::path(config.run.dir) / config.run.name).string(); }

MemoryPlan memory_plan(const LoomConfig& config, int ranks) {
  MemoryPlan plan;
  plan.model = config.model;
  plan.batch = config.train.batch_size, plan.seq_len = config.train.seq_len;
  plan.recompute = config.train.recompute, plan.recompute_budget_mb = config.train.recompute_budget_mb;
  plan.optim = config.train.optim, plan.precision = config.train.precision;
  plan.zero_stage = static_cast<int>(config.parallel.zero_stage);
  plan.tp = static_cast<int>(config.parallel.tp), plan.sequence_parallel = config.parallel.sequence_parallel;
  plan.pp = static_cast<int>(config.parallel.pp), plan.schedule = config.parallel.schedule;
  plan.micro = config.train.grad_accum, plan.virtual_stages = static_cast<int>(config.parallel.virtual_stages);
  plan.cp = static_cast<int>(config.parallel.cp), plan.ulysses = config.parallel.cp_attention == CpAttention::ulysses;
  plan.ep = static_cast<int>(config.parallel.ep);
  plan.offload_activations = config.train.offload_activations;
  plan.flash_attention = config.train.flash_attention;
  plan.ranks = ranks;
  plan.compact_base = objective_row(config.loop.objective).layout.compact_base && config.device == DEVICE_CPU;
  return plan;
}

std::string resolve_checkpoint(const std::string& path) {
  LOOM_CHECK(fs::exists(path), path, ": no such checkpoint, run or checkpoints folder");
  if (fs::exists(fs::path(path) / "manifest.json")) return path;
  const std::string dir = fs::exists(fs::path(path) / "checkpoints") ? (fs::path(path) / "checkpoints").string() : path;
  CheckpointManager manager(dir);
  for (const std::string& step_dir : manager.list()) {
    const std::string problem = checkpoint_problem(step_dir);
    if (problem.empty()) return step_dir;
    std::cerr << "loom: checkpoint " << step_dir << " is corrupt (" << problem << "); trying an older one\n";
  }
  throw Error(str_cat(path, ": no valid checkpoint found"));
}

LoomConfig checkpoint_config(const std::string& step_dir) {
  const std::string trainer_json = (fs::path(step_dir) / "trainer.json").string();
  const nlohmann::json json = read_json_file(trainer_json);
  LoomConfig config;
  if (json.contains("config_text") && json["config_text"].is_string()) {
    apply_config_text(config, json["config_text"].get<std::string>(), trainer_json + " (config_text)");
  }
  config.model = checkpoint_model_config(step_dir);
  // A self-contained checkpoint carries its tokenizer: used wherever the step folder now is.
  if (fs::is_directory(fs::path(step_dir) / "tokenizer")) config.data.tokenizer = (fs::path(step_dir) / "tokenizer").string();
  return config;
}

ModelSource model_source(const std::string& path, const std::string& adapter) {
  ModelSource source;
  if (is_hf_model_dir(path)) {
    source.path = path;
    source.hf = true;
    source.config.model = hf_model_config(path);
    source.config.data.tokenizer = fs::absolute(path).string();
    source.config.run.name = fs::path(path).filename().string();
  } else {
    source.path = resolve_checkpoint(path);
    source.config = checkpoint_config(source.path);
    source.quantized = is_quantized_model(source.path);
  }
  if (!adapter.empty()) {
    LOOM_CHECK(!source.config.model.lora(), path, " already has LoRA adapters (peft.method = lora): merge them first "
               "(loom convert --to hf) to apply another");
    source.adapter = adapter;
    source.config.model = peft_adapter_config(adapter, source.config.model);
  }
  return source;
}

namespace {

// Weights that hold inf or NaN evaluate to "loss nan" and sample garbage: refused by name.
// `in_bf16`: parameters held in those tensors instead of params; `skip`: parameters whose f32
// elements are not used (a quantized model's integer weights: their scales are checked finite
// when written).
void check_finite_weights(const ModelSource& source, const Tensor& params,
                          const std::map<std::string, Tensor>& in_bf16 = {}, const std::set<std::string>& skip = {}) {
  for (const auto& [name, t] : in_bf16) {
    check_finite_param(source.path, name, {t.data<bf16>(), static_cast<size_t>(t.numel())});
  }
  const float* w = params.data<float>();
  for (const ParamSpec& p : build_param_layout(source.config.model).params) {
    if (in_bf16.count(p.name) || skip.count(p.name)) continue;
    check_finite_param(source.path, p.name, {w + p.offset, static_cast<size_t>(p.numel)});
  }
}

}  // namespace

void load_weights(const ModelSource& source, const Tensor& params) {
  if (source.adapter.empty()) {
    load_weights_from(source.path, ModelState{source.config.model, params});
    check_finite_weights(source, params);
    return;
  }
  // The base is the layout's first lora_begin elements (the same offsets as without adapters).
  const ModelConfig& c = source.config.model;
  load_weights_from(source.path, ModelState{lora_base_config(c), params.view(0, {lora_begin(c, build_param_layout(c))})});
  load_peft_adapter(source.adapter, ModelState{c, params});
  check_finite_weights(source, params);
}

void load_model(const ModelSource& source, Transformer& model) {
  const Tensor& params = model.params();
  CpuAllocator host;  // a device's parameters are loaded on the host, then written once
  const Tensor target = params.host_accessible() ? params : Tensor::empty(host, params.shape(), DTYPE_F32, MEM_WORKSPACE);
  std::map<std::string, IntWeight> weights;
  if (!source.quantized) {
    load_weights(source, target);
  } else {
    LOOM_CHECK(source.adapter.empty(), source.path, " is a quantized model: apply --adapter to the checkpoint it was made from");
    read_quantized_model(source.path, ModelState{source.config.model, target}, weights);
  }
  if (!params.host_accessible()) model.backend().write(params, target.data<float>());
  if (source.quantized) model.set_int_weights(std::move(weights));
}

namespace {

// The weights a dense model without adapters can use in bf16: the blocks' linear weights, the
// head and the token embedding (empty for MoE, MLA or LoRA).
std::vector<std::string> bf16_weight_names(const ModelConfig& c) {
  if (c.moe_experts > 0 || c.mla() || c.lora()) return {};
  std::vector<std::string> names;
  for (const ParamSpec& p : build_param_layout(c).params) {
    if (p.role == ROLE_HIDDEN || p.role == ROLE_HEAD || p.name == embedding_param_name(c)) names.push_back(p.name);
  }
  return names;
}

}  // namespace

std::vector<std::string> bf16_in_place_names(const ModelSource& source) {
  if (!source.hf || !source.adapter.empty() || source.quantized) return {};
  std::vector<std::string> names = bf16_weight_names(source.config.model);
  if (names.empty() || !hf_stored_as_bf16(source.path, source.config.model, names)) return {};
  return names;
}

void use_bf16_weights(Transformer& model) {
  const std::vector<std::string> names = bf16_weight_names(model.config());
  LOOM_CHECK(!names.empty(), "bf16 weights in place need a dense model without adapters (no MoE, MLA or LoRA)");
  Backend& backend = model.backend();
  std::map<std::string, Tensor> weights;
  for (const std::string& name : names) {
    const Tensor f32 = model.param(name);
    weights[name] = Tensor::empty(backend.allocator(), f32.shape(), DTYPE_BF16, MEM_PARAMETERS);
    backend.cast(f32, weights[name]);  // round to nearest even
  }
  model.set_bf16_weights(std::move(weights));
}

std::unique_ptr<Transformer> open_inference_model(const ModelSource& source, Backend& backend, bool f32_weights) {
  const ModelConfig& c = source.config.model;
  std::vector<std::string> names;  // used in bf16 where they lie
  if (!f32_weights) names = source.quantized ? quantized_model_bf16_params(source.path) : bf16_in_place_names(source);
  // Lazy parameter pages: elements that are never written (bf16 weights, integer weights) hold nothing.
  const bool lazy = !names.empty() || source.quantized;
  auto model = std::make_unique<Transformer>(backend, c, ModelUse{.gradients = false, .lazy_params = lazy});
  // Prompts and evaluation windows keep O(T) attention records (lse), not T x T probabilities per
  // head and layer: 2.1 GB for a 1,024-token prompt on a 16-layer, 32-head model. (MLA has no
  // flash kernel; it keeps its own.)
  if (!c.mla()) model->set_flash_attention(true);
  if (!lazy) {
    load_model(source, *model);
    return model;
  }
  const Tensor& params = model->params();
  const bool on_host = params.host_accessible();
  CpuAllocator host;  // a device's weights are read on the host, then written once
  const Tensor target = on_host ? params : Tensor::zeros_lazy(host, params.shape(), DTYPE_F32, MEM_WORKSPACE);
  std::map<std::string, Tensor> weights;
  for (const std::string& name : names) {
    const Shape& shape = model->layout().find(name).shape;
    weights[name] = on_host ? Tensor::empty(backend.allocator(), shape, DTYPE_BF16, MEM_PARAMETERS)
                            : Tensor::empty(host, shape, DTYPE_BF16, MEM_WORKSPACE);
  }
  std::map<std::string, IntWeight> ints;
  std::set<std::string> quantized;
  if (source.quantized) {
    LOOM_CHECK(source.adapter.empty(), source.path, " is a quantized model: apply --adapter to the checkpoint it was made from");
    read_quantized_model(source.path, ModelState{c, target}, ints, weights);
    for (const auto& [name, q] : ints) quantized.insert(name);
  } else {
    load_hf_weights(source.path, ModelState{c, target}, weights);
  }
  if (c.tied_head()) quantized.erase(embedding_param_name(c));  // a tied head's embedding is looked up: checked
  check_finite_weights(source, target, weights, quantized);
  if (!on_host) {
    backend.write(params, target.data<float>());
    for (auto& [name, w] : weights) {
      const Tensor device = Tensor::empty(backend.allocator(), w.shape(), DTYPE_BF16, MEM_PARAMETERS);
      backend.write(device, w.raw_data());
      w = device;
    }
  }
  // Integer weights first: a tied head quantized while its embedding is looked up in bf16.
  if (!ints.empty()) model->set_int_weights(std::move(ints));
  if (!weights.empty()) model->set_bf16_weights(std::move(weights));
  return model;
}

std::unique_ptr<Backend> inference_backend(const ModelSource& source, const std::string& device) {
  const std::string name = device.empty() ? std::string(enum_name(source.config.device)) : device;
  try {
    return make_backend(name);
  } catch (const Error& e) {
    throw Error(str_cat(e.what(), device.empty() ? str_cat(" (", source.path, " was trained with it; --device cpu runs it on the CPU)")
                                                 : std::string(" (--device)")));
  }
}

std::string resolve_weights(const std::string& path) { return is_hf_model_dir(path) ? path : resolve_checkpoint(path); }

}  // namespace loom
