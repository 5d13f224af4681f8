#include "loom/train/model_export.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "loom/arch/param_layout.h"
#include "loom/backend/backend.h"
#include "loom/checkpoint/peft.h"
#include "loom/checkpoint/weights.h"
#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/nn/lora.h"

namespace loom {

namespace {

// A sharded checkpoint read whole: the flat buffer, owned.
class WholeReader final : public ParamReader {
 public:
  WholeReader(const ModelSource& source, const ModelConfig& config)
      : params_(Tensor::empty(host_, {build_param_layout(config).total}, DTYPE_F32, MEM_PARAMETERS)) {
    ModelSource base = source;
    base.adapter.clear();
    base.config.model = config;
    load_weights(base, params_);
    reader_ = flat_param_reader(config, {params_.data<float>(), static_cast<size_t>(params_.numel())});
  }
  const ModelConfig& config() const override { return reader_->config(); }
  std::span<const float> read(const std::string& name) override { return reader_->read(name); }

 private:
  CpuAllocator host_;
  Tensor params_;
  std::unique_ptr<ParamReader> reader_;
};

std::unique_ptr<ParamReader> open_reader(const ModelSource& source, const ModelConfig& config) {
  if (auto reader = open_param_reader(source.path, config)) return reader;
  return std::make_unique<WholeReader>(source, config);
}

// The base's weights with each adapted one merged as it is read.
class MergedReader final : public ParamReader {
 public:
  MergedReader(const ModelSource& source, std::unique_ptr<ParamReader> base)
      : lora_(source.config.model), config_(lora_base_config(lora_)), layout_(build_param_layout(lora_)),
        base_(std::move(base)), backend_(make_cpu_backend()), adapters_(read_adapters(source, host_)) {
    for (const std::string& name : lora_merged_weights(lora_)) merged_.insert(name);
  }
  const ModelConfig& config() const override { return config_; }
  std::span<const float> read(const std::string& name) override {
    const std::span<const float> base = base_->read(name);
    if (merged_.count(name) == 0) return base;
    if (name != last_) {
      last_.clear();
      const ParamSpec& w = layout_.find(name);
      buffer_ = Tensor();  // the previous weight's buffer freed first
      buffer_ = Tensor::empty(host_, w.shape, DTYPE_F32, MEM_WORKSPACE);
      std::copy(base.begin(), base.end(), buffer_.data<float>());
      const auto adapter = [this](const std::string& a) {
        const ParamSpec& p = layout_.find(a);
        return adapters_.view(p.offset, p.shape);
      };
      lora_merge_weight(*backend_, lora_, name, adapter, buffer_);
      last_ = name;
    }
    return {buffer_.data<float>(), static_cast<size_t>(buffer_.numel())};
  }

 private:
  ModelConfig lora_, config_;
  ParamLayout layout_;
  std::unique_ptr<ParamReader> base_;
  CpuAllocator host_;
  std::unique_ptr<Backend> backend_;
  Tensor adapters_;
  std::set<std::string> merged_;
  Tensor buffer_;
  std::string last_;
};

}  // namespace

Tensor read_adapters(const ModelSource& source, Allocator& host) {
  const ModelConfig& c = source.config.model;
  LOOM_CHECK(c.lora(), source.path, " has no LoRA adapters (peft.method = none)");
  const ParamLayout layout = build_param_layout(c);
  Tensor params = Tensor::zeros_lazy(host, {layout.total}, DTYPE_F32, MEM_PARAMETERS);
  if (!source.adapter.empty()) {
    load_peft_adapter(source.adapter, ModelState{c, params});
    return params;
  }
  const auto reader = open_reader(source, c);  // the run's own adapters, inside its checkpoint
  for (const ParamSpec& spec : layout.params) {
    if (spec.offset < lora_begin(c, layout)) continue;
    const std::span<const float> v = reader->read(spec.name);
    std::copy(v.begin(), v.end(), params.data<float>() + spec.offset);
  }
  return params;
}

std::unique_ptr<ParamReader> open_export_reader(const ModelSource& source) {
  const ModelConfig& c = source.config.model;
  if (!c.lora()) return open_reader(source, c);
  // The base's parameters have the same names in the adapted layout: a run's checkpoint holds
  // both (read by the adapted config), a Hugging Face folder or checkpoint given --adapter the base.
  return std::make_unique<MergedReader>(source, open_reader(source, source.adapter.empty() ? c : lora_base_config(c)));
}

}  // namespace loom
