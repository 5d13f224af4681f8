// Where every parameter lives in the flat parameter (and gradient, and optimizer-state)
// buffers. Derived once from the config; forward, backward, optimizer and checkpoint I/O all
// use these offsets. Names follow Hugging Face's where the layout allows (GPT-2: wte.weight,
// h.{i}.attn.c_attn.weight, ...; Llama: model.layers.{i}.self_attn.qkv_proj.weight, ...);
// every linear weight is stored (out_features, in_features).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "loom/core/tensor.h"
#include "loom/model/config.h"

namespace loom {

enum ParamInit : uint8_t { INIT_NORMAL, INIT_ZEROS, INIT_ONES, INIT_COUNT };

struct ParamSpec {
  std::string name;
  Shape shape;
  int64_t offset = 0;   // into the flat buffer, in elements
  int64_t numel = 0;
  bool weight_decay = false;  // matrices decay; norms and biases do not
  ParamInit init = INIT_NORMAL;
  float init_std = 0.0f;
};

struct ParamLayout {
  std::vector<ParamSpec> params;  // [param], in buffer order
  int64_t total = 0;

  const ParamSpec& find(const std::string& name) const;  // throws naming the parameter
};

ParamLayout build_param_layout(const ModelConfig& config);

}  // namespace loom
