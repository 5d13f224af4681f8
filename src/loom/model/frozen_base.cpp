#include "loom/model/frozen_base.h"

#include <array>
#include <span>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/pages.h"

namespace loom {

bool FrozenBase::keeps_bf16(const ModelConfig& config, bool param_bf16, int64_t zero_stage) {
  return config.lora() && param_bf16 && !config.lora_quantize_base && !config.lora_dora && !config.mla() &&
         config.moe_experts == 0 && zero_stage == 0;
}

void FrozenBase::check(const Backend& backend, const ModelConfig& config, const Tensor& params, bool bf16_copy) const {
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
  LOOM_CHECK(false, "frozen base: no parameter starts at element ", offset, " of the layout");
  return layout.params.front();
}

}  // namespace

std::vector<const ParamSpec*> FrozenBase::weight_specs(const ModelConfig& config, const ParamLayout& layout,
                                                      const Tensor& params, bool head) {
  std::vector<const ParamSpec*> out;
  for (int64_t l = 0; l < config.n_layer; ++l) {
    for (const Tensor& w : block_weights(config, layout, params, l)) out.push_back(&spec_at(layout, offset_in(params, w)));
  }
  if (head && !config.tied_head()) out.push_back(&layout.find(head_param_name(config)));
  return out;
}

void FrozenBase::check_bf16(const Backend& backend, const ModelConfig& config, const Tensor& params,
                            const Tensor& params16) const {
  LOOM_CHECK(weights_.empty(), "the frozen base is already kept ", bf16_ ? "in bf16" : "in NF4");
  LOOM_REFUSED(keeps_bf16(config, params16.defined(), 0), "a frozen base kept in bf16 only needs LoRA (not QLoRA or "
               "DoRA) over dense blocks with precision.param = bf16");
  LOOM_CHECK(params.host_accessible() && params16.host_accessible(), "a frozen base kept in bf16 only is not "
             "supported on the ", backend.name(), " backend yet (its parameters are not host memory)");
}

void FrozenBase::add_bf16(const ModelConfig& config, const ParamLayout& layout, const Tensor& params,
                          const Tensor& params16) {
  params_ = params;
  bf16_ = true;
  const int64_t frozen = lora_begin(config, layout);
  for (const ParamSpec* spec : weight_specs(config, layout, params, true)) {
    LOOM_CHECK(spec->offset + spec->numel <= frozen, "frozen base: ", spec->name, " is not in the frozen range");
    Weight q;
    q.offset = spec->offset;
    q.shape = spec->shape;
    q.bytes = static_cast<size_t>(2 * spec->numel);
    q.bf16 = params16.view(spec->offset, spec->shape);
    weights_.push_back(std::move(q));
  }
}

void FrozenBase::keep_bf16(Backend& backend, const ModelConfig& config, const ParamLayout& layout, const Tensor& params,
                           const Tensor& params16) {
  check_bf16(backend, config, params, params16);
  backend_ = &backend;
  add_bf16(config, layout, params, params16);
  release();
}

void FrozenBase::load_bf16(Backend& backend, const ModelConfig& config, const ParamLayout& layout, const Tensor& params,
                           const Tensor& params16, const WeightRead& read) {
  check_bf16(backend, config, params, params16);
  backend_ = &backend;
  streamed_ = true;
  add_bf16(config, layout, params, params16);
  CpuAllocator host;
  for (const Weight& q : weights_) {
    const Tensor staged = Tensor::empty(host, q.shape, DTYPE_F32, MEM_WORKSPACE);  // one weight
    read(spec_at(layout, q.offset).name, staged);
    backend.cast(staged, q.bf16);
  }
  // The bf16 copy's first refresh (set_precision) read the untouched fp32 elements, which maps
  // the zero page under them: unmapped again, so they count as what they are, nothing.
  release();
}

RangeSet FrozenBase::ranges() const {
  std::vector<Range> out;
  for (const Weight& q : weights_) out.push_back({q.offset, q.offset + shape_numel(q.shape)});
  return RangeSet(std::move(out));
}

void FrozenBase::add(Backend& backend, const Tensor& params, const Tensor& w, std::span<const float> values,
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

void FrozenBase::quantize(Backend& backend, const ModelConfig& config, const ParamLayout& layout, const Tensor& params,
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

void FrozenBase::load(Backend& backend, const ModelConfig& config, const ParamLayout& layout, const Tensor& params,
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

const FrozenBase::Weight* FrozenBase::find(int64_t offset) const {
  for (const Weight& q : weights_) {
    if (q.offset == offset) return &q;
  }
  return nullptr;
}

void FrozenBase::materialize(const Weight& q) const {
  if (q.bf16.defined()) {  // exact: the f32 of each bf16 value
    backend_->cast(q.bf16, params_.view(q.offset, q.shape));
    return;
  }
  backend_->nf4_dequantize(q.nf4->codes, q.nf4->absmax_codes, q.nf4->absmax_steps, q.nf4->spec, 0,
                           params_.view(q.offset, q.shape));
}

void FrozenBase::release(const Weight& q) const {
  if (!params_.host_accessible()) return;  // a device's pages are the caching allocator's
  release_elements(params_, q.offset, q.offset + shape_numel(q.shape));
}

void FrozenBase::materialize() const {
  for (const Weight& q : weights_) materialize(q);
}

void FrozenBase::release() const {
  for (const Weight& q : weights_) release(q);
}

const FrozenBase::Weight& FrozenBase::at(int64_t offset) const {
  const Weight* q = find(offset);
  LOOM_CHECK(q != nullptr, "frozen base: no compact weight starts at element ", offset);
  return *q;
}

void FrozenBase::materialize(int64_t offset) const { materialize(at(offset)); }

void FrozenBase::release(int64_t offset) const { release(at(offset)); }

int64_t FrozenBase::params() const {
  int64_t total = 0;
  for (const Weight& q : weights_) total += shape_numel(q.shape);
  return total;
}

int64_t FrozenBase::bytes() const {
  int64_t total = 0;
  for (const Weight& q : weights_) total += static_cast<int64_t>(q.bytes);
  return total;
}

}  // namespace loom
