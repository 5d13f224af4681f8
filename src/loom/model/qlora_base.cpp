#include "loom/model/qlora_base.h"

#include <array>
#include <span>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/pages.h"

namespace loom {

void QloraBase::check(const Backend& backend, const ModelConfig& config, const Tensor& params, bool bf16_copy) const {
  LOOM_REFUSED(config.lora() && weights_.empty(), "peft.quantize_base (QLoRA) needs peft.method = lora");
  LOOM_CHECK(backend.capabilities().nf4, "peft.quantize_base (QLoRA) is not supported on "
             "the ", backend.name(), " backend yet (it lacks nf4_dequantize in the linear layers)");
  LOOM_REFUSED(!config.mla() && config.moe_experts == 0,
               "peft.quantize_base (QLoRA) with MoE or MLA blocks is not supported yet");
  LOOM_REFUSED(!bf16_copy, "peft.quantize_base (QLoRA) with precision.param = bf16 is not supported");
}

void QloraBase::quantize(Backend& backend, const ModelConfig& config, const ParamLayout& layout, const Tensor& params,
                         std::vector<Block>& blocks) {
  backend_ = &backend;
  params_ = params;
  for (int64_t l = 0; l < config.n_layer; ++l) {
    const BlockParams p = block_params_view(config, layout, params, l);
    const std::array<LinearLayer*, 4> linears = blocks[static_cast<size_t>(l)].linears();
    const std::array<Tensor, 4> weights = {p.attention.qkv_w, p.attention.proj_w, p.mlp.fc_w, p.mlp.fc2_w};
    for (size_t i = 0; i < weights.size(); ++i) {
      const Tensor& w = weights[i];
      std::vector<float> staged;  // a device's weight is quantized from a host copy (once, at set-up)
      if (!w.host_accessible()) {
        staged.resize(static_cast<size_t>(w.numel()));
        backend.read(w, staged.data());
      }
      const float* values = w.host_accessible() ? w.data<float>() : staged.data();
      const Nf4Tensor t = nf4_quantize(std::span<const float>(values, static_cast<size_t>(w.numel())), w.dim(0), w.dim(1));
      Weight q;
      q.offset = (static_cast<const char*>(w.device_ptr()) - static_cast<const char*>(params.device_ptr())) /
                 static_cast<int64_t>(sizeof(float));
      q.shape = w.shape();
      q.bytes = t.bytes();
      q.nf4 = std::make_unique<Nf4Device>(nf4_to_backend(t, backend, MEM_PARAMETERS));
      linears[i]->set_base(q.nf4.get());
      weights_.push_back(std::move(q));
    }
  }
  materialize();
  release();
}

void QloraBase::materialize() const {
  for (const Weight& q : weights_) {
    backend_->nf4_dequantize(q.nf4->codes, q.nf4->absmax_codes, q.nf4->absmax_steps, q.nf4->spec, 0,
                             params_.view(q.offset, q.shape));
  }
}

void QloraBase::release() const {
  if (weights_.empty() || !params_.host_accessible()) return;  // a device's pages are the caching allocator's
  for (const Weight& q : weights_) {
    release_elements(params_, q.offset, q.offset + shape_numel(q.shape));
  }
}

int64_t QloraBase::params() const {
  int64_t total = 0;
  for (const Weight& q : weights_) total += shape_numel(q.shape);
  return total;
}

int64_t QloraBase::bytes() const {
  int64_t total = 0;
  for (const Weight& q : weights_) total += static_cast<int64_t>(q.bytes);
  return total;
}

}  // namespace loom
