// Quantized model folders (loom quantize --out; the layout in checkpoint.h): a step folder
// without optimizer state whose model.safetensors holds each quantized weight's packed codes,
// scales and zero points beside the f32 parameters, committed as a save is (commit_folder).
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

void write_quantized_model(const std::string& dir, const QuantizedModelContents& c) {
  const fs::path final_dir(dir), tmp_dir(dir + kTmpSuffix);
  std::error_code ec;
  LOOM_CHECK(!fs::exists(final_dir, ec) || is_quantized_model(dir), dir, ": exists and is not a quantized model; "
             "choose another --out (nothing was written)");
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir);
  try {
    CpuAllocator host;
    std::vector<std::pair<std::string, Tensor>> tensors;
    const ParamLayout layout = build_param_layout(c.model.config);
    for (const ParamSpec& spec : layout.params) {
      if (c.weights.count(spec.name) == 0 || c.also_f32.count(spec.name) != 0) {
        tensors.emplace_back(spec.name, c.model.params.view(spec.offset, spec.shape));
      }
    }
    auto host_tensor = [&](const Shape& shape, DType dtype, const void* data) {
      Tensor t = Tensor::empty(host, shape, dtype, MEM_WORKSPACE);
      std::memcpy(t.raw_data(), data, t.nbytes());
      return t;
    };
    for (const auto& [name, q] : c.weights) {
      const IntWeightSpec& s = q.spec;
      tensors.emplace_back(name + ".qweight", host_tensor({s.rows, int_row_bytes(s.bits, s.cols)}, DTYPE_U8, q.codes.data()));
      tensors.emplace_back(name + ".scales", host_tensor({s.rows, s.cols / s.group}, DTYPE_F32, q.scales.data()));
      tensors.emplace_back(name + ".zeros", host_tensor({s.rows, s.cols / s.group}, DTYPE_U8, q.zeros.data()));
      if (!q.input_scale.empty()) tensors.emplace_back(name + ".input_scale", host_tensor({s.cols}, DTYPE_F32, q.input_scale.data()));
    }
    write_safetensors((tmp_dir / kModelFile).string(), tensors,
                      {{"format", "pt"},
                       {"arch", std::string(arch_name(c.model.config.arch))},
                       {"model_config", model_config_json(c.model.config).dump()},
                       {"hf_layout", "false"},
                       {"quantization", c.quantization.dump()}});
    CheckpointContents trainer;
    trainer.config_text = c.config_text;
    trainer.extra = {{"quantization", c.quantization}};
    trainer.attached = c.attached;
    commit_folder(tmp_dir, final_dir, trainer, 0, kQuantizedKind);
  } catch (...) {
    fs::remove_all(tmp_dir, ec);
    throw;
  }
}

nlohmann::json read_quantized_model(const std::string& dir, const ModelState& model, std::map<std::string, IntWeight>& weights) {
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
  auto expect = [&](const std::string& name, DType dtype, const Shape& shape) {
    LOOM_CHECK(file.has(name), path, ": missing tensor ", name);
    LOOM_CHECK(file.dtype(name) == dtype && file.shape(name) == shape, path, ": tensor ", name, " is ",
               file.stored_dtype(name), shape_str(file.shape(name)), ", expected ", dtype_name(dtype), shape_str(shape));
  };
  std::map<std::string, IntWeight> loaded;
  for (const ParamSpec& spec : layout.params) {
    if (file.has(spec.name) || !file.has(spec.name + ".qweight")) expect(spec.name, DTYPE_F32, spec.shape);
    if (!file.has(spec.name + ".qweight")) continue;
    LOOM_CHECK(spec.shape.size() == 2, path, ": ", spec.name, " is quantized but is not a matrix");
    const int64_t rows = spec.shape[0], cols = spec.shape[1];
    LOOM_CHECK(file.has(spec.name + ".scales"), path, ": missing tensor ", spec.name, ".scales");
    const Shape& scale_shape = file.shape(spec.name + ".scales");
    LOOM_CHECK(scale_shape.size() == 2 && scale_shape[1] > 0 && cols % scale_shape[1] == 0, path, ": tensor ", spec.name,
               ".scales has shape ", shape_str(scale_shape), ", expected (", rows, ", a divisor of ", cols, ")");
    IntWeight q;
    q.spec = int_weight_spec(bits, cols / scale_shape[1], rows, cols, act_int8, path + " (" + spec.name + ")");
    expect(spec.name + ".qweight", DTYPE_U8, {rows, int_row_bytes(bits, cols)});
    expect(spec.name + ".scales", DTYPE_F32, {rows, cols / q.spec.group});
    expect(spec.name + ".zeros", DTYPE_U8, {rows, cols / q.spec.group});
    CpuAllocator host;
    auto read = [&](const std::string& name, auto& vec) {
      const Tensor t = file.tensor(name, host, MEM_WORKSPACE);
      vec.resize(static_cast<size_t>(t.numel()));
      std::memcpy(vec.data(), t.raw_data(), t.nbytes());
    };
    read(spec.name + ".qweight", q.codes);
    read(spec.name + ".scales", q.scales);
    read(spec.name + ".zeros", q.zeros);
    if (file.has(spec.name + ".input_scale")) {
      expect(spec.name + ".input_scale", DTYPE_F32, {cols});
      read(spec.name + ".input_scale", q.input_scale);
    }
    loaded.emplace(spec.name, std::move(q));
  }
  // Everything fits: only now fill the caller's tensors.
  for (const ParamSpec& spec : layout.params) {
    if (file.has(spec.name)) file.copy_into(spec.name, model.params.view(spec.offset, spec.shape));
  }
  weights = std::move(loaded);
  return quantization;
}

}  // namespace loom
