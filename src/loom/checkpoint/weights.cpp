#include "loom/checkpoint/weights.h"

#include "loom/checkpoint/checkpoint_internal.h"
#include "loom/checkpoint/hf_model.h"
#include "loom/core/error.h"

namespace loom {

ModelConfig weights_model_config(const std::string& path) {
  return is_hf_model_dir(path) ? hf_model_config(path) : checkpoint_model_config(path);
}

void load_weights_from(const std::string& path, const ModelState& model) {
  if (is_hf_model_dir(path)) load_hf_weights(path, model);
  else CheckpointManager(path).load(path, model, OptimizerState{});
}

void load_weights_from(const std::string& path, const ModelConfig& config, const Tensor& params, Backend& backend) {
  if (params.host_accessible()) {
    load_weights_from(path, ModelState{config, params});
    return;
  }
  CpuAllocator host;
  const Tensor staging = Tensor::empty(host, params.shape(), DTYPE_F32, MEM_WORKSPACE);
  load_weights_from(path, ModelState{config, staging});
  backend.write(params, staging.data<float>());
}

std::unique_ptr<ParamReader> open_param_reader(const std::string& path, const ModelConfig& config) {
  if (is_hf_model_dir(path)) return hf_param_reader(path, config);
  return ckpt::checkpoint_param_reader(path, config);
}

}  // namespace loom
