#include "loom/model/int_weights.h"

#include <array>

#include "loom/core/error.h"
#include "loom/core/pages.h"

namespace loom {

std::vector<LinearWeight> collect_linear_weights(const ModelConfig& config, const ParamLayout& layout,
                                                 const Tensor& params, std::vector<Block>& blocks, LinearLayer& head,
                                                 const Tensor& head_w) {
  LOOM_CHECK(!config.mla() && config.moe_experts == 0,
             "quantized linear weights with MoE or MLA blocks are not supported yet");
  std::map<int64_t, std::string> names;  // flat offset -> parameter name
  for (const ParamSpec& spec : layout.params) names.emplace(spec.offset, spec.name);
  auto offset_of = [&](const Tensor& w) {
    return (static_cast<const char*>(w.device_ptr()) - static_cast<const char*>(params.device_ptr())) /
           static_cast<int64_t>(sizeof(float));
  };
  std::vector<LinearWeight> out;
  for (int64_t l = 0; l < config.n_layer; ++l) {
    const BlockParams p = block_params_view(config, layout, params, l);
    const std::array<LinearLayer*, 4> linears = blocks[static_cast<size_t>(l)].linears();
    const std::array<Tensor, 4> weights = {p.attention.qkv_w, p.attention.proj_w, p.mlp.fc_w, p.mlp.fc2_w};
    for (size_t i = 0; i < weights.size(); ++i) {
      out.push_back({names.at(offset_of(weights[i])), linears[i], weights[i]});
    }
  }
  out.push_back({names.at(offset_of(head_w)), &head, head_w});
  return out;
}

void IntWeights::check(const Backend& backend, const Tensor& params) const {
  LOOM_CHECK(backend.capabilities().int_weights, "quantized checkpoints are not supported "
             "on the ", backend.name(), " backend yet (it lacks int_linear)");
  LOOM_CHECK(weights_.empty(), "set_int_weights: the model already has quantized weights");
}

void IntWeights::set(Backend& backend, const Tensor& params, const std::vector<LinearWeight>& linears,
                     const Tensor& tied, std::map<std::string, IntWeight> weights) {
  for (const LinearWeight& lw : linears) {
    auto it = weights.find(lw.name);
    if (it == weights.end()) continue;
    const IntWeightSpec& spec = it->second.spec;
    LOOM_CHECK(spec.rows == lw.weight.dim(0) && spec.cols == lw.weight.dim(1), lw.name, ": quantized as (", spec.rows,
               ", ", spec.cols, "), but the model's weight is (", lw.weight.dim(0), ", ", lw.weight.dim(1), ")");
    weights_.push_back(std::make_unique<IntWeightDevice>(int_weight_to_backend(it->second, backend, MEM_PARAMETERS)));
    lw.layer->set_int_weight(weights_.back().get());
    // The f32 weight's pages go back to the OS (a device's stay the caching allocator's).
    if (params.host_accessible() && !(tied.defined() && lw.weight.device_ptr() == tied.device_ptr())) {
      const int64_t begin =
          (static_cast<const char*>(lw.weight.device_ptr()) - static_cast<const char*>(params.device_ptr())) /
          static_cast<int64_t>(sizeof(float));
      release_elements(params, begin, begin + lw.weight.numel());
    }
    weights.erase(it);
  }
  LOOM_CHECK(weights.empty(), weights.empty() ? std::string() : weights.begin()->first,
             ": a quantized tensor that is not a linear layer's weight of this model");
}

int64_t IntWeights::params() const {
  int64_t total = 0;
  for (const auto& q : weights_) total += q->spec.rows * q->spec.cols;
  return total;
}

int64_t IntWeights::bytes() const {
  int64_t total = 0;
  for (const auto& q : weights_) total += q->bytes;
  return total;
}

}  // namespace loom
