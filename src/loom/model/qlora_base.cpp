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

namespace {

// Each block's four linear weights, as views of params.
std::array<Tensor, 4> block_weights(const ModelConfig& config, const ParamLayout& layout, const Tensor& params, int64_t l) {
  const BlockParams p = block_params_view(config, layout, params, l);
  return {p.attention.qkv_w, p.attention.proj_w, p.mlp.fc_w, p.mlp.fc2_w};
}

int64_t offset_in(const Tensor& params, const Tensor& view) {
  return (static_cast<const char*>(view.device_ptr()) - static_cast<const char*>(params.device_ptr())) /
         static_cast<int64_t>(sizeof(float));
}

const ParamSpec& spec_at(const ParamLayout& layout, int64_t offset) {
  for (const ParamSpec& spec : layout.params) {
    if (spec.offset == offset) return spec;
  }
  LOOM_CHECK(false, "QLoRA: no parameter starts at element ", offset, " of the layout");
  return layout.params.front();
}

}  // namespace

std::vector<const ParamSpec*> QloraBase::weight_specs(const ModelConfig& config, const ParamLayout& layout,
                                                      const Tensor& params) {
  std::vector<const ParamSpec*> out;
  for (int64_t l = 0; l < config.n_layer; ++l) {
    for (const Tensor& w : block_weights(config, layout, params, l)) out.push_back(&spec_at(layout, offset_in(params, w)));
  }
  return out;
}

void QloraBase::add(Backend& backend, const Tensor& params, const Tensor& w, std::span<const float> values,
                    LinearLayer& linear) {
  const Nf4Tensor t = nf4_quantize(values, w.dim(0), w.dim(1));
  Weight q;
  q.offset = offset_in(params, w);
  q.shape = w.shape();
  q.bytes = t.bytes();
  q.nf4 = std::make_unique<Nf4Device>(nf4_to_backend(t, backend, MEM_PARAMETERS));
  linear.set_base(q.nf4.get());
  weights_.push_back(std::move(q));
}

void QloraBase::quantize(Backend& backend, const ModelConfig& config, const ParamLayout& layout, const Tensor& params,
                         std::vector<Block>& blocks) {
  backend_ = &backend;
  params_ = params;
  for (int64_t l = 0; l < config.n_layer; ++l) {
    const std::array<LinearLayer*, 4> linears = blocks[static_cast<size_t>(l)].linears();
    const std::array<Tensor, 4> weights = block_weights(config, layout, params, l);
    for (size_t i = 0; i < weights.size(); ++i) {
      const Tensor& w = weights[i];
      std::vector<float> staged;  // a device's weight is quantized from a host copy (once, at set-up)
      if (!w.host_accessible()) {
        staged.resize(static_cast<size_t>(w.numel()));
        backend.read(w, staged.data());
      }
      const float* values = w.host_accessible() ? w.data<float>() : staged.data();
      add(backend, params, w, std::span<const float>(values, static_cast<size_t>(w.numel())), *linears[i]);
    }
  }
  materialize();
  release();
}

void QloraBase::load(Backend& backend, const ModelConfig& config, const ParamLayout& layout, const Tensor& params,
                     std::vector<Block>& blocks, const WeightRead& read) {
  backend_ = &backend;
  params_ = params;
  streamed_ = true;
  CpuAllocator host;
  for (int64_t l = 0; l < config.n_layer; ++l) {
    const std::array<LinearLayer*, 4> linears = blocks[static_cast<size_t>(l)].linears();
    const std::array<Tensor, 4> weights = block_weights(config, layout, params, l);
    for (size_t i = 0; i < weights.size(); ++i) {
      const Tensor staged = Tensor::empty(host, weights[i].shape(), DTYPE_F32, MEM_WORKSPACE);  // one weight
      read(spec_at(layout, offset_in(params, weights[i])).name, staged);
      add(backend, params, weights[i], std::span<const float>(staged.data<float>(), static_cast<size_t>(staged.numel())),
          *linears[i]);
    }
  }
}

const QloraBase::Weight* QloraBase::find(int64_t offset) const {
  for (const Weight& q : weights_) {
    if (q.offset == offset) return &q;
  }
  return nullptr;
}

void QloraBase::materialize(const Weight& q) const {
  backend_->nf4_dequantize(q.nf4->codes, q.nf4->absmax_codes, q.nf4->absmax_steps, q.nf4->spec, 0,
                           params_.view(q.offset, q.shape));
}

void QloraBase::release(const Weight& q) const {
  if (!params_.host_accessible()) return;  // a device's pages are the caching allocator's
  release_elements(params_, q.offset, q.offset + shape_numel(q.shape));
}

void QloraBase::materialize() const {
  for (const Weight& q : weights_) materialize(q);
}

void QloraBase::release() const {
  for (const Weight& q : weights_) release(q);
}

const QloraBase::Weight& QloraBase::at(int64_t offset) const {
  const Weight* q = find(offset);
  LOOM_CHECK(q != nullptr, "QLoRA: no quantized weight starts at element ", offset);
  return *q;
}

void QloraBase::materialize(int64_t offset) const { materialize(at(offset)); }

void QloraBase::release(int64_t offset) const { release(at(offset)); }

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
