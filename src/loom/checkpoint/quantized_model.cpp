// Quantized model folders (loom quantize --out; the layout in checkpoint.h): a step folder
// without optimizer state whose model.safetensors holds each quantized weight's packed codes,
// scales and zero points beside the plain parameters, written tensor by tensor at offsets fixed
// by the plan (SafetensorsWriter) and committed as a save is (commit_folder).
#include "loom/checkpoint/checkpoint_internal.h"

#include <cstring>

#include "loom/arch/param_layout.h"
#include "loom/checkpoint/model_config_json.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/core/json_file.h"

namespace loom {

namespace fs = std::filesystem;
using namespace ckpt;

bool is_quantized_model(const std::string& path) {
  std::error_code ec;
  const fs::path manifest = fs::path(path) / kManifestFile;
  if (!fs::is_regular_file(manifest, ec)) return false;
  const nlohmann::json m = read_json_file(manifest.string());
  return m.is_object() && m.value("kind", nlohmann::json()) == kQuantizedKind;
}

struct QuantizedModelWriter::State {
  QuantizedModelPlan plan;
  ParamLayout layout;
  fs::path final_dir, tmp_dir;
  std::unique_ptr<SafetensorsWriter> file;
  bool committed = false;
};

QuantizedModelWriter::QuantizedModelWriter(std::string dir, QuantizedModelPlan plan) : s_(std::make_unique<State>()) {
  s_->layout = build_param_layout(plan.model);
  s_->final_dir = fs::path(dir);
  s_->tmp_dir = fs::path(dir + kTmpSuffix);
  std::error_code ec;
  LOOM_CHECK(!fs::exists(s_->final_dir, ec) || is_quantized_model(dir), dir, ": exists and is not a quantized model; "
             "choose another --out (nothing was written)");
  std::vector<SafetensorsWriter::Entry> entries;
  for (const ParamSpec& spec : s_->layout.params) {
    const auto q = plan.quantized.find(spec.name);
    if (q == plan.quantized.end() || plan.also_plain.count(spec.name)) {
      const DType dtype = plan.plain_type(spec.name);
      LOOM_CHECK(dtype == DTYPE_F32 || dtype == DTYPE_BF16, spec.name, ": a plain parameter is stored in f32 or bf16");
      entries.push_back({spec.name, dtype == DTYPE_F32 ? "F32" : "BF16", spec.shape});
    }
    if (q == plan.quantized.end()) continue;
    const IntWeightSpec& w = q->second.spec;
    LOOM_CHECK(spec.shape == Shape({w.rows, w.cols}), spec.name, ": quantized as (", w.rows, ", ", w.cols,
               "), but the parameter is ", shape_str(spec.shape));
    entries.push_back({spec.name + ".qweight", "U8", {w.rows, int_row_bytes(w.bits, w.cols)}});
    entries.push_back({spec.name + ".scales", plan.storage.f16_scales ? "F16" : "F32", {w.rows, w.cols / w.group}});
    if (!plan.storage.symmetric) entries.push_back({spec.name + ".zeros", "U8", {w.rows, w.cols / w.group}});
    if (q->second.input_scale) entries.push_back({spec.name + ".input_scale", "F32", {w.cols}});
  }
  for (const auto& [name, w] : plan.quantized) (void)s_->layout.find(name);  // each names a parameter
  nlohmann::json quantization = plan.quantization;
  quantization["scales"] = plan.storage.f16_scales ? "f16" : "f32";
  quantization["symmetric"] = plan.storage.symmetric;
  plan.quantization = quantization;
  fs::remove_all(s_->tmp_dir, ec);
  fs::create_directories(s_->tmp_dir);
  s_->file = std::make_unique<SafetensorsWriter>((s_->tmp_dir / kModelFile).string(), entries,
                                                 std::map<std::string, std::string>{
                                                     {"format", "pt"},
                                                     {"arch", std::string(arch_name(plan.model.arch))},
                                                     {"model_config", model_config_json(plan.model).dump()},
                                                     {"hf_layout", "false"},
                                                     {"quantization", quantization.dump()}});
  s_->plan = std::move(plan);
}

QuantizedModelWriter::~QuantizedModelWriter() {
  if (s_ == nullptr || s_->committed) return;
  s_->file.reset();
  std::error_code ec;
  fs::remove_all(s_->tmp_dir, ec);
}

std::vector<std::string> QuantizedModelWriter::plain_params() const {
  std::vector<std::string> out;
  for (const ParamSpec& spec : s_->layout.params) {
    if (!s_->plan.quantized.count(spec.name) || s_->plan.also_plain.count(spec.name)) out.push_back(spec.name);
  }
  return out;
}

void QuantizedModelWriter::write_plain(const std::string& name, const Tensor& host) {
  const ParamSpec& spec = s_->layout.find(name);
  const DType dtype = s_->plan.plain_type(name);
  LOOM_CHECK(host.device() == DEVICE_CPU && host.dtype() == dtype && host.shape() == spec.shape, name,
             ": written as a host ", dtype_name(dtype), shape_str(spec.shape), " tensor, got ", host.describe());
  s_->file->write(name, host.raw_data(), host.nbytes());
}

void QuantizedModelWriter::write_weight(const std::string& name, const IntWeight& q) {
  const auto it = s_->plan.quantized.find(name);
  LOOM_CHECK(it != s_->plan.quantized.end(), name, ": not planned as a quantized weight");
  const IntWeightSpec& s = it->second.spec;
  LOOM_CHECK(q.spec.bits == s.bits && q.spec.group == s.group && q.spec.rows == s.rows && q.spec.cols == s.cols &&
                 q.storage == s_->plan.storage && q.input_scale.empty() != it->second.input_scale,
             name, ": quantized otherwise than planned (bits, group, shape, storage or input scale)");
  const int64_t groups = s.rows * (s.cols / s.group);
  LOOM_CHECK(static_cast<int64_t>(q.codes.size()) == s.rows * int_row_bytes(s.bits, s.cols) &&
                 static_cast<int64_t>(q.scales.size()) == groups && static_cast<int64_t>(q.zeros.size()) == groups,
             name, ": codes, scales or zeros of the wrong size");
  s_->file->write(name + ".qweight", q.codes.data(), q.codes.size());
  if (s_->plan.storage.f16_scales) {
    const std::vector<uint16_t> half = int_f16_scales(q, name);
    s_->file->write(name + ".scales", half.data(), half.size() * sizeof(uint16_t));
  } else {
    s_->file->write(name + ".scales", q.scales.data(), q.scales.size() * sizeof(float));
  }
  if (!s_->plan.storage.symmetric) s_->file->write(name + ".zeros", q.zeros.data(), q.zeros.size());
  if (!q.input_scale.empty()) {
    LOOM_CHECK(static_cast<int64_t>(q.input_scale.size()) == s.cols, name, ": an input scale of ", q.input_scale.size(),
               " values for ", s.cols, " columns");
    s_->file->write(name + ".input_scale", q.input_scale.data(), q.input_scale.size() * sizeof(float));
  }
}

uint64_t QuantizedModelWriter::model_file_bytes() const { return s_->file->file_bytes(); }

void QuantizedModelWriter::commit(const std::string& config_text,
                                  const std::vector<std::pair<std::string, std::string>>& attached) {
  s_->file->close();
  CheckpointContents trainer;
  trainer.config_text = config_text;
  trainer.extra = {{"quantization", s_->plan.quantization}};
  trainer.attached = attached;
  commit_folder(s_->tmp_dir, s_->final_dir, trainer, 0, kQuantizedKind);
  s_->committed = true;
}

void write_quantized_model(const std::string& dir, const QuantizedModelContents& c) {
  QuantizedModelPlan plan;
  plan.model = c.model.config;
  for (const auto& [name, q] : c.weights) {
    plan.quantized[name] = {q.spec, !q.input_scale.empty()};
    plan.storage = q.storage;
  }
  plan.also_plain = c.also_f32;
  plan.quantization = c.quantization;
  QuantizedModelWriter writer(dir, plan);
  const ParamLayout layout = build_param_layout(c.model.config);
  for (const std::string& name : writer.plain_params()) {
    const ParamSpec& spec = layout.find(name);
    writer.write_plain(name, c.model.params.view(spec.offset, spec.shape));
  }
  for (const auto& [name, q] : c.weights) writer.write_weight(name, q);
  writer.commit(c.config_text, c.attached);
}

std::vector<std::string> quantized_model_bf16_params(const std::string& dir) {
  const std::string path = (fs::path(dir) / kModelFile).string();
  const SafetensorsFile file = SafetensorsFile::read(path);
  std::vector<std::string> out;
  for (const ParamSpec& spec : build_param_layout(checkpoint_model_config(dir)).params) {
    if (file.has(spec.name) && file.stored_dtype(spec.name) == "BF16") out.push_back(spec.name);
  }
  return out;
}

nlohmann::json read_quantized_model(const std::string& dir, const ModelState& model, std::map<std::string, IntWeight>& weights,
                                    const std::map<std::string, Tensor>& bf16) {
  const std::string problem = checkpoint_problem(dir);
  LOOM_CHECK(problem.empty(), dir, ": ", problem);
  LOOM_CHECK(is_quantized_model(dir), dir, ": not a quantized model (its manifest has no kind \"quantized\")");
  const ParamLayout layout = build_param_layout(model.config);
  check_flat_f32(model.params, layout.total, dir, "model params");
  const std::string path = (fs::path(dir) / kModelFile).string();
  const SafetensorsFile file = SafetensorsFile::read(path);
  nlohmann::json quantization;
  try {
    quantization = nlohmann::json::parse(file.metadata_value("quantization"));
  } catch (const nlohmann::json::exception& e) {
    throw Error(str_cat(path, ": metadata quantization is not JSON (", e.what(), ")"));
  }
  const int bits = quantization.value("bits", 0);
  const bool act_int8 = quantization.value("activations", std::string("f32")) == "int8";
  IntStorage storage;
  storage.f16_scales = quantization.value("scales", std::string("f32")) == "f16";
  storage.symmetric = quantization.value("symmetric", false);
  auto expect = [&](const std::string& name, const char* stored, const Shape& shape) {
    LOOM_CHECK(file.has(name), path, ": missing tensor ", name);
    LOOM_CHECK(file.stored_dtype(name) == stored && file.shape(name) == shape, path, ": tensor ", name, " is ",
               file.stored_dtype(name), shape_str(file.shape(name)), ", expected ", stored, shape_str(shape));
  };
  CpuAllocator host;
  std::map<std::string, IntWeight> loaded;
  for (const ParamSpec& spec : layout.params) {
    if (file.has(spec.name) || !file.has(spec.name + ".qweight")) {
      const bool half = file.has(spec.name) && file.stored_dtype(spec.name) == "BF16";
      expect(spec.name, half ? "BF16" : "F32", spec.shape);
      if (auto it = bf16.find(spec.name); it != bf16.end() && half) {
        LOOM_CHECK(it->second.dtype() == DTYPE_BF16 && it->second.shape() == spec.shape, spec.name,
                   ": a bf16 destination must be bf16", shape_str(spec.shape), ", got ", it->second.describe());
      }
    }
    if (!file.has(spec.name + ".qweight")) continue;
    LOOM_CHECK(spec.shape.size() == 2, path, ": ", spec.name, " is quantized but is not a matrix");
    const int64_t rows = spec.shape[0], cols = spec.shape[1];
    LOOM_CHECK(file.has(spec.name + ".scales"), path, ": missing tensor ", spec.name, ".scales");
    const Shape& scale_shape = file.shape(spec.name + ".scales");
    LOOM_CHECK(scale_shape.size() == 2 && scale_shape[1] > 0 && cols % scale_shape[1] == 0, path, ": tensor ", spec.name,
               ".scales has shape ", shape_str(scale_shape), ", expected (", rows, ", a divisor of ", cols, ")");
    IntWeight q;
    q.spec = int_weight_spec(bits, cols / scale_shape[1], rows, cols, act_int8, path + " (" + spec.name + ")");
    q.storage = storage;
    const Shape groups = {rows, cols / q.spec.group};
    expect(spec.name + ".qweight", "U8", {rows, int_row_bytes(bits, cols)});
    expect(spec.name + ".scales", storage.f16_scales ? "F16" : "F32", groups);
    if (!storage.symmetric) expect(spec.name + ".zeros", "U8", groups);
    auto read = [&](const std::string& name, auto& vec, DType dtype) {
      const Tensor t = Tensor::empty(host, file.shape(name), dtype, MEM_WORKSPACE);
      if (dtype == DTYPE_F32) file.copy_as_f32(name, t);
      else file.copy_into(name, t);
      vec.resize(static_cast<size_t>(t.numel()));
      std::memcpy(vec.data(), t.raw_data(), t.nbytes());
    };
    read(spec.name + ".qweight", q.codes, DTYPE_U8);
    read(spec.name + ".scales", q.scales, DTYPE_F32);  // F16 widened exactly
    if (storage.symmetric) q.zeros.assign(q.scales.size(), static_cast<uint8_t>(1 << (bits - 1)));
    else read(spec.name + ".zeros", q.zeros, DTYPE_U8);
    if (file.has(spec.name + ".input_scale")) {
      expect(spec.name + ".input_scale", "F32", {cols});
      read(spec.name + ".input_scale", q.input_scale, DTYPE_F32);
    }
    loaded.emplace(spec.name, std::move(q));
  }
  // Everything fits: only now fill the caller's tensors.
  for (const ParamSpec& spec : layout.params) {
    if (!file.has(spec.name)) continue;
    const auto it = bf16.find(spec.name);
    if (it != bf16.end() && file.stored_dtype(spec.name) == "BF16") file.copy_as_bf16(spec.name, it->second);
    else file.copy_as_f32(spec.name, model.params.view(spec.offset, spec.shape));
  }
  weights = std::move(loaded);
  return quantization;
}

}  // namespace loom
